"""Comparing a hybrid model file with llama.cpp, shared by the per-arch oracle tests
(test_llama_oracle_lfm2.py, test_llama_oracle_qwen35.py): the same calls (decodes and drafts rolled
back) on minigraph's Runner and on llama.cpp, with an f32 KV cache on both sides (llama.cpp in a
fresh interpreter whose context defaults are patched) or llama.cpp's default f16 KV cache."""
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

import minigraph as mg
from minigraph.models.gguf_io import load_gguf
from minigraph.models.runner import Runner
from minigraph.testing import llama_oracle as lo

N_UBATCH = 8
N_RS_SEQ = 3
BOUND = 1e-5            # f32 KV cache on both sides: max |minigraph - llama.cpp| / max |llama.cpp| per call
BOUND_F16 = 2e-3        # llama.cpp's default f16 KV cache
PROMPT = [3, 17, 5, 40, 11, 2, 29, 8, 33, 14, 6]       # 11 tokens: ubatches of 8 and 3
# (name, n_seq_max, calls): ("decode", {seq: tokens}) or ("draft", seq, draft, n_accept); the
# K-shift scenarios (rope models) also ("seq_add", seq, p0, p1, delta) / ("seq_div", seq, p0, p1, d)
SCENARIOS = [
    ("prefill", 1, [("decode", {0: PROMPT})]),
    ("decode", 1, [("decode", {0: PROMPT[:5]})] + [("decode", {0: [t]}) for t in [9, 21, 1, 47, 0, 30]]),
    ("two sequences", 2, [("decode", {0: PROMPT[:6], 1: PROMPT[5:]})]
     + [("decode", {0: [i + 1], 1: [40 - i]}) for i in range(4)]
     + [("decode", {1: [7, 8, 9]}), ("decode", {0: [12], 1: [13]})]),
    ("draft rolled back", 1, [("decode", {0: PROMPT[:6]}), ("draft", 0, [19, 23, 29, 31], 2),
                              ("decode", {0: [2]}), ("decode", {0: [4]})]),
]


# positions moved by seq_add / seq_div, then decoded on: llama.cpp re-rotates the cached keys
# before the next graph (its K shift); minigraph must do the same (models/k_shift.py)
K_SHIFT_SCENARIOS = [
    ("seq_add whole sequence", 1, [("decode", {0: PROMPT}), ("seq_add", 0, 0, -1, 7), ("decode", {0: [4]}),
                                   ("decode", {0: [9, 1]})]),
    ("seq_add one of two", 2, [("decode", {0: PROMPT[:6], 1: PROMPT[5:]}), ("seq_add", 1, 0, -1, 5),
                               ("decode", {0: [1], 1: [2]}), ("seq_add", 0, 0, -1, -3), ("decode", {0: [3], 1: [4]})]),
    ("seq_add a gap", 1, [("decode", {0: PROMPT}), ("seq_add", 0, 4, -1, 3), ("decode", {0: [4, 5]})]),
    ("seq_div", 1, [("decode", {0: PROMPT}), ("seq_div", 0, 0, -1, 2), ("decode", {0: [4]})]),
]


@pytest.fixture(autouse=True)
def llama_installed():
    """Imported by the test modules: skips them, saying how to install, without llama.cpp."""
    if not lo.installed():
        pytest.skip(lo.not_installed_reason())


@pytest.fixture(autouse=True)
def one_cpu_thread():
    d = mg.backend("cpu")
    saved = d.n_threads
    d.set_n_threads(1)
    yield
    d.n_threads = saved


def _jsonable(calls):
    return [[c[0], {str(k): v for k, v in c[1].items()}] if c[0] == "decode" else list(c) for c in calls]


