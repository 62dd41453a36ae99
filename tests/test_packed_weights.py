"""Weights a backend keeps packed for its MUL_MAT kernels (Backend.pack_weight; on the cpu backend
q4_K rows in groups of 8, quant_matmul.c's MG_Q4_KX8): the products have the bits of the plain
rows whatever the columns and threads; numpy(), set() and the scheduler's copies see the plain
bytes; any other op that would read the packed bytes is refused with one line; a GGUF load packs
every weight but the ones the model reads by row, and the logits are the same bits."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.backends import cpu as cpu_mod
from minigraph.models.gguf_io import load_gguf, save_gguf
from minigraph.models.lfm import LFM2Model
from minigraph.models.runner import Runner

pytestmark = pytest.mark.skipif(
    cpu_mod.lib is None or cpu_mod.lib.mg_packed_type(cpu_mod._TYPE_CODES[mg.q4_k]) < 0,
    reason="this build of the cpu kernels has no 8-row q4_K kernel (needs AVX-512 VNNI + VBMI): "
           "it never packs weights, pack_weight returns False")


def _q4k(rng, M, K, t=mg.q4_k):
    return np.asarray(mg.quantize(rng.standard_normal((M, K)).astype(np.float32), t)).reshape(M, -1)


def _f32_leaf(be, x):
    """x ([N, K] f32) as a tensor [K, N] in be's memory."""
    ctx = mg.Context()
    t = ctx.new_tensor_2d(mg.f32, x.shape[1], x.shape[0])
    mg.alloc_ctx_tensors(ctx, be)
    t.set(x)
    return t


def _graph(y):
    g = mg.Graph()
    g.build_forward_expand(y)
    return g


def _product(be, raw, x, pack, t=mg.q4_k):
    """mul_mat(w, x) on be with w (type t) holding the bytes raw, packed or not; (w, result)."""
    M, K, N = raw.shape[0], x.shape[1], x.shape[0]
    ctx = mg.Context()
    w = ctx.new_tensor_2d(t, K, M)
    xt = ctx.new_tensor_2d(mg.f32, K, N)
    mg.alloc_ctx_tensors(ctx, be)
    w.set(raw)
    xt.set(x)
    if pack:
        assert be.pack_weight(w)
    y = mg.mul_mat(w, xt)
    be.graph_compute(_graph(y))
    return w, y.numpy()


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("K, M", [(256, 8), (768, 37), (512, 64)])
@pytest.mark.parametrize("t", [mg.q4_k, mg.q6_k], ids=lambda t: t.name)
def test_packed_product_has_the_plain_bits_for_every_column_count(t, K, M, n_threads):
    """1 to 64 columns (the 8-row tiles by 1-6 columns, the panels from 8 (q4_K) or 24 (q6_K)),
    rows after the last whole group of 8 included: each column equals the plain weights' product
    and the product of that column alone, bit for bit."""
    be = mg.backend("cpu")
    old = be.n_threads
    be.set_n_threads(n_threads)
    try:
        rng = np.random.default_rng(K + M)
        raw = _q4k(rng, M, K, t)
        x = rng.standard_normal((64, K)).astype(np.float32)
        alone = [_product(be, raw, x[j:j + 1], True, t)[1] for j in range(64)]
        for N in (1, 2, 5, 6, 7, 8, 9, 17, 24, 64):
            plain = _product(be, raw, x[:N], False, t)[1]
            w, packed = _product(be, raw, x[:N], True, t)
            assert w.root().offs in w.root().buffer.layouts
            assert np.array_equal(packed.view(np.uint32), plain.view(np.uint32)), f"N={N}"
            for j in range(N):
                assert np.array_equal(packed.reshape(N, M)[j].view(np.uint32), alone[j].reshape(M).view(np.uint32)), f"N={N} column {j}"
    finally:
        be.set_n_threads(old)


@pytest.mark.parametrize("t", [mg.q4_k, mg.q6_k], ids=lambda t: t.name)
def test_packed_bytes_read_and_write_as_plain(t):
    be = mg.backend("cpu")
    rng = np.random.default_rng(3)
    K, M = 512, 21
    raw = _q4k(rng, M, K, t)
    w, _ = _product(be, raw, rng.standard_normal((1, K)).astype(np.float32), True, t)
    buf, offs = w.storage()
    inside = buf.mem[offs:offs + w.nbytes()].reshape(M, -1)
    assert not np.array_equal(inside[:16], raw[:16])          # the groups really are rearranged
    assert np.array_equal(inside[16:], raw[16:])              # rows after the last group are not
    assert np.array_equal(w.numpy(), raw)
    rows = mg.view_2d(w, K, 5, w.nb[1], 6 * w.nb[1])                  # rows 6-10: across two groups
    assert np.array_equal(rows.numpy(), raw[6:11])
    assert np.array_equal(be.get_bytes(buf, offs + 100, 5000), raw.reshape(-1)[100:5100])
    new = _q4k(rng, M, K, t)
    w.set(new)                                                # written plain, packed again
    assert w.root().offs in buf.layouts and np.array_equal(w.numpy(), new)
    x = rng.standard_normal((3, K)).astype(np.float32)
    y = mg.mul_mat(w, _f32_leaf(be, x))
    be.graph_compute(_graph(y))
    assert np.array_equal(y.numpy().view(np.uint32), _product(be, new, x, False, t)[1].view(np.uint32))
    part = np.arange(7, dtype=np.uint8)
    be.set_bytes(buf, offs + 1000, part)                      # a raw write into a group
    want = new.reshape(-1).copy()
    want[1000:1007] = part
    assert np.array_equal(w.numpy().reshape(-1), want)


