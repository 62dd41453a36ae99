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

CFG = dict(n_vocab=64, n_embd=64, n_layer=2, n_head=2, head_dim=16, d_conv=4, n_ff=96,
           head_count_kv=0)               # KDA blocks only (the reference's); MLA: see the end


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


# -- MLA blocks (llama.cpp's absorbed MLA, K-only cache); tests/test_llama_oracle_kimi.py compares
#    the logits with llama.cpp itself ---------------------------------------------------------------

MLA = dict(n_layer=3, head_count_kv=[0, 1, 0], kv_lora_rank=24, mla_k_head_dim=20, mla_v_head_dim=12, n_rot=4)


def mla_numpy(m, x: np.ndarray, pos_of_cells: int) -> np.ndarray:
    """One MLA block's mixer written from the math (float64), all tokens of one sequence:
    q_h = [q_nope_h | q_pe_h]; k_t = [norm(kv_t) | k_pe_t]; head h attends with
    score(t, s) = (k_b_h^T q_nope_h) . kv_s + q_pe_h . k_pe_s, scaled by 1/sqrt(dk), causal; the
    attended latent sum_s p(t, s) kv_s goes through v_b_h, then attn_output."""
    w = {k: t.numpy().astype(np.float64) for k, t in m.layer_w[1].items()}
    H, dk, dv, r, lora = m.n_head, m.mla_k_head_dim, m.mla_v_head_dim, m.n_rot, m.kv_lora_rank
    T = x.shape[0]
    q = (x @ w["attn_q"].T).reshape(T, H, dk)
    kvpe = x @ w["attn_kv_a_mqa"].T
    kv, kpe = kvpe[:, :lora], kvpe[:, lora:]
    kv = kv / np.sqrt(np.mean(kv * kv, axis=1, keepdims=True) + m.eps) * w["attn_kv_a_norm"]
    out = np.zeros((T, H, dv))
    for h in range(H):
        qa = q[:, h, :dk - r] @ w["attn_k_b"][h].T                     # [T, lora]: absorbed
        s = (qa @ kv.T + q[:, h, dk - r:] @ kpe.T) / np.sqrt(dk)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[:, h] = (p @ kv) @ w["attn_v_b"][h].T                      # [T, dv]
    return out.reshape(T, H * dv) @ w["attn_output"].T


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_mla_block_matches_numpy(device, one_cpu_thread):
    m = kda(mg.backend(device), **MLA)
    assert m.attn_layers == (1,) and m.n_embd_k_gqa(1) == 28 and m.n_embd_v_gqa(1) == 0
    r = Runner(m, mem_size=1, n_ubatch=8)
    toks = [5, 9, 2, 33, 17, 8]
    r.decode_seq_tokens({0: toks})
    got = r.prev.outputs["mixer.1"].numpy()             # [T, n_embd]
    l_out0 = r.prev.outputs["l_out.0"].numpy().astype(np.float64)
    x = l_out0 / np.sqrt(np.mean(l_out0 ** 2, axis=1, keepdims=True) + m.eps) * m.layer_w[1]["attn_norm"].numpy()
    want = mla_numpy(m, x, 0)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5
    assert r.memory.kv.v_l[1] is None                   # K only: the values are a view of the keys


def test_mla_model_rollback_and_reuse(one_cpu_thread):
    """A draft rolled back leaves the hybrid as if it was never decoded; graphs are reused."""
    mk = lambda: kda(mg.backend("cpu"), **MLA)       # noqa: E731
    a, b = Runner(mk(), mem_size=1, n_rs_seq=3, validate=True), Runner(mk(), mem_size=1, n_rs_seq=3)
    a.decode_seq_tokens({0: [1, 2, 3, 4, 5]})
    b.decode_seq_tokens({0: [1, 2, 3, 4, 5]})
    a.decode_seq_tokens({0: [7, 8, 9]})
    assert a.rollback(0, 2)
    b.decode_seq_tokens({0: [7]})
    for t in (11, 12, 13):
        np.testing.assert_array_equal(a.decode_seq_tokens({0: [t]})[0], b.decode_seq_tokens({0: [t]})[0])
    assert a.stats.reuses > 0 and a.stats.validated == a.stats.reuses


@pytest.mark.parametrize("kw, match", [
    (dict(head_count_kv=[0, 2, 0]), r"head_count_kv\[1\] = 2, expected 0 \(KDA block\) or 1"),
    (dict(head_count_kv=[0, 1, 0], n_rot=20, mla_k_head_dim=20), r"rope.dimension_count = 20"),
    (dict(head_count_kv=[0, 1]), r"head_count_kv has 2 entries, expected one per layer \(3\)"),
])
def test_bad_mla_layouts_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        kda(mg.backend("ref"), **{**MLA, **kw})
    assert "\n" not in str(e.value)


def test_mla_file_round_trip_and_moe_refused(tmp_path):
    from minigraph.models.gguf_io import GGUFError, load_gguf, read_metadata, save_gguf
    cpu = mg.backend("cpu")
    m = kda(cpu, **MLA)
    path = save_gguf(m, tmp_path / "mla.gguf", embed_hparams=False)
    kv = read_metadata(path)
    assert list(kv["kimi-linear.attention.head_count_kv"]) == [0, 1, 0]
    assert (kv["kimi-linear.attention.key_length"], kv["kimi-linear.attention.value_length"]) == (28, 24)
    back = load_gguf(path, devices=cpu)
    assert back.attn_layers == (1,) and back.hparams == {k: v for k, v in m.hparams.items()}
    toks = {0: [4, 5, 6]}
    np.testing.assert_array_equal(Runner(m, mem_size=1).decode_seq_tokens(toks)[0],
                                  Runner(back, mem_size=1).decode_seq_tokens(toks)[0])
    # a file whose blocks from 1 on have MoE FFNs: refused, naming the block and the key
    import gguf
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "kimi-linear")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = f.contents()
        if name == "kimi-linear.leading_dense_block_count":
            val = 1
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, val, f.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()   # noqa: E702
    with pytest.raises(GGUFError, match=r"block 1 has a MoE FFN \(kimi-linear.leading_dense_block_count = 1"):
        load_gguf(tmp_path / "moe.gguf", devices=cpu)
