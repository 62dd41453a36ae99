"""Comparing a hybrid model file with llama.cpp, shared by the per-arch oracle tests
(test_llama_oracle_lfm2.py, test_llama_oracle_qwen35.py, test_llama_oracle_kimi.py): the same
calls (decodes, drafts rolled back, positions moved) on minigraph's Runner and on llama.cpp
(minigraph.testing.llama_calls), with an f32 KV cache on both sides or llama.cpp's default f16."""
import pytest

import minigraph as mg
from minigraph.models.gguf_io import load_gguf
from minigraph.models.runner import Runner
from minigraph.testing import llama_calls as lc
from minigraph.testing import llama_oracle as lo
from minigraph.testing.llama_calls import K_SHIFT_SCENARIOS, N_RS_SEQ, N_UBATCH, PROMPT, SCENARIOS  # noqa: F401

BOUND = 1e-5            # f32 KV cache on both sides: max |minigraph - llama.cpp| / max |llama.cpp| per call
BOUND_F16 = 2e-3        # llama.cpp's default f16 KV cache


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


def _llama(path, n_seq, calls, kv_f32, n_rs_seq):
    try:
        return lc.llama_side(path, n_seq, calls, kv_f32=kv_f32, n_rs_seq=n_rs_seq)
    except lo.LlamaOracleError as e:
        pytest.fail(f"llama.cpp failed on {path}: {e}")


def llama_f32(path, n_seq, calls, tmp_path=None, n_rs_seq=N_RS_SEQ):
    """llama.cpp's results for the calls with an f32 KV cache. n_rs_seq 0 (an arch llama.cpp gives
    no snapshots, e.g. kimi-linear): a draft rolls back through a checkpoint in a spare sequence."""
    return _llama(path, n_seq, calls, True, n_rs_seq)


def llama_f16(path, n_seq, calls, n_rs_seq=N_RS_SEQ):
    return _llama(path, n_seq, calls, False, n_rs_seq)


def minigraph_side(path, n_seq, calls):
    """The same calls in a Runner over the file."""
    r = Runner(load_gguf(path, devices=mg.backend("cpu")), mem_size=n_seq, n_rs_seq=N_RS_SEQ, n_ubatch=N_UBATCH)
    return lc.runner_side(r, calls)


def compare(results: dict, key, got, want, bound):
    worst = 0.0
    for i, s, e in lc.call_errors(got, want):
        worst = max(worst, e)
        assert e <= bound, f"{key}: call {i}, seq {s}: relative error {e:.3g} > {bound}"
    results[key] = worst