def test_other_uses_of_packed_bytes_are_refused_in_one_line():
    be = mg.backend("cpu")
    rng = np.random.default_rng(4)
    K, M = 256, 16
    w, _ = _product(be, _q4k(rng, M, K), rng.standard_normal((1, K)).astype(np.float32), True)
    w.set_name("blk.0.ffn_up.weight")
    ctx = mg.Context()
    idx = ctx.new_tensor_1d(mg.i32, 2)
    x = ctx.new_tensor_2d(mg.f32, K, 2)
    mg.alloc_ctx_tensors(ctx, be)
    idx.set(np.array([1, 3], np.int32))
    x.set(rng.standard_normal((2, K)).astype(np.float32))
    cases = {
        "GET_ROWS": mg.get_rows(w, idx),
        "MUL_MAT": mg.mul_mat(mg.view_2d(w, K, 8, w.nb[1], 8 * w.nb[1]), x),   # a view of it
    }
    for op, node in cases.items():
        with pytest.raises(mg.OpError) as e:
            be.graph_compute(_graph(node))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(op) and "blk.0.ffn_up.weight" in msg and "packed" in msg, msg
    with pytest.raises(mg.OpError, match="blk.0.ffn_up.weight.*packed"):
        be.view(w)


def test_scheduler_copies_a_packed_weight_plain():
    """A product placed on another device reads the weight through the scheduler's copy: the
    plain bytes, so the same values as the cpu's own product."""
    cpu, ref = mg.backend("cpu"), mg.backend("ref")
    rng = np.random.default_rng(5)
    K, M = 256, 24
    raw = _q4k(rng, M, K)
    x = rng.standard_normal((2, K)).astype(np.float32)
    w, on_cpu = _product(cpu, raw, x, True)
    y = mg.mul_mat(w, _f32_leaf(ref, x))
    sched = mg.Scheduler([ref, cpu])
    sched.set_tensor_backend(y, ref)
    sched.graph_compute(_graph(y))
    want = _product(ref, raw, x, False)[1]
    assert np.array_equal(y.numpy(), want)
    assert np.max(np.abs(on_cpu - want)) <= 1e-4 * np.max(np.abs(want))


def test_gguf_load_packs_all_but_the_row_read_weights(tmp_path):
    """lfm2 in Q4_K_M: every q4_K and q6_K weight of 8 rows or more but token_embd is packed (the
    Q6_K head included), and no q8_0 weight (not packed: slower to stream); the logits are the bits of an unpacked load, and saving gives the file
    back."""
    m = LFM2Model(n_vocab=40, n_embd=256, n_ff=512, n_head=4, head_count_kv=[0, 2], n_layer=2,
                  devices=mg.backend("ref"), seed=1)
    path = save_gguf(m, tmp_path / "lfm2-q4_k_m.gguf", ftype="q4_k_m")
    packed = load_gguf(path, devices=mg.backend("cpu"))
    plain = load_gguf(path, devices=mg.backend("cpu"), pack_weights=False)
    names = set()
    for name, t in packed.gguf_tensors().items():
        if t.view_src is None and t.root().offs in t.root().buffer.layouts:
            names.add(name)
    kinds = (mg.q4_k, mg.q6_k)
    want = {n for n, t in packed.gguf_tensors().items() if t.type in kinds and t.ne[1] >= 8} - {"token_embd.weight"}
    assert names == want and "output.weight" in names and len(names) > 8, names
    assert not any(t.root().buffer.layouts for t in plain.gguf_tensors().values())

    def logits(model):
        r = Runner(model, mem_size=1, n_rs_seq=1)
        return [r.decode_seq_tokens({0: toks})[0] for toks in ([1, 2, 3, 4, 5], [6])]
    for a, b in zip(logits(packed), logits(plain)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    again = save_gguf(packed, tmp_path / "again.gguf")
    assert again.read_bytes() == path.read_bytes()
