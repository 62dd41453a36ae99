"""The decode runner on the toy conv model: slot-order strategies, graph reuse and its validator,
rollback integrity, failure atomicity, the n_rs_seq clamp, and slot-order placement on two CPUs."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.models.graph import SLOT_ORDERS, GraphInput
from minigraph.models.runner import Runner, clamp_n_rs_seq
from minigraph.models.toy import ToyConvModel


def toy(devices=None, n_layer=2, seed=0):
    return ToyConvModel(n_vocab=24, n_embd=8, n_layer=n_layer, d_conv=4, devices=devices, seed=seed)


def state(runner):
    return {t.name: t.numpy().copy() for t in runner.memory.r_l.values() if t is not None}


def decode_stream(runner, stream):
    """stream: list of {seq: [tokens]} steps. Returns the list of per-step logits dicts."""
    return [runner.decode_seq_tokens(step) for step in stream]


STREAM = [{0: [1, 2, 3, 4, 5], 1: [7, 8, 9, 10, 11]}, {0: [6], 1: [12]}, {0: [13], 1: [14]},
          {0: [3, 4], 1: [5, 6]}, {0: [15], 1: [16]}]


@pytest.mark.parametrize("n_rs_seq", [0, 1, 3])
def test_slot_order_strategies_write_identical_state(n_rs_seq):
    results = []
    for strategy in SLOT_ORDERS:
        r = Runner(toy(mg.backend("ref")), mem_size=4, n_rs_seq=n_rs_seq, slot_order=strategy)
        logits = decode_stream(r, STREAM)
        results.append((logits, state(r)))
    for logits, st in results[1:]:
        for a, b in zip(logits, results[0][0]):
            for s in a:
                assert np.array_equal(a[s], b[s])
        for k in st:
            assert np.array_equal(st[k], results[0][1][k])


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_reuse_on_equals_reuse_off_and_validator_passes(device):
    outs = {}
    for reuse in (True, False):
        r = Runner(toy(mg.backend(device)), mem_size=4, n_rs_seq=2, reuse=reuse, validate=reuse)
        outs[reuse] = (decode_stream(r, STREAM + STREAM[1:3]), state(r), r.stats)
    (l_on, s_on, st_on), (l_off, s_off, st_off) = outs[True], outs[False]
    for a, b in zip(l_on, l_off):
        for s in a:
            assert np.array_equal(a[s], b[s])
    for k in s_on:
        assert np.array_equal(s_on[k], s_off[k])
    assert st_off.reuses == 0 and st_off.builds == st_off.ubatches
    assert st_on.reuses > 0 and st_on.validated == st_on.reuses
    assert st_on.builds + st_on.reuses == st_on.ubatches


def test_shape_change_forces_rebuild():
    r = Runner(toy(mg.backend("ref")), mem_size=4, n_rs_seq=1)
    r.decode_seq_tokens({0: [1, 2, 3]})
    r.decode_seq_tokens({0: [4]})
    b = r.stats.builds
    r.decode_seq_tokens({0: [5]})            # same shape: reused
    assert r.stats.builds == b and r.stats.reuses >= 1
    r.decode_seq_tokens({0: [6, 7]})         # two tokens: a new graph
    assert r.stats.builds == b + 1


def test_env_disables_reuse(monkeypatch):
    monkeypatch.setenv("MINIGRAPH_GRAPH_REUSE", "0")
    r = Runner(toy(mg.backend("ref")), mem_size=4)
    decode_stream(r, [{0: [1]}, {0: [2]}, {0: [3]}])
    assert r.stats.reuses == 0 and r.stats.builds == 3


def test_validator_catches_a_stale_graph():
    """Break reuse on purpose (a reuse check that always says yes, while the new ubatch's sequence
    lives in another cell) and check the validator fails loudly."""
    r = Runner(toy(mg.backend("ref")), mem_size=4, n_rs_seq=1, validate=True)
    r.decode_seq_tokens({0: [1, 2, 3]})
    r.decode_seq_tokens({0: [4]})
    from minigraph.models import graph as G
    orig = G.GraphResult.can_reuse
    try:
        G.GraphResult.can_reuse = lambda self, params: True
        with pytest.raises(Exception, match="differs from a fresh build"):
            r.decode_seq_tokens({1: [5]})    # seq 1 lives in another cell: head differs
    finally:
        G.GraphResult.can_reuse = orig


@pytest.mark.parametrize("device", ["ref", "cpu"])
@pytest.mark.parametrize("seed", range(4))
def test_rollback_equals_decoding_only_the_accepted_tokens(device, seed):
    rng = np.random.default_rng(seed)
    n_rs_seq = int(rng.integers(1, 4))
    prompt = [int(x) for x in rng.integers(0, 24, 6)]
    spec = Runner(toy(mg.backend(device)), mem_size=2, n_rs_seq=n_rs_seq)
    plain = Runner(toy(mg.backend(device)), mem_size=2, n_rs_seq=n_rs_seq)
    spec.decode_seq_tokens({0: prompt})
    plain.decode_seq_tokens({0: prompt})
    for _ in range(4):
        d = int(rng.integers(1, n_rs_seq + 2))                  # up to n_rs_seq + 1 drafted
        draft = [int(x) for x in rng.integers(0, 24, d)]
        n_accept = int(rng.integers(1, d + 1))                  # keep k < n: at least one token
        got = spec.speculative_step(0, draft, n_accept)
        want = plain.decode_seq_tokens({0: draft[:n_accept]})[0]
        assert np.array_equal(got, want)
        nxt = [int(rng.integers(0, 24))]
        a = spec.decode_seq_tokens({0: nxt})[0]
        b = plain.decode_seq_tokens({0: nxt})[0]
        assert np.array_equal(a, b)
    assert spec.stats.rollbacks > 0


def test_disallowed_rollbacks_are_refused_and_change_nothing():
    r = Runner(toy(mg.backend("ref")), mem_size=2, n_rs_seq=2)
    r.decode_seq_tokens({0: [1, 2, 3, 4]})
    before = state(r)
    assert not r.rollback(0, 3)          # k > n_rs_seq
    assert not r.rollback(0, 0)          # nothing to roll back
    r.decode_seq_tokens({0: [5]})
    assert not r.rollback(0, 1)          # k < n of the last ubatch (n = 1)
    r.decode_seq_tokens({0: [6, 7, 8]})
    assert r.rollback(0, 2)
    assert not r.rollback(0, 1)          # a rollback is already pending
    assert r.stats.rollbacks_refused == 4 and r.stats.rollbacks == 1
    del before


class BadIndexToy(ToyConvModel):
    """The toy plus a get_rows with an out-of-range index at the very end of the graph, after
    every layer has written its conv state."""

    def build(self, g):
        out = super().build(g)
        bad = g.ctx0.new_tensor_1d(mg.i32, 1).set_name("bad_ids").set_input()

        class BadInput(GraphInput):
            def set_input(self, ubatch):
                bad.set(np.array([10_000], np.int32))

            def can_reuse(self, params):
                return True
        g.res.inputs.append(BadInput())
        g.gf.build_forward_expand(mg.get_rows(self.output, bad).set_output())
        return out


@pytest.mark.parametrize("atomic", [True, "full"])
@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_failed_step_leaves_memory_as_it_was(device, atomic):
    """Both journals (the rows the step may write; the whole cache) undo the step; more failure
    cases in test_atomicity.py."""
    bad = Runner(BadIndexToy(n_vocab=24, n_embd=8, n_layer=2, d_conv=4, devices=mg.backend(device)),
                 mem_size=4, n_rs_seq=2, atomic=atomic)
    bad.model.__class__ = ToyConvModel       # same weights; prime without the bad node
    bad.decode_seq_tokens({0: [1, 2, 3, 4], 1: [5, 6, 7, 8]})
    bad.model.__class__ = BadIndexToy
    bad.prev = None
    cells_before = str(bad.memory)
    bytes_before = state(bad)
    with pytest.raises(mg.OpError, match="out of range"):
        bad.decode_seq_tokens({0: [9], 1: [10]})
    assert str(bad.memory) == cells_before
    after = state(bad)
    for k in bytes_before:
        assert after[k].tobytes() == bytes_before[k].tobytes()


def test_clamp_for_models_without_rollback():
    class NoRollback:
        arch, supports_rollback, causal = "x", False, True

    class NotCausal:
        arch, supports_rollback, causal = "y", True, False
    assert clamp_n_rs_seq(NoRollback(), 3) == 0
    assert clamp_n_rs_seq(NotCausal(), 3) == 0
    assert clamp_n_rs_seq(toy(mg.backend("ref")), 3) == 3


def slot_order_copies(report):
    """Copies of slot-order tensors (their names say so) in a placement report."""
    return [c for c in report.copies if "slot" in c.tensor]


def test_slot_order_placement_on_two_cpus():
    """4 conv layers: 0,1 on cpu:1, 2,3 on cpu:0 (the host)."""
    d1, d0 = mg.backend("cpu:1"), mg.backend("cpu:0")
    found = {}
    for strategy in SLOT_ORDERS:
        r = Runner(toy([d1, d1, d0, d0], n_layer=4), mem_size=2, n_rs_seq=2, slot_order=strategy)
        r.decode_seq_tokens({0: [1, 2, 3]})
        found[strategy] = slot_order_copies(r.prev.sched.placement_report())
    assert found["per-layer"] == []
    # one order on the first conv layer's device (cpu:1); each of the 2 layers on cpu:0 copies its tail view
    assert [(c.src_device, c.dst_device) for c in found["shared-first-layer"]] == [("cpu:1", "cpu:0")] * 2
    # one host input (cpu:0), copied once to the other device and reused by every layer there
    assert [(c.tensor, c.src_device, c.dst_device) for c in found["host-input"]] == [("rs_s_slot_rev", "cpu:0", "cpu:1")]
    assert found["host-input"][0].used_by_splits and len(found["host-input"][0].used_by_splits) >= 1


def test_write_input_writes_through_the_kept_view_and_checks_the_count():
    # graph inputs are written with one assignment into a view kept with their buffer; a count
    # that does not match is an error (NumPy alone would broadcast a single value silently)
    from minigraph.models.graph import write_input
    be = mg.backend("cpu")
    ctx = mg.Context()
    t = ctx.new_tensor_1d(mg.i32, 4).set_name("inp_pos").set_input()
    mg.alloc_ctx_tensors(ctx, be, usage="any")
    write_input(t, [3, 1, 4, 1])
    assert t.numpy().tolist() == [3, 1, 4, 1]
    assert be.flat_view(t) is be.flat_view(t)                      # made once
    write_input(t, np.array([5, 9, 2, 6], np.int32))
    assert t.numpy().tolist() == [5, 9, 2, 6]
    with pytest.raises(mg.OpError, match="set 'inp_pos': 1 values for its 4 elements"):
        write_input(t, [7])
    assert t.numpy().tolist() == [5, 9, 2, 6]
