"""llama.cpp as the oracle (minigraph.testing.llama_oracle, the optional `llama` extra).

A tiny seeded model is written to GGUF by minigraph (models/gguf_io.py); the same file is loaded
by llama.cpp (through llama-cpp-python 0.3.36, in a worker process) and by minigraph
(load_gguf), and both decode identical token ids with identical decode calls and ubatch size
(so both split the batches into the same ubatches): a prefill longer than a ubatch, one-token
decodes, two sequences in one batch, and a draft rolled back. The logits must agree to BOUND
(max |a - b| / max |b| per call).

Not installed: the module skips, saying how to install and run it. Installed but not loading:
tests/conftest.py stops the run (never a silent skip).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minigraph as mg
from minigraph.models.delta_net import DeltaNetHybridModel, DeltaNetModel
from minigraph.models.gguf_io import load_gguf, save_gguf
from minigraph.models.kda import KDAModel
from minigraph.models.lfm import LFM2Model
from minigraph.models.mamba2 import Mamba2Model
from minigraph.models.runner import Runner
from minigraph.testing import llama_oracle as lo

# one thread on minigraph's cpu device (llama.cpp's worker gets n_threads=1 too)
from llama_hybrid_compare import one_cpu_thread  # noqa: F401  (an autouse fixture)

pytestmark = pytest.mark.llama


@pytest.fixture(autouse=True)
def llama_installed(request):
    """Every test here needs the extra, except the guard's (marked runs_without_llama): one skip
    reason, raised in one place, so pytest -ra lists it once."""
    if not lo.installed() and not getattr(request.function, "runs_without_llama", False):
        pytest.skip(lo.not_installed_reason())

BOUND = 1e-4                   # relative: max |minigraph - llama.cpp| / max |llama.cpp|, per decode call
BOUND_F16_KV = 2e-3            # a file with attention layers: llama.cpp keeps K/V in f16 by default, minigraph in f32
N_UBATCH = 8
# every comparison made, for the summary printed at the end: (arch, scenario) -> max relative error
RESULTS: dict = {}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got.astype(np.float64) - want)) / max(float(np.max(np.abs(want))), 1e-30))


class Compare:
    """Feeds the same calls to a minigraph Runner and a llama.cpp worker, comparing logits."""

    def __init__(self, arch, scenario, runner, ll, bound=BOUND):
        self.key, self.r, self.ll, self.worst, self.bound = (arch, scenario), runner, ll, 0.0, bound

    def check(self, got: dict, want: dict, what: str):
        assert set(got) == set(want), what
        for s in want:
            e = rel_err(got[s], want[s])
            self.worst = max(self.worst, e)
            assert e <= self.bound, f"{self.key}: {what}, seq {s}: relative error {e:.3g} > {self.bound}"
        RESULTS[self.key] = max(RESULTS.get(self.key, 0.0), self.worst)

    def decode(self, seq_tokens: dict, what: str):
        self.check(self.r.decode_seq_tokens(seq_tokens), self.ll.decode(seq_tokens), what)


# -- the files -------------------------------------------------------------------------------

def mamba2(dev):
    return Mamba2Model(n_vocab=48, n_embd=64, n_layer=2, devices=dev, seed=5)


MAKERS = {
    "mamba2": mamba2,
    "lfm2": lambda dev: LFM2Model(n_vocab=48, devices=dev, seed=5),
    "qwen35": lambda dev: DeltaNetModel(n_vocab=48, devices=dev, seed=5),      # delta-net + gated attention
    # qwen35 with llama.cpp's layout (every 4th block gated attention): llama.cpp runs it
    "qwen35-hybrid": lambda dev: DeltaNetHybridModel(n_vocab=48, devices=dev, seed=5),
    "kimi-linear": lambda dev: KDAModel(n_vocab=48, devices=dev, seed=5),       # KDA + MLA
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_oracle")
    cpu = mg.backend("cpu")
    return {arch: save_gguf(make(cpu), d / f"{arch}.gguf") for arch, make in MAKERS.items()}


def oracle(path, **kw):
    kw.setdefault("n_ubatch", N_UBATCH)
    kw.setdefault("n_threads", 1)
    return lo.LlamaOracleProcess(path, **kw)


def runner(path, n_rs_seq=0, mem_size=1):
    """minigraph's side reads the same file (the reverse of what llama.cpp does with it)."""
    return Runner(load_gguf(path, devices=mg.backend("cpu")), mem_size=mem_size, n_rs_seq=n_rs_seq,
                  n_ubatch=N_UBATCH)


