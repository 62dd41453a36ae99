"""Bad input is refused at the top, in one line that names what was wrong and the rule: device
names (mg.backend), the command line's model names, device lists, numbers and files, and the
models' own hyperparameters. No tracebacks."""
from types import SimpleNamespace

import numpy as np
import pytest

import minigraph as mg
from minigraph.cli import main
from minigraph.models.delta_net import DeltaNetModel, build_delta_net_layer
from minigraph.models.mamba2 import Mamba2Model, build_mamba2_layer
from minigraph.models.zoo import UsageError, make_model


# -- device names --------------------------------------------------------------------------------
def test_an_unknown_device_kind_lists_the_known_kinds():
    with pytest.raises(ValueError, match=r"unknown device 'gpu'.*known kinds are .*cpu.*ref"):
        mg.backend("gpu")


@pytest.mark.parametrize("name", ["cpu:x", "", "cuda:-1", "meta()"])
def test_a_malformed_device_name_says_the_accepted_forms(name):
    with pytest.raises(ValueError, match=r"bad device name"):
        mg.backend(name)


def test_a_device_name_must_be_a_string():
    with pytest.raises(ValueError, match=r"a device name is a string"):
        mg.backend(None)


# -- the command line ----------------------------------------------------------------------------
def run_cli(capsys, monkeypatch, *args):
    """main() in this process: (exit status, stderr)."""
    monkeypatch.delenv("MINIGRAPH_TRACEBACK", raising=False)
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args,says", [
    # model names
    (["run", "nope"], "unknown model 'nope': choose one of mamba2, delta-net"),
    (["reuse", "Mamba2"], "unknown model 'Mamba2'"),
    # device lists
    (["run", "toy", "--devices", "gpu"], "bad device 'gpu': unknown device 'gpu'"),
    (["run", "toy", "--devices", "cpu:x"], "bad device 'cpu:x'"),
    (["run", "toy", "--devices", ","], "--devices ',': no device named"),
    (["placement", "toy", "--devices", "cpu,cpu:0"], "listed twice"),
    (["check", "--backends", "tpu"], "bad backend 'tpu' in --backends: unknown device 'tpu'"),
    (["check", "--backends", ","], "--backends ',': no column named"),
    # numbers
    (["run", "toy", "--ubatch", "0"], "argument --ubatch: must be >= 1, got 0"),
    (["run", "toy", "--steps", "abc"], "argument --steps: expected an integer >= 0, got 'abc'"),
    (["run", "toy", "--steps", "-1"], "argument --steps: must be >= 0, got -1"),
    (["run", "toy", "--draft", "0"], "argument --draft: must be >= 1, got 0"),
    (["run", "toy", "--n-rs-seq", "-1"], "argument --n-rs-seq: must be >= 0, got -1"),
    (["run", "toy", "--threads", "-2"], "argument --threads: must be >= 1, got -2"),
    (["run", "toy", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
    (["run", "toy", "--threads", "1.5"], "argument --threads: expected an integer >= 1, got '1.5'"),
    (["run", "toy", "--threads", "many"], "argument --threads: expected an integer >= 1, got 'many'"),
    (["run", "toy", "--threads", "100000"], "argument --threads: n_threads must be at most 512"),
    (["run", "toy", "--layers", "-1"], "argument --layers: must be >= 1, got -1"),
    (["run", "toy", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["reuse", "toy", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["check", "--seeds", "0"], "argument --seeds: must be >= 1, got 0"),
    # choices, files, commands
    (["run", "toy", "--slot-order", "sideways"], "argument --slot-order: invalid choice: 'sideways'"),
    (["run", "toy", "--gguf", "/nonexistent/model.gguf"], "--gguf /nonexistent/model.gguf: no such file"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["run", "toy", "--nope"], "unrecognized arguments: --nope"),
])
def test_the_command_line_refuses_bad_input_in_one_line(capsys, monkeypatch, args, says):
    code, err = run_cli(capsys, monkeypatch, *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err


def test_a_file_that_is_not_gguf_is_named_in_one_line(capsys, monkeypatch, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    code, err = run_cli(capsys, monkeypatch, "run", "--gguf", str(junk))
    assert code == 2 and err.strip().splitlines() == [      # a bad input file is bad input: status 2
        f"minigraph: error: --gguf {junk}: not a readable GGUF file (GGUF magic invalid)"], err


def test_make_model_refuses_an_unknown_name():
    with pytest.raises(UsageError, match=r"unknown model 'mamba3': choose one of"):
        make_model("mamba3", [mg.backend("ref")])


# -- the models' own rules -----------------------------------------------------------------------
def test_mamba2_hyperparameters_must_divide():
    with pytest.raises(ValueError, match=r"mamba2: d_inner must divide into n_head heads"):
        Mamba2Model(d_inner=100, n_head=8, devices=mg.backend("ref"))


def test_delta_net_v_heads_must_be_a_multiple_of_k_heads():
    with pytest.raises(ValueError, match=r"delta-net: num_v_heads must be a multiple of num_k_heads"):
        DeltaNetModel(num_k_heads=2, num_v_heads=3, devices=mg.backend("ref"))


def _unequal_ubatch():
    """A graph context whose ubatch was not split with equal sequences: 5 tokens, 2 x 2."""
    return SimpleNamespace(n_tokens=5, n_seq_tokens=2, n_seqs=2, n_rs_seq=0)


def test_the_mamba2_layer_needs_equal_sequences():
    hp = SimpleNamespace(d_conv=4, d_inner=32, d_state=4, n_head=4, head_dim=8, n_group=1)
    with pytest.raises(ValueError, match=r"mamba2 layer 0: the ubatch needs equal sequences, but n_tokens 5 "
                                         r"!= n_seq_tokens 2 \* n_seqs 2"):
        build_mamba2_layer(_unequal_ubatch(), None, None, 0, {}, hp)


def test_the_delta_net_layer_needs_equal_head_dims_and_sequences():
    hp = SimpleNamespace(head_k_dim=8, head_v_dim=16, num_k_heads=1, num_v_heads=1, key_dim=8,
                         value_dim=16, conv_channels=32)
    with pytest.raises(ValueError, match=r"delta-net layer 1: head_k_dim 8 must equal head_v_dim 16"):
        build_delta_net_layer(_unequal_ubatch(), None, None, 1, {}, hp)
    hp.head_v_dim = hp.head_k_dim
    with pytest.raises(ValueError, match=r"delta-net layer 1: the ubatch needs equal sequences"):
        build_delta_net_layer(_unequal_ubatch(), None, None, 1, {}, hp)


# -- thread counts and memory --------------------------------------------------------------------
def test_more_threads_than_cores_on_the_command_line_is_one_warning_line(capsys, monkeypatch):
    import os

    import minigraph.backends.cpu as cpu_backend
    # the warning comes once per process: another test may already have had it
    monkeypatch.setattr(cpu_backend, "_oversubscribed_warned", False)
    n = len(os.sched_getaffinity(0)) + 1
    code, err = run_cli(capsys, monkeypatch, "run", "toy", "--steps", "1", "--threads", str(n))
    mg.backend("cpu").set_n_threads(1)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"minigraph: warning: --threads {n}: n_threads {n} is more than the "
                     f"{n - 1} cores this process may use: the extra threads only share those cores"], err


@pytest.mark.parametrize("bad", [0, -3, 2.5, "2", 10**6])
def test_backend_threads_refuses_bad_counts_in_one_line(bad):
    before = mg.backend("cpu").n_threads
    with pytest.raises(ValueError, match=r"^device cpu:0: threads=.*: n_threads must be") as ei:
        mg.backend("cpu", threads=bad)
    assert "\n" not in str(ei.value) and mg.backend("cpu").n_threads == before


def test_backend_threads_sets_the_count_and_a_device_without_one_refuses_it():
    be = mg.backend("cpu")
    before = be.n_threads
    try:
        assert mg.backend("cpu", threads=1) is be and be.n_threads == 1
    finally:
        be.set_n_threads(before)
    with pytest.raises(ValueError, match=r"device ref has no thread count"):
        mg.backend("ref", threads=2)


HUGE = 1 << 38   # f32 elements: 1 TiB, more than any machine this runs on has


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_an_unsatisfiable_leaf_allocation_is_a_memory_error_naming_the_tensor(device):
    ctx = mg.Context()
    small = ctx.new_tensor(mg.f32, (8,)).set_name("small")
    ctx.new_tensor(mg.f32, (HUGE,)).set_name("huge")
    with pytest.raises(MemoryError) as ei:
        mg.alloc_ctx_tensors(ctx, mg.backend(device))
    msg = str(ei.value)
    assert "\n" not in msg and "'huge'" in msg and str(HUGE * 4 + 64) in msg and "on " + mg.backend(device).name in msg, msg
    assert small.buffer is None              # nothing was bound


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_an_unsatisfiable_intermediate_is_a_memory_error_before_any_write(device):
    be = mg.backend(device)
    ctx = mg.Context()
    a = ctx.new_tensor(mg.f32, (4, 1 << 18)).set_name("a")     # 4 MiB
    b = ctx.new_tensor(mg.f32, (4, 1 << 18)).set_name("b")
    mg.alloc_ctx_tensors(ctx, be)
    a.set(np.random.default_rng(1).standard_normal((1 << 18, 4)).astype(np.float32))
    b.set(np.random.default_rng(2).standard_normal((1 << 18, 4)).astype(np.float32))
    out = mg.mul_mat(a, b).set_name("outer")                     # [2^18, 2^18] f32: 256 GiB
    gf = mg.Graph().build_forward_expand(out.set_output())
    with pytest.raises(MemoryError, match=r"cannot allocate 256.0 GiB .* for tensor 'outer'"):
        be.graph_compute(gf)
    assert out.buffer is None and ("alloc", be.name) not in gf.cache
