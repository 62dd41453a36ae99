"""Kimi delta attention model (models/kda.py) against the independent sequential reference
(tests/refs/kda_ref.py): logits, every block's mixer output, every written rollback slot of the
r cache (three conv histories in one row) and of the s cache (delta-rule state), for prefill,
token-by-token decode, two-sequence ubatches, split batches and n_rs_seq in {0, 1, 3}, on `ref` and
`cpu`; rollback integrity (one device, and layers split over cpu:1 / cpu:0 under each slot order);
graph reuse. The model-agnostic helpers come from tests/test_model_lfm.py."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.models.graph import SLOT_ORDERS, GraphContext
from minigraph.models.kda import KDAModel
from minigraph.models.runner import Runner
from refs.kda_ref import KdaRef
from test_model_lfm import cache_rows, make_stream, one_cpu_thread, rollback_trial, run_stream, weights_of  # noqa: F401

CFG = dict(n_vocab=64, n_embd=64, n_layer=2, n_head=2, head_dim=16, d_conv=4, n_ff=96)


def kda(devices, seed=0, **kw):
    return KDAModel(**{**CFG, **kw}, devices=devices, seed=seed, layer_outputs=True)


def kda_ref(model):
    return KdaRef(weights_of(model), model.n_layer, model.n_head, model.head_dim, model.d_conv, model.eps)


def test_model_shape_and_memory_sizes():
    m = kda(mg.backend("ref"))
    assert m.arch == "kimi-linear" and m.supports_rollback and m.causal
    assert m.n_embd_r(0) == 3 * (4 - 1) * 32 and m.n_embd_s(0) == 16 * 16 * 2
    r = Runner(m, mem_size=2, n_rs_seq=2)
    assert r.memory.r_l[1].ne[:2] == (288, 6) and r.memory.s_l[1].ne[:2] == (512, 6)
    ne = {name: t.ne[:t.n_dims()] for name, t in m.gguf_tensors().items()}
    # llama.cpp's shapes, ne order
    assert ne["blk.0.attn_q.weight"] == (64, 32) and ne["blk.0.ssm_conv1d_q.weight"] == (4, 1, 32)
    assert ne["blk.0.ssm_f_a.weight"] == (64, 16) and ne["blk.0.ssm_f_b.weight"] == (16, 32)
    assert ne["blk.0.ssm_dt.bias"] == (32,) and ne["blk.0.ssm_a"] == (1, 2)
    assert ne["blk.0.ssm_beta.weight"] == (64, 2) and ne["blk.0.ssm_g_b.weight"] == (16, 32)
    assert ne["blk.0.ssm_norm.weight"] == (16,) and ne["blk.0.attn_output.weight"] == (32, 64)
    assert np.all(m.gguf_tensors()["blk.1.ssm_a"].numpy() < 0)         # stored as -exp(A_log)


def test_weights_live_on_their_layer_device():
    d1, d0 = mg.backend("cpu:1"), mg.backend("cpu:0")
    m = kda([d1, d0])
    for name, t in m.gguf_tensors().items():
        assert t.backend is (d1 if name.startswith("blk.0.") else d0), name


def test_three_histories_in_one_row_and_the_vector_gate(monkeypatch):
    calls = []
    orig = GraphContext.build_conv_state_store

    def spy(self, inp, s, conv_x, n_cols, offs=0):
        calls.append((s.name, n_cols, offs))
        return orig(self, inp, s, conv_x, n_cols, offs)
    monkeypatch.setattr(GraphContext, "build_conv_state_store", spy)
    r = Runner(kda(mg.backend("ref")), mem_size=2, n_rs_seq=3)
    r.decode_seq_tokens({0: [1, 2, 3]})
    css = 3 * 32                                   # (d_conv-1) * d_inner floats per part
    assert calls == [(f"cache_r_l{il}", 3, part * css * 4) for il in (0, 1) for part in range(3)]
    gdn = [n for n in r.prev.gf.nodes if n.op == "GATED_DELTA_NET"]
    assert len(gdn) == 2
    for n in gdn:
        assert n.params["K"] == 4
        assert n.srcs["g"].ne == (16, 2, 3, 1)      # per key dim: [head_dim, n_head, T, S]
        assert n.srcs["beta"].ne == (1, 2, 3, 1)


@pytest.mark.parametrize("n_rs_seq", [0, 1, 3])
@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_matches_reference(device, n_rs_seq):
    m = kda(mg.backend(device))
    r = Runner(m, mem_size=2, n_rs_seq=n_rs_seq, n_ubatch=8)
    run_stream(r, kda_ref(m), CFG["n_vocab"], f"[{device} n_rs_seq={n_rs_seq}]")


def test_state_parts_do_not_overlap():
    """Each of the three conv histories (Q, K, V) sits in its own third of the r row: compare
    every part with the reference's history of that projection separately."""
    m = kda(mg.backend("ref"))
    ref = kda_ref(m)
    r = Runner(m, mem_size=2, n_rs_seq=1)
    r.decode_seq_tokens({0: [5, 6, 7]})
    st = ref.new_state()
    for t in (5, 6, 7):
        st = ref.token(t, st)[1]
    rows, _ = cache_rows(r, 0)
    cell = r.memory.cells[0].tail
    got = rows[cell].reshape(3, 32, 3)
    for part in range(3):
        np.testing.assert_allclose(got[part], st[0]["conv"][part], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_rollback_integrity(device, one_cpu_thread):
    ref = kda_ref(kda(mg.backend(device)))
    for seed in range(6):
        rollback_trial(lambda: kda(mg.backend(device)), CFG["n_vocab"], seed,
                       check_ref=ref if seed < 2 else None, exact=device == "ref")


@pytest.mark.parametrize("slot_order", SLOT_ORDERS)
def test_rollback_integrity_layers_on_two_devices(slot_order, one_cpu_thread):
    d1, d0 = mg.backend("cpu:1"), mg.backend("cpu:0")
    for seed in range(2):
        split = rollback_trial(lambda: kda([d1, d0]), CFG["n_vocab"], seed, slot_order=slot_order, exact=False)
        single = rollback_trial(lambda: kda(d0), CFG["n_vocab"], seed, slot_order=slot_order, exact=False)
        assert np.array_equal(split, single)


def test_graph_reuse_rebuilds_only_on_shape_change_and_validates(one_cpu_thread):
    r = Runner(kda(mg.backend("cpu")), mem_size=2, n_rs_seq=2, validate=True)
    r.decode_seq_tokens({0: [1, 2, 3, 4]})
    for t in range(5, 9):
        r.decode_seq_tokens({0: [t]})
    assert (r.stats.builds, r.stats.reuses) == (2, 3)
    r.decode_seq_tokens({0: [9, 10], 1: [3, 4]})   # new shape: rebuilt
    assert r.prev.inputs[1].rs_z >= 0              # seq 1 is new: its cell gets the zero row
    r.decode_seq_tokens({0: [11, 12], 1: [5, 6]})  # same shape, but rs_z changed: rebuilt
    r.decode_seq_tokens({0: [13, 14], 1: [7, 8]})  # same shape and rs_z: reused
    assert (r.stats.builds, r.stats.reuses) == (4, 4)
    assert r.stats.validated == r.stats.reuses


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_reuse_on_equals_reuse_off(device, one_cpu_thread):
    outs = []
    for reuse in (True, False):
        r = Runner(kda(mg.backend(device)), mem_size=2, n_rs_seq=1, reuse=reuse, validate=reuse)
        logits = [r.decode_seq_tokens(step) for step in make_stream(CFG["n_vocab"], seed=3)]
        outs.append((logits, [x for il in r.model.layers for x in cache_rows(r, il) if x is not None]))
    (l_on, s_on), (l_off, s_off) = outs
    for a, b in zip(l_on, l_off):
        for s in a:
            assert np.array_equal(a[s], b[s])
    for a, b in zip(s_on, s_off):
        assert np.array_equal(a, b)
