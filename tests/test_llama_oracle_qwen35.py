"""qwen35 with gated attention blocks (gated delta-net blocks + every full_attention_interval-th
block a gated attention block) against llama.cpp itself: minigraph writes a
tiny seeded file (models/gguf_io.py), llama.cpp (llama-cpp-python 0.3.36, through
minigraph.testing.llama_oracle) and minigraph (load_gguf) decode the same token ids with the same
calls and ubatch size: a prefill longer than a ubatch, one-token decodes, two sequences in one
batch, a draft rolled back (llama.cpp's own n_rs_seq snapshots for the delta-net blocks, seq_rm of
the rejected positions in its KV cache).

llama.cpp keeps K and V in f16 by default, minigraph in f32. The f32 comparison (BOUND) runs
llama.cpp with an f32 KV cache, which the harness's context parameters do not offer, so it runs
the harness in a worker of its own that sets type_k / type_v; the default-f16 comparison
(BOUND_F16: K and V rounded to 11 significant bits) goes through LlamaOracleProcess as is.

Not installed: the module skips, saying how to install and run it."""
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

import minigraph as mg
from minigraph.models.gguf_io import load_gguf, save_gguf
from minigraph.models.delta_net import DeltaNetModel
from minigraph.models.runner import Runner
from minigraph.testing import llama_oracle as lo

pytestmark = pytest.mark.llama

BOUND = 1e-5            # f32 KV cache on both sides: max |minigraph - llama.cpp| / max |llama.cpp| per call
BOUND_F16 = 2e-3        # llama.cpp's default f16 KV cache
N_UBATCH = 8
N_RS_SEQ = 3
PROMPT = [3, 17, 5, 40, 11, 2, 29, 8, 33, 14, 6]       # 11 tokens: ubatches of 8 and 3
# name -> (n_layer, full_attention_interval, n_head, n_head_kv, attn_head_dim, n_rot, rope sections)
PATTERNS = {"llama.cpp-like": (4, 4, 4, 2, 16, 16, None), "every-2nd-mqa": (4, 2, 4, 1, 16, 16, None),
            "partial-rope": (3, 3, 2, 2, 32, 8, [1, 1, 1, 1])}     # pair 3 of 4 takes stream e (position 0)
# (name, n_seq_max, calls): ("decode", {seq: tokens}) or ("draft", seq, draft, n_accept)
SCENARIOS = [
    ("prefill", 1, [("decode", {0: PROMPT})]),
    ("decode", 1, [("decode", {0: PROMPT[:5]})] + [("decode", {0: [t]}) for t in [9, 21, 1, 47, 0, 30]]),
    ("two sequences", 2, [("decode", {0: PROMPT[:6], 1: PROMPT[5:]})]
     + [("decode", {0: [i + 1], 1: [40 - i]}) for i in range(4)]
     + [("decode", {1: [7, 8, 9]}), ("decode", {0: [12], 1: [13]})]),
    ("draft rolled back", 1, [("decode", {0: PROMPT[:6]}), ("draft", 0, [19, 23, 29, 31], 2),
                              ("decode", {0: [2]}), ("decode", {0: [4]})]),
]
RESULTS: dict = {}      # (pattern, kv type, scenario) -> max relative error


@pytest.fixture(autouse=True)
def llama_installed():
    if not lo.installed():
        pytest.skip(lo.not_installed_reason())


