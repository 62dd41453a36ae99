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

import pytest

import minigraph as mg
from minigraph.models.gguf_io import save_gguf
from minigraph.models.delta_net import DeltaNetModel
from minigraph.testing import llama_oracle as lo

from llama_hybrid_compare import (BOUND, BOUND_F16, N_UBATCH, SCENARIOS, compare, llama_f16, llama_f32,  # noqa: F401
                                  llama_installed, minigraph_side, one_cpu_thread)  # (autouse fixtures)

pytestmark = pytest.mark.llama

# name -> (n_layer, full_attention_interval, n_head, n_head_kv, attn_head_dim, n_rot, rope sections)
PATTERNS = {"llama.cpp-like": (4, 4, 4, 2, 16, 16, None), "every-2nd-mqa": (4, 2, 4, 1, 16, 16, None),
            "partial-rope": (3, 3, 2, 2, 32, 8, [1, 1, 1, 1])}     # pair 3 of 4 takes stream e (position 0)
RESULTS: dict = {}      # (pattern, kv type, scenario) -> max relative error


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


@pytest.mark.parametrize("scenario", [s[0] for s in SCENARIOS])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_qwen35_hybrid_matches_llama_cpp_f32_kv(files, tmp_path, pattern, scenario):
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    path = files[pattern]
    compare(RESULTS, (pattern, "f32 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f32(path, n_seq, calls, tmp_path), BOUND)


@pytest.mark.parametrize("scenario", ["two sequences", "draft rolled back"])
def test_qwen35_hybrid_matches_llama_cpp_default_f16_kv(files, scenario):
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    path = files["llama.cpp-like"]
    with lo.LlamaOracleProcess(path, n_ubatch=N_UBATCH, n_threads=1) as ll:
        assert ll.info()["hybrid"]
    compare(RESULTS, ("llama.cpp-like", "f16 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f16(path, n_seq, calls), BOUND_F16)


def test_zz_summary(capsys):
    """Prints every comparison's worst relative error (run with -s to see it)."""
    with capsys.disabled():
        for key in sorted(RESULTS):
            print(f"  qwen35 {key[0]:16s} {key[1]:7s} {key[2]:20s} {RESULTS[key]:.2e}")
