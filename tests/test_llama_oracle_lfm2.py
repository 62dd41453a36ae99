"""The hybrid LFM2 (short-conv + attention blocks) against llama.cpp itself: minigraph writes a
tiny seeded file (models/gguf_io.py), llama.cpp (llama-cpp-python 0.3.36, through
minigraph.testing.llama_oracle) and minigraph (load_gguf) decode the same token ids with the same
calls and ubatch size: a prefill longer than a ubatch, one-token decodes, two sequences in one
batch, a draft rolled back (llama.cpp's own n_rs_seq snapshots for the conv blocks, seq_rm of the
rejected positions in its KV cache).

llama.cpp keeps K and V in f16 by default, minigraph in f32. The f32 comparison (BOUND) runs
llama.cpp with an f32 KV cache, which the harness's context parameters do not offer, so it runs
the harness in a worker of its own that sets type_k / type_v; the default-f16 comparison
(BOUND_F16: K and V rounded to 11 significant bits) goes through LlamaOracleProcess as is.

Not installed: the module skips, saying how to install and run it."""

import numpy as np
import pytest

import minigraph as mg
from minigraph.models.gguf_io import save_gguf
from minigraph.models.lfm import LFM2Model
from minigraph.testing import llama_oracle as lo

from llama_hybrid_compare import (BOUND, BOUND_F16, K_SHIFT_SCENARIOS, N_UBATCH, SCENARIOS, compare,  # noqa: F401
                                  llama_f16, llama_f32, llama_installed, minigraph_side,
                                  one_cpu_thread)  # (autouse fixtures)

pytestmark = pytest.mark.llama

PATTERNS = {"llama.cpp-like": [0, 2, 0, 0, 2, 0], "attn-first": [2, 0, 0, 2], "mqa-last": [0, 0, 1],
            "mixed-kv-heads": [4, 0, 2, 0, 1]}      # K/V head counts differ per block (llama.cpp pads V)
RESULTS: dict = {}      # (pattern, kv type, scenario) -> max relative error


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_lfm2")
    cpu = mg.backend("cpu")
    return {name: save_gguf(LFM2Model(n_vocab=48, n_embd=64, n_layer=len(p), n_head=4, head_count_kv=p,
                                      devices=cpu, seed=5), d / f"{name}.gguf")
            for name, p in PATTERNS.items()}


@pytest.mark.parametrize("scenario", [s[0] for s in SCENARIOS])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_hybrid_lfm2_matches_llama_cpp_f32_kv(files, tmp_path, pattern, scenario):
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    path = files[pattern]
    compare(RESULTS, (pattern, "f32 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f32(path, n_seq, calls, tmp_path), BOUND)


@pytest.mark.parametrize("scenario", ["two sequences", "draft rolled back"])
def test_hybrid_lfm2_matches_llama_cpp_default_f16_kv(files, scenario):
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    path = files["llama.cpp-like"]
    with lo.LlamaOracleProcess(path, n_ubatch=N_UBATCH, n_threads=1) as ll:
        assert ll.info()["hybrid"]
    compare(RESULTS, ("llama.cpp-like", "f16 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f16(path, n_seq, calls), BOUND_F16)


@pytest.mark.parametrize("scenario", [s[0] for s in K_SHIFT_SCENARIOS])
@pytest.mark.parametrize("pattern", ["llama.cpp-like", "mqa-last"])
def test_k_shift_after_seq_add_matches_llama_cpp(files, tmp_path, pattern, scenario):
    """seq_add / seq_div move cached positions; the next decode sees keys re-rotated by the
    distance (llama.cpp's K shift). Without the shift the logits would differ (checked)."""
    _, n_seq, calls = next(s for s in K_SHIFT_SCENARIOS if s[0] == scenario)
    path = files[pattern]
    got = minigraph_side(path, n_seq, calls)
    compare(RESULTS, (pattern, "f32 kv", scenario), got, llama_f32(path, n_seq, calls, tmp_path), BOUND)
    import minigraph.models.k_shift as ks
    saved = ks.apply_k_shift
    try:                 # the same calls with the shift skipped (positions renumbered only): differs
        ks_calls = []

        def skip(model, kv, backends):
            if kv is not None and kv.cells.has_shift:
                ks_calls.append(1)
                kv.cells.shift, kv.cells.has_shift = [0] * kv.size, False
            return False
        import minigraph.models.runner as runner_mod
        runner_mod.apply_k_shift = skip
        unshifted = minigraph_side(path, n_seq, calls)
    finally:
        runner_mod.apply_k_shift = saved
    assert ks_calls
    last = next(i for i in range(len(calls) - 1, -1, -1) if calls[i][0] == "decode")
    s = next(iter(calls[last][1]))
    assert not np.allclose(got[last][s], unshifted[last][s], rtol=1e-4, atol=1e-4)


def test_k_shift_of_a_multi_section_rope_is_refused_before_anything_changes(tmp_path):
    """qwen35's keys carry a multi-section rope, which llama.cpp does not re-rotate (it aborts
    on the pending shift); minigraph refuses the seq_add itself, with nothing changed."""
    from minigraph.models.delta_net import DeltaNetModel
    from minigraph.models.k_shift import KShiftRefused
    from minigraph.models.runner import Runner
    r = Runner(DeltaNetModel(n_vocab=48, devices=mg.backend("cpu"), seed=1), mem_size=1)
    r.decode_seq_tokens({0: [1, 2, 3]})
    with pytest.raises(KShiftRefused, match=r"qwen35 cannot move cached positions") as e:
        r.seq_add(0, 0, -1, 4)
    assert "\n" not in str(e.value) and r.next_pos(0) == 3 and not r.memory.kv.cells.has_shift


@pytest.mark.parametrize("scenario", ["prefill", "two sequences", "draft rolled back"])
def test_a_file_in_llama_cpps_converter_layout_matches_llama_cpp(tmp_path_factory, tmp_path, scenario):
    """A file laid out as llama.cpp's converter writes LFM2 (tests/llama_layout.py: tied head, no
    output.weight, gpt2 tokenizer keys, no minigraph.hparams): both run it, logits agree."""
    from llama_layout import tie_output, write_lfm2_as_llama_cpp
    m = LFM2Model(n_vocab=48, n_embd=64, n_layer=5, n_head=4, head_count_kv=[0, 4, 0, 2, 0],
                  devices=mg.backend("cpu"), seed=9)
    tie_output(m)
    path = write_lfm2_as_llama_cpp(m, tmp_path_factory.mktemp("conv") / "lfm2-converter.gguf")
    _, n_seq, calls = next(s for s in SCENARIOS if s[0] == scenario)
    compare(RESULTS, ("converter-layout", "f32 kv", scenario), minigraph_side(path, n_seq, calls),
            llama_f32(path, n_seq, calls, tmp_path), BOUND)


def test_zz_summary(capsys):
    """Prints every comparison's worst relative error (run with -s to see it)."""
    with capsys.disabled():
        for key in sorted(RESULTS):
            print(f"  lfm2 {key[0]:16s} {key[1]:7s} {key[2]:20s} {RESULTS[key]:.2e}")
