"""Kimi-Linear with MLA blocks (KDA blocks + MLA blocks with llama.cpp's absorbed projections and
K-only cache) against llama.cpp itself: minigraph writes a tiny seeded file (models/gguf_io.py),
llama.cpp (llama-cpp-python 0.3.36, through minigraph.testing.llama_oracle) and minigraph
(load_gguf) decode the same token ids with the same calls and ubatch size: a prefill longer than a
ubatch, one-token decodes, two sequences in one batch, a draft rolled back (llama.cpp's own
n_rs_seq snapshots on minigraph's side; llama.cpp gives kimi-linear no snapshots (it clamps n_rs_seq
to 0), so its side rolls the draft back through a checkpoint in a spare sequence).

llama.cpp keeps K in f16 by default, minigraph in f32. The f32 comparison (BOUND) runs llama.cpp
with an f32 KV cache in a worker of its own (tests/llama_hybrid_compare.py); the default-f16
comparison (BOUND_F16) goes through LlamaOracleProcess as is.

Not installed: the module skips, saying how to install and run it."""

import pytest

import minigraph as mg
from minigraph.models.gguf_io import save_gguf
from minigraph.models.kda import KDAModel
from minigraph.testing import llama_oracle as lo

from llama_hybrid_compare import (BOUND, BOUND_F16, K_SHIFT_SCENARIOS, N_UBATCH, SCENARIOS, compare,  # noqa: F401
                                  llama_f16, llama_f32, llama_installed, minigraph_side,
                                  one_cpu_thread)  # (autouse fixtures)

pytestmark = pytest.mark.llama

# name -> (head_count_kv per block: 0 KDA, 1 MLA; kv_lora_rank, mla_k_head_dim, mla_v_head_dim, n_rot)
PATTERNS = {"llama.cpp-like": ([0, 0, 0, 1], 32, 24, 16, 8),
            "mla-first": ([1, 0, 0], 16, 40, 24, 16),
            "every-2nd": ([0, 1, 0, 1], 24, 20, 12, 4)}
RESULTS: dict = {}      # (pattern, kv type, scenario) -> max relative error


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_kimi")
    cpu = mg.backend("cpu")
    out = {}
    for name, (hkv, lora, dk, dv, r) in PATTERNS.items():
        m = KDAModel(n_vocab=48, n_embd=64, n_layer=len(hkv), head_count_kv=hkv, kv_lora_rank=lora,
                     mla_k_head_dim=dk, mla_v_head_dim=dv, n_rot=r, devices=cpu, seed=5)
        assert m.attn_layers
        out[name] = save_gguf(m, d / f"{name}.gguf")
    return out


@pytest.mark.parametrize("scenario", [s[0] for s in SCENARIOS])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_kimi_linear_mla_matches_llama_cpp_f32_kv(files, tmp_path, pattern, scenario):
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    path = files[pattern]
    compare(RESULTS, (pattern, "f32 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f32(path, n_seq, calls, tmp_path, n_rs_seq=0), BOUND)


@pytest.mark.parametrize("scenario", ["two sequences", "draft rolled back"])
def test_kimi_linear_mla_matches_llama_cpp_default_f16_kv(files, scenario):
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    path = files["llama.cpp-like"]
    with lo.LlamaOracleProcess(path, n_ubatch=N_UBATCH, n_threads=1) as ll:
        assert ll.info()["hybrid"]
    compare(RESULTS, ("llama.cpp-like", "f16 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f16(path, n_seq, calls, n_rs_seq=0), BOUND_F16)


@pytest.mark.parametrize("scenario", [s[0] for s in K_SHIFT_SCENARIOS])
@pytest.mark.parametrize("pattern", ["llama.cpp-like", "every-2nd"])
def test_positions_moved_by_seq_add_match_llama_cpp(files, tmp_path, pattern, scenario):
    """Kimi's MLA keys carry no rope: seq_add / seq_div only renumber the cells (no K shift)."""
    _, n_seq, calls = next(s for s in K_SHIFT_SCENARIOS if s[0] == scenario)
    path = files[pattern]
    compare(RESULTS, (pattern, "f32 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f32(path, n_seq, calls, tmp_path, n_rs_seq=0), BOUND)


def test_zz_summary(capsys):
    """Prints every comparison's worst relative error (run with -s to see it)."""
    with capsys.disabled():
        for key in sorted(RESULTS):
            print(f"  kimi-linear {key[0]:16s} {key[1]:7s} {key[2]:20s} {RESULTS[key]:.2e}")
