"""The rollback grid on the cpu backend: `minigraph run MODEL --n-rs-seq K --draft D` must pass its
state check for every recurrent model, rollback depth, draft length, thread count and device split.

The check is the one `minigraph run` makes (minigraph/cli/run.py: cmd_run), run through the API
in this process (no subprocess per case): decode a prompt, then speculative steps (a random draft
of 1..D tokens, a random number of them accepted, the rest rolled back); a second runner decodes
only the accepted tokens, in the chunks the first one kept, and the live state of every layer
(plane 0 of r_l and s_l) and the last logits must be equal byte for byte. The two runs decode
different ubatch sizes (a draft of d tokens against its n_accept accepted ones), so this holds
only if a token's results do not depend on the ubatch, the thread count or the thread split.

Grid (sampled; 240 cases, about 40 s on 2 cores):
  models   mamba2, delta-net, lfm, kda, toy-hybrid, lfm-hybrid (all that support rollback;
           the hybrids roll back their KV cache too), default layer counts, seed 0
  K        n_rs_seq in {1, 2, 3, 5, 8}   (ubatch = max(8, K + 2), as the CLI's default)
  D        draft in {1, K}
  threads  1 (default chunking: the tiny nodes run unsplit) and 2 with every node split into
           4 chunks per thread (mg_set_chunking(0, 0)), so every kernel's thread split is exercised
  devices  cpu:0, and cpu:0,cpu:1 (layers split over two memories: cross-device copies)
  steps    6 speculative steps after an 8-token prompt, stream seed K*100 + D
A second test covers the corners of the full grid (K in 1..8, every D in 1..K) for one model of
each state kind at 2 threads on two devices."""
from __future__ import annotations

import numpy as np
import pytest

from minigraph.models.runner import Runner
from minigraph.models.zoo import make_model, parse_devices

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)

MODELS = ["mamba2", "delta-net", "lfm", "kda", "toy-hybrid", "lfm-hybrid"]
KS = [1, 2, 3, 5, 8]
MEM_SIZE = 2
STEPS = 6

_models: dict = {}


def _model(name, devices_spec):
    key = (name, devices_spec)
    if key not in _models:
        devices = parse_devices(devices_spec)
        _models[key] = (make_model(name, devices, seed=0), devices)
    return _models[key]


@pytest.fixture
def threads():
    """set the cpu devices' thread count and chunking for one case; restore both after"""
    saved = {}

    def set_(devices, n):
        for d in devices:
            saved.setdefault(d, d.n_threads)
            d.set_n_threads(n)
        cpu.lib.mg_set_chunking(0, 0) if n > 1 else cpu.lib.mg_set_chunking(-1, -1)
    yield set_
    cpu.lib.mg_set_chunking(-1, -1)
    for d, n in saved.items():
        d.set_n_threads(n)


def state_check(model, devices, n_rs_seq: int, draft: int, steps: int = STEPS, seed: int = 0) -> str:
    """cmd_run's decode and state check; '' when it passes, else what differs."""
    ubatch = max(8, n_rs_seq + 2)

    def runner():
        return Runner(model, mem_size=MEM_SIZE, n_rs_seq=n_rs_seq, n_ubatch=ubatch, backends=devices)
    rng = np.random.default_rng(seed)
    r = runner()
    prompt = [int(x) for x in rng.integers(0, model.n_vocab, 8)]
    chunks = [list(prompt)]
    r.decode_seq_tokens({0: prompt})
    for step in range(steps):
        d = int(rng.integers(1, draft + 1))
        toks = [int(x) for x in rng.integers(0, model.n_vocab, d)]
        n_accept = int(rng.integers(1, d + 1))
        r.decode_seq_tokens({0: toks})
        k = d - n_accept
        if k > 0 and not r.rollback(0, k):
            return f"step {step}: rollback of {k} refused: {r.memory.last_refusal}"
        chunks.append(toks[:n_accept])
    last = r.decode_seq_tokens({0: [0]})[0]
    ref = runner()
    for c in chunks:
        ref.decode_seq_tokens({0: c})
    ref_last = ref.decode_seq_tokens({0: [0]})[0]
    why = []
    if not np.array_equal(np.asarray(last).view(np.uint8), np.asarray(ref_last).view(np.uint8)):
        why.append(f"last logits differ (max |diff| {np.max(np.abs(np.asarray(last) - np.asarray(ref_last))):.3g})")
    a, b = r.live_state_bytes(), ref.live_state_bytes()
    if a != b:
        x, y = np.frombuffer(a, np.float32), np.frombuffer(b, np.float32)
        why.append(f"{int(np.sum(x != y))} of {x.size} state floats differ")
    return "; ".join(why)


GRID = [(m, K, D, th, dev) for m in MODELS for K in KS for D in sorted({1, K})
        for th in (1, 2) for dev in ("cpu:0", "cpu:0,cpu:1")]


@pytest.mark.parametrize("model,K,D,n_threads,devices", GRID,
                         ids=[f"{m}-K{K}-D{D}-t{th}-{'2dev' if ',' in dev else '1dev'}" for m, K, D, th, dev in GRID])
def test_rollback_state_check_is_exact(model, K, D, n_threads, devices, threads):
    mdl, devs = _model(model, devices)
    threads(devs, n_threads)
    why = state_check(mdl, devs, K, D, seed=K * 100 + D)
    assert why == "", f"{model} --n-rs-seq {K} --draft {D} --threads {n_threads} --devices {devices}: {why}"


CORNERS = [(m, K, D) for m in ("mamba2", "kda", "lfm-hybrid") for K in range(1, 9) for D in range(1, K + 1)
           if D in (1, K) or (K * 7 + D) % 5 == 0]


@pytest.mark.parametrize("model,K,D", CORNERS, ids=[f"{m}-K{K}-D{D}" for m, K, D in CORNERS])
def test_rollback_full_range_two_threads_two_devices(model, K, D, threads):
    mdl, devs = _model(model, "cpu:0,cpu:1")
    threads(devs, 2)
    why = state_check(mdl, devs, K, D, steps=4, seed=K * 10 + D)
    assert why == "", f"{model} --n-rs-seq {K} --draft {D} --threads 2 --devices cpu:0,cpu:1: {why}"