@pytest.fixture(autouse=True)
def one_cpu_thread():
    d = mg.backend("cpu")
    saved = d.n_threads
    d.set_n_threads(1)
    yield
    d.n_threads = saved


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_qwen35")
    cpu = mg.backend("cpu")
    out = {}
    for name, (n_layer, interval, n_head, n_head_kv, d_attn, n_rot, sections) in PATTERNS.items():
        m = DeltaNetModel(n_vocab=48, n_embd=64, n_layer=n_layer, full_attention_interval=interval, n_head=n_head,
                          n_head_kv=n_head_kv, attn_head_dim=d_attn, n_rot=n_rot, rope_sections=sections,
                          devices=cpu, seed=5)
        assert m.attn_layers
        out[name] = save_gguf(m, d / f"{name}.gguf")
    return out


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
with lo.LlamaOracle(path, n_ubatch=n_ubatch, n_seq_max=n_seq, n_rs_seq=n_rs_seq, n_threads=1) as ll:
    if ll.n_rs_seq != n_rs_seq:
        sys.exit(f"llama.cpp gave the context n_rs_seq {ll.n_rs_seq}, asked {n_rs_seq}")
    for c in calls:
        if c[0] == "decode":
            res.append(ll.decode({int(k): v for k, v in c[1].items()}))
        else:
            res.append({c[1]: ll.speculative_step(c[1], c[2], c[3])})
pickle.dump(res, open(out, "wb"))
'''


def llama_f32(path, n_seq, calls, tmp_path):
    out = tmp_path / "logits.pkl"
    p = subprocess.run([sys.executable, "-c", WORKER, str(path), str(n_seq), str(N_RS_SEQ), str(N_UBATCH), str(out)],
                       input=json.dumps(_jsonable(calls)), capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        lines = (p.stderr.strip() or p.stdout.strip() or f"status {p.returncode}").splitlines()
        pytest.fail(f"llama.cpp's worker failed on {path}: {lines[-1]}")
    return pickle.loads(out.read_bytes())


def llama_f16(path, n_seq, calls):
    res = []
    with lo.LlamaOracleProcess(path, n_ubatch=N_UBATCH, n_seq_max=n_seq, n_rs_seq=N_RS_SEQ, n_threads=1) as ll:
        for c in calls:
            res.append(ll.decode(c[1]) if c[0] == "decode" else {c[1]: ll.speculative_step(c[1], c[2], c[3])})
    return res


def minigraph_side(path, n_seq, calls):
    """The same calls in a Runner over the file; a draft returns all its logits (as the harness's
    speculative_step does), then the rejected tokens are rolled back."""
    r = Runner(load_gguf(path, devices=mg.backend("cpu")), mem_size=n_seq, n_rs_seq=N_RS_SEQ, n_ubatch=N_UBATCH)
    res = []
    for c in calls:
        if c[0] == "decode":
            res.append(r.decode_seq_tokens(c[1]))
        else:
            _, seq, draft, n_accept = c
            res.append({seq: r.decode_seq_tokens({seq: draft})[seq]})
            assert r.rollback(seq, len(draft) - n_accept)
    return res


def compare(key, got, want, bound):
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), (key, i)
        for s in w:
            a, b = np.asarray(g[s], np.float64), np.asarray(w[s], np.float64)
            assert a.shape == b.shape, (key, i, a.shape, b.shape)
            e = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
            worst = max(worst, e)
            assert e <= bound, f"{key}: call {i}, seq {s}: relative error {e:.3g} > {bound}"
    RESULTS[key] = worst


@pytest.mark.parametrize("scenario", [s[0] for s in SCENARIOS])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_qwen35_hybrid_matches_llama_cpp_f32_kv(files, tmp_path, pattern, scenario):
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    path = files[pattern]
    compare((pattern, "f32 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f32(path, n_seq, calls, tmp_path), BOUND)


@pytest.mark.parametrize("scenario", ["two sequences", "draft rolled back"])
def test_qwen35_hybrid_matches_llama_cpp_default_f16_kv(files, scenario):
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    path = files["llama.cpp-like"]
    with lo.LlamaOracleProcess(path, n_ubatch=N_UBATCH, n_threads=1) as ll:
        assert ll.info()["hybrid"]
    compare(("llama.cpp-like", "f16 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f16(path, n_seq, calls), BOUND_F16)


def test_zz_summary(capsys):
    """Prints every comparison's worst relative error (run with -s to see it)."""
    with capsys.disabled():
        for key in sorted(RESULTS):
            print(f"  qwen35 {key[0]:16s} {key[1]:7s} {key[2]:20s} {RESULTS[key]:.2e}")