PROMPT = [3, 17, 5, 40, 11, 2, 29, 8, 33, 14, 6]       # 11 tokens: ubatches of 8 and 3


# -- the harness itself --------------------------------------------------------------------------

def test_extra_ships_its_libraries_and_api():
    # in a process of its own: this one may already hold libggml-python's ggml, whose libraries
    # have the same names as llama.cpp's (the dynamic loader would bind llama.cpp to them)
    assert lo.load_problem_isolated() is None
    assert lo.missing_libs() == []


def test_unloadable_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(lo.LlamaOracleError, match="llama.cpp cannot load this file") as e:
        oracle(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(lo.LlamaOracleError, match="no such file"):
        oracle(tmp_path / "absent.gguf")


def test_bad_token_and_sequence_are_refused(files):
    with oracle(files["mamba2"]) as ll:
        with pytest.raises(lo.LlamaOracleError, match="outside the vocabulary"):
            ll.decode({0: [48]})
        with pytest.raises(lo.LlamaOracleError, match="n_seq_max"):
            ll.decode({1: [1]})
        assert ll.decode({0: [1]})[0].shape == (1, 48)      # still usable


# -- mamba2: every scenario ------------------------------------------------------------------------

@pytest.mark.parametrize("flash_attn", [False, True])
def test_mamba2_prefill(files, flash_attn):
    path = files["mamba2"]
    with oracle(path, flash_attn=flash_attn) as ll:
        info = ll.info()
        assert info["recurrent"] and not info["hybrid"] and info["n_vocab"] == 48
        c = Compare("mamba2", "prefill (8+3 ubatches)", runner(path), ll)
        c.decode({0: PROMPT}, "prefill")


def test_mamba2_decode(files):
    path = files["mamba2"]
    with oracle(path) as ll:
        c = Compare("mamba2", "one-token decode x6", runner(path), ll)
        c.decode({0: PROMPT[:5]}, "prefill")
        for i, t in enumerate([9, 21, 1, 47, 0, 30]):
            c.decode({0: [t]}, f"decode {i}")


def test_mamba2_two_sequences(files):
    path = files["mamba2"]
    with oracle(path, n_seq_max=2) as ll:
        c = Compare("mamba2", "two sequences", runner(path, mem_size=2), ll)
        c.decode({0: PROMPT[:6], 1: PROMPT[5:]}, "both prefill in one batch")
        for i in range(4):
            c.decode({0: [i + 1], 1: [40 - i]}, f"decode step {i}")
        c.decode({1: [7, 8, 9]}, "seq 1 alone")
        c.decode({0: [12], 1: [13]}, "both again")


@pytest.mark.parametrize("n_accept", [1, 2, 3])
def test_mamba2_draft_rolled_back(files, n_accept):
    """minigraph rolls the draft back from its snapshots (n_rs_seq 3); llama.cpp clamps n_rs_seq
    to 0 for mamba2, so its side rolls back through a checkpoint (seq_cp to a spare sequence)."""
    path = files["mamba2"]
    draft = [19, 23, 29, 31]
    with oracle(path, n_seq_max=2, n_rs_seq=3) as ll:
        assert ll.n_rs_seq == 0                       # llama.cpp: mamba2 has no partial rollback
        r = runner(path, n_rs_seq=3)
        c = Compare("mamba2", "draft of 4 rolled back", r, ll)
        c.decode({0: PROMPT[:6]}, "prefill")
        assert not ll.rollback(0, 2), "llama.cpp rolled a mamba2 sequence back without snapshots"
        got = r.decode_seq_tokens({0: draft})[0]
        assert r.rollback(0, len(draft) - n_accept)
        want = ll.speculative_step(0, draft, n_accept, spare=1)
        c.check({0: got}, {0: want}, "draft logits")
        assert ll.next_pos(0) == r.next_pos(0) == 6 + n_accept
        for i, t in enumerate([2, 4, 6]):
            c.decode({0: [t]}, f"decode {i} after the rollback")


def test_mamba2_same_file_same_logits_as_the_model_in_memory(files, tmp_path):
    """The reverse direction: the file minigraph wrote loads back into minigraph with the very
    weights llama.cpp reads, so the in-memory model, the reloaded one and llama.cpp agree."""
    cpu = mg.backend("cpu")
    m = mamba2(cpu)
    path = save_gguf(m, tmp_path / "again.gguf")
    a = Runner(m, mem_size=1, n_ubatch=N_UBATCH).decode_seq_tokens({0: PROMPT})[0]
    b = runner(path).decode_seq_tokens({0: PROMPT})[0]
    assert np.array_equal(a, b)
    with oracle(path) as ll:
        assert rel_err(a, ll.decode({0: PROMPT})[0]) <= BOUND


# -- the other archs: minigraph's default files, each with attention blocks as llama.cpp needs ----

@pytest.mark.parametrize("arch", ["lfm2", "qwen35", "qwen35-hybrid", "kimi-linear"])
def test_other_archs(files, arch):
    """minigraph's default lfm2, qwen35 and kimi-linear models have attention blocks (llama.cpp's
    hybrid layouts: its hybrid memory needs at least one attention block and aborts without one,
    GGML_ASSERT(buffer) in llama_kv_cache::set_input_k_idxs), so llama.cpp runs each file minigraph
    writes by default: the logits are compared (f16 K/V on llama.cpp's side: BOUND_F16_KV).
    tests/test_llama_oracle_{lfm2,qwen35,kimi}.py compare several layouts fully, f32 KV included."""
    path = files[arch]
    model = load_gguf(path, devices=mg.backend("cpu"))
    assert getattr(model, "attn_layers", ()), f"minigraph's default {arch} has attention blocks, as llama.cpp's files"
    p = lo.probe(path, n_ubatch=N_UBATCH, n_threads=1)
    if not p.ok:
        pytest.fail(f"llama.cpp cannot run minigraph's {arch} file: {p.message}")
    with oracle(path, n_seq_max=2) as ll:
        scenario = f"prefill, decode, two sequences (f16 kv: bound {BOUND_F16_KV:g})"
        c = Compare(arch, scenario, runner(path, mem_size=2), ll, BOUND_F16_KV)
        c.decode({0: PROMPT}, "prefill")
        c.decode({0: [4]}, "decode")
        c.decode({0: [5], 1: [6, 7]}, "two sequences")


# -- the suite's guard (tests/conftest.py): an installed extra that does not load stops the run ----

BROKEN_LLAMA_CPP = '''raise OSError("libllama.so: cannot open shared object file (pretend)")
'''


def test_an_installed_extra_that_does_not_load_stops_the_run(tmp_path):
    """Runs pytest on a probe folder with a copy of the conftest and a `llama_cpp` package whose
    import fails, as on a broken build: the run must stop with the reason, not skip."""
    here = Path(__file__).resolve().parent
    shutil.copy(here / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(BROKEN_LLAMA_CPP)
    (tmp_path / "test_probe.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout
    assert "llama-cpp-python (the llama extra) is installed but" in p.stdout, p.stdout
    assert "pretend" in p.stdout and "1 passed" not in p.stdout, p.stdout


test_an_installed_extra_that_does_not_load_stops_the_run.runs_without_llama = True