# The worker: the harness in a fresh interpreter, with an f32 KV cache (type_k / type_v = GGML_TYPE_F32).
WORKER = r'''
import json, pickle, sys
from minigraph.testing import llama_oracle as lo
L = lo.llama_cpp()
default = L.llama_context_default_params
def f32_kv():
    cp = default()
    cp.type_k = cp.type_v = 0
    return cp
L.llama_context_default_params = f32_kv
path, n_seq, n_rs_seq, n_ubatch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
calls = json.loads(sys.stdin.read())
res = []
# no snapshots: a draft rolls back through a checkpoint in a spare sequence, asked for only when
# there is a draft (an unused extra sequence makes llama.cpp abort on kimi-linear batches of two
# sequences whose MLA block precedes a KDA block: GGML_ASSERT(ggml_can_repeat(b, a)) in ggml_add)
spare = None if n_rs_seq or all(c[0] == "decode" for c in calls) else n_seq
with lo.LlamaOracle(path, n_ubatch=n_ubatch, n_seq_max=n_seq + (spare is not None), n_rs_seq=n_rs_seq,
                    n_threads=1) as ll:
    if ll.n_rs_seq != n_rs_seq:
        sys.exit(f"llama.cpp gave the context n_rs_seq {ll.n_rs_seq}, asked {n_rs_seq}")
    for c in calls:
        if c[0] == "decode":
            res.append(ll.decode({int(k): v for k, v in c[1].items()}))
        elif c[0] in ("seq_add", "seq_div"):      # llama_memory_seq_add / _div: the K shift runs lazily
            getattr(L, "llama_memory_" + c[0])(ll.mem, *c[1:])
            res.append({})
        else:
            res.append({c[1]: ll.speculative_step(c[1], c[2], c[3], spare=spare)})
pickle.dump(res, open(out, "wb"))
'''


def llama_f32(path, n_seq, calls, tmp_path, n_rs_seq=N_RS_SEQ):
    """llama.cpp's logits for the calls with an f32 KV cache. n_rs_seq 0 (an arch llama.cpp gives
    no snapshots, e.g. kimi-linear): a draft rolls back through a checkpoint in a spare sequence."""
    out = tmp_path / "logits.pkl"
    p = subprocess.run([sys.executable, "-c", WORKER, str(path), str(n_seq), str(n_rs_seq), str(N_UBATCH), str(out)],
                       input=json.dumps(_jsonable(calls)), capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        lines = (p.stderr.strip() or p.stdout.strip() or f"status {p.returncode}").splitlines()
        pytest.fail(f"llama.cpp's worker failed on {path}: {lines[-1]}")
    return pickle.loads(out.read_bytes())


def llama_f16(path, n_seq, calls, n_rs_seq=N_RS_SEQ):
    res = []
    spare = None if n_rs_seq or all(c[0] == "decode" for c in calls) else n_seq     # as in WORKER
    with lo.LlamaOracleProcess(path, n_ubatch=N_UBATCH, n_seq_max=n_seq + (spare is not None), n_rs_seq=n_rs_seq,
                               n_threads=1) as ll:
        for c in calls:
            res.append(ll.decode(c[1]) if c[0] == "decode"
                       else {c[1]: ll.speculative_step(c[1], c[2], c[3], spare=spare)})
    return res


def minigraph_side(path, n_seq, calls):
    """The same calls in a Runner over the file; a draft returns all its logits (as the harness's
    speculative_step does), then the rejected tokens are rolled back."""
    r = Runner(load_gguf(path, devices=mg.backend("cpu")), mem_size=n_seq, n_rs_seq=N_RS_SEQ, n_ubatch=N_UBATCH)
    res = []
    for c in calls:
        if c[0] == "decode":
            res.append(r.decode_seq_tokens(c[1]))
        elif c[0] in ("seq_add", "seq_div"):
            getattr(r, c[0])(*c[1:])
            res.append({})
        else:
            _, seq, draft, n_accept = c
            res.append({seq: r.decode_seq_tokens({seq: draft})[seq]})
            assert r.rollback(seq, len(draft) - n_accept)
    return res


def compare(results: dict, key, got, want, bound):
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), (key, i)
        for s in w:
            a, b = np.asarray(g[s], np.float64), np.asarray(w[s], np.float64)
            assert a.shape == b.shape, (key, i, a.shape, b.shape)
            e = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
            worst = max(worst, e)
            assert e <= bound, f"{key}: call {i}, seq {s}: relative error {e:.3g} > {bound}"
    results[key] = worst
