"""ggml semantics of minigraph on the reference backend, checked against expectations computed
here by hand: explicit Python loops over ggml indices i0..i3 and the ne/nb/byte-offset
definitions. The registry's NumPy references are never used as
the expectation.

Conventions in this file: a "4-D array" is a NumPy array in NumPy order [ne3, ne2, ne1, ne0], so
the ggml element (i0, i1, i2, i3) is ``arr[i3, i2, i1, i0]`` (helpers ``at`` / ``put``)."""
from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest

import minigraph as mg
from minigraph.alloc import plan_graph


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def pad(t, fill=1):
    t = tuple(int(x) for x in t)
    return t + (fill,) * (4 - len(t))


def shape4(ne):
    return tuple(reversed(pad(ne)))


def indices(ne):
    """Every ggml index (i0, i1, i2, i3) in flattened logical order (i0 fastest)."""
    ne = pad(ne)
    for i3 in range(ne[3]):
        for i2 in range(ne[2]):
            for i1 in range(ne[1]):
                for i0 in range(ne[0]):
                    yield i0, i1, i2, i3


def at(arr, i0, i1=0, i2=0, i3=0):
    return arr[i3, i2, i1, i0]


def put(arr, val, i0, i1=0, i2=0, i3=0):
    arr[i3, i2, i1, i0] = val


def rand(rng, dtype, ne, lo=-2.0, hi=2.0):
    """Random, never-zero data in NumPy order (4-D)."""
    shape = shape4(ne)
    if dtype.is_float:
        x = rng.uniform(lo, hi, shape)
        x = np.where(np.abs(x) < 1e-2, 0.75, x)
        return x.astype(dtype.np_dtype)
    x = rng.integers(1, 100, shape) * rng.choice([-1, 1], shape)
    return x.astype(dtype.np_dtype)


def got(t):
    """A tensor's contents as a 4-D array."""
    return t.numpy().reshape(shape4(t.ne))


def read_at(raw: bytes, dtype, addr):
    return np.frombuffer(raw, dtype=dtype.np_dtype, count=1, offset=addr)[0]


def gather(raw: bytes, dtype, ne, nb, offset):
    """What a view with (ne, nb, offset) reads from raw bytes: element address =
    offset + i0*nb0 + i1*nb1 + i2*nb2 + i3*nb3."""
    ne, nb = pad(ne), pad(nb, 0)
    out = np.empty(shape4(ne), dtype.np_dtype)
    for i0, i1, i2, i3 in indices(ne):
        put(out, read_at(raw, dtype, offset + i0 * nb[0] + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]), i0, i1, i2, i3)
    return out


def compute(ctx, outs, feeds, be=None):
    be = be if be is not None else mg.backend("ref")
    gf = mg.Graph()
    for o in outs:
        gf.build_forward_expand(o)
    mg.alloc_ctx_tensors(ctx, be)
    for t, a in feeds.items():
        t.set(a)
    be.graph_compute(gf)
    return gf


def root_bytes(t) -> np.ndarray:
    """A copy of the bytes of the tensor's root (the memory it owns)."""
    r = t.root()
    buf, _ = r.storage()
    return buf.mem[r.offs:r.offs + r.nbytes()].copy()


def softplus(x):
    return x if x > 20.0 else math.log1p(math.exp(x))


# ----------------------------------------------------------------------------------------------
# views
# ----------------------------------------------------------------------------------------------
def test_view_nd_strides_and_addresses():
    rng = np.random.default_rng(0)
    ctx = mg.Context()
    base = ctx.new_tensor_4d(mg.f32, 7, 5, 4, 3)
    data = rand(rng, mg.f32, base.ne)
    v1 = mg.view_1d(base, 10, 12)
    v2 = mg.view_2d(base, 3, 4, 36, 8)
    v3 = mg.view_3d(base, 2, 3, 4, 12, 100, 4)
    v4 = mg.view_4d(base, 2, 2, 3, 2, 20, 60, 400, 16)
    # nb0 is the type size; higher unspecified strides follow nb[N-1]*ne[N-1]
    assert v1.ne == (10, 1, 1, 1) and v1.nb == (4, 40, 40, 40)
    assert v2.ne == (3, 4, 1, 1) and v2.nb == (4, 36, 144, 144)
    assert v3.ne == (2, 3, 4, 1) and v3.nb == (4, 12, 100, 400)
    assert v4.ne == (2, 2, 3, 2) and v4.nb == (4, 20, 60, 400)
    for v in (v1, v2, v3, v4):
        assert v.op == "VIEW" and v.view_src is base
    outs = [mg.cont(v) for v in (v1, v2, v3, v4)]
    compute(ctx, outs, {base: data})
    raw = data.tobytes()
    for v, off, o in zip((v1, v2, v3, v4), (12, 8, 4, 16), outs):
        exp = gather(raw, mg.f32, v.ne, v.nb, off)
        np.testing.assert_array_equal(got(v), exp)        # read straight from memory
        np.testing.assert_array_equal(got(o), exp)        # through a computed graph
        assert o.is_contiguous()


@pytest.mark.parametrize("dtype", [mg.f16, mg.i32])
def test_views_other_types(dtype):
    rng = np.random.default_rng(1)
    ctx = mg.Context()
    base = ctx.new_tensor_2d(dtype, 9, 4)
    data = rand(rng, dtype, base.ne)
    es = dtype.size
    v = mg.view_3d(base, 3, 4, 2, 2 * es, 9 * es * 2, 3 * es)
    compute(ctx, [mg.cont(v)], {base: data})
    np.testing.assert_array_equal(got(v), gather(data.tobytes(), dtype, v.ne, v.nb, 3 * es))


def test_overlapping_windows_view():
    rng = np.random.default_rng(2)
    ctx = mg.Context()
    base = ctx.new_tensor_2d(mg.f32, 10, 3)
    data = rand(rng, mg.f32, base.ne)
    # window w covers columns 1+w .. 1+w+3 of each row: nb1 == element size
    win = mg.view_3d(base, 4, 5, 3, 4, 40, 4)
    assert win.nb == (4, 4, 40, 120)
    assert not win.is_permuted() and not win.is_transposed()
    assert win.nbytes() == 4 + 3 * 4 + 4 * 4 + 2 * 40          # true strided extent
    c = mg.cont(win)
    compute(ctx, [c], {base: data})
    out = got(c)
    for i0, i1, i2, _ in indices(win.ne):
        assert at(out, i0, i1, i2) == at(data, 1 + i1 + i0, i2)
    np.testing.assert_array_equal(got(win), out)


def test_view_of_view_collapses_onto_root():
    rng = np.random.default_rng(3)
    ctx = mg.Context()
    base = ctx.new_tensor_2d(mg.f32, 7, 6)                 # 168 bytes
    data = rand(rng, mg.f32, base.ne)
    v1 = mg.view_2d(base, 5, 3, 28, 8)
    v2 = mg.view_2d(v1, 2, 2, 56, 12)
    v3 = mg.view_1d(v2, 3, 4)
    assert v2.view_src is base and v2.view_offs == 20
    assert v3.view_src is base and v3.view_offs == 24
    # a view of a view is bounds-checked against the root: it may reach past v1's own extent
    v4 = mg.view_1d(v1, 20, 40)                           # bytes 48 .. 128 of base
    assert v4.view_offs == 48
    outs = [mg.cont(v) for v in (v2, v3, v4)]
    compute(ctx, outs, {base: data})
    raw = data.tobytes()
    np.testing.assert_array_equal(got(outs[0]), gather(raw, mg.f32, (2, 2), (4, 56), 20))
    np.testing.assert_array_equal(got(outs[1]), gather(raw, mg.f32, (3,), (4,), 24))
    np.testing.assert_array_equal(got(outs[2]), gather(raw, mg.f32, (20,), (4,), 48))
    # a graph node of the chain also records its direct argument
    assert v2.srcs["a"] is v1


def test_view_of_computed_intermediate():
    rng = np.random.default_rng(4)
    ctx = mg.Context()
    a = ctx.new_tensor_2d(mg.f32, 6, 4)
    da = rand(rng, mg.f32, a.ne)
    y = mg.scale(a, 2.0)
    v = mg.view_2d(y, 3, 2, 48, 8)                        # rows 0 and 2, columns 2..4
    out = mg.cont(v)
    compute(ctx, [out], {a: da})
    exp = np.empty(shape4(v.ne), np.float32)
    for i0, i1, _, _ in indices(v.ne):
        put(exp, np.float32(2.0) * at(da, 2 + i0, 2 * i1), i0, i1)
    np.testing.assert_array_equal(got(out), exp)


def test_reshape_keeps_flattened_logical_order():
    rng = np.random.default_rng(5)
    ctx = mg.Context()
    base = ctx.new_tensor_3d(mg.f32, 6, 4, 2)
    data = rand(rng, mg.f32, base.ne)
    r3 = mg.reshape_3d(base, 8, 3, 2)
    r1 = mg.reshape_1d(r3, 48)
    r4 = mg.reshape_4d(base, 2, 3, 4, 2)
    r2 = mg.reshape_2d(r4, 12, 4)
    rr = mg.reshape(base, ctx.new_tensor_2d(mg.f32, 16, 3))
    for r in (r3, r1, r4, r2, rr):
        assert r.op == "RESHAPE" and r.view_src is base and r.view_offs == 0 and r.is_contiguous()
    assert rr.ne == (16, 3, 1, 1)
    outs = [mg.cont(r) for r in (r3, r1, r4, r2, rr)]
    compute(ctx, outs, {base: data})

    def src_flat(f):
        i0, rest = f % 6, f // 6
        return at(data, i0, rest % 4, rest // 4)

    for r, o in zip((r3, r1, r4, r2, rr), outs):
        ne = r.ne
        out = got(o)
        for i0, i1, i2, i3 in indices(ne):
            f = i0 + ne[0] * (i1 + ne[1] * (i2 + ne[2] * i3))
            assert at(out, i0, i1, i2, i3) == src_flat(f)
        np.testing.assert_array_equal(got(r), out)


def test_reshape_and_permute_of_offset_views_keep_the_offset():
    rng = np.random.default_rng(55)
    ctx = mg.Context()
    base = ctx.new_tensor_2d(mg.f32, 8, 3)
    data = rand(rng, mg.f32, base.ne)
    v = mg.view_1d(base, 12, 20)                           # elements 5 .. 16
    r = mg.reshape_2d(v, 4, 3)
    p = mg.permute(r, 1, 0, 2, 3)
    vt = mg.view_tensor(r)
    for t in (r, p, vt):
        assert t.view_src is base and t.view_offs == 20
    assert vt.ne == r.ne and vt.nb == r.nb
    c = mg.cont(p)
    compute(ctx, [c], {base: data})
    flat = data.reshape(-1)
    for i0, i1, _, _ in indices(p.ne):                     # p[i0, i1] = r[i1, i0] = flat[5 + i1 + 4*i0]
        assert at(got(c), i0, i1) == flat[5 + i1 + 4 * i0]


@pytest.mark.parametrize("axes", list(itertools.permutations(range(4))))
def test_permute_source_dim_i_becomes_axis_i(axes):
    rng = np.random.default_rng(6)
    ctx = mg.Context()
    base = ctx.new_tensor_4d(mg.f32, 2, 3, 4, 5)
    data = rand(rng, mg.f32, base.ne)
    p = mg.permute(base, *axes)
    for i in range(4):
        assert p.ne[axes[i]] == base.ne[i]
        assert p.nb[axes[i]] == base.nb[i]
    assert p.view_src is base and p.op == "PERMUTE"
    assert p.is_permuted() == (tuple(axes) != (0, 1, 2, 3))
    c = mg.cont(p)
    compute(ctx, [c], {base: data})
    out = got(c)
    for i in indices(base.ne):
        j = [0] * 4
        for d in range(4):
            j[axes[d]] = i[d]
        assert at(out, *j) == at(data, *i)
    np.testing.assert_array_equal(got(p), out)


def test_transpose_and_cont():
    rng = np.random.default_rng(7)
    ctx = mg.Context()
    base = ctx.new_tensor_3d(mg.f32, 3, 4, 2)
    data = rand(rng, mg.f32, base.ne)
    t = mg.transpose(base)
    assert t.ne == (4, 3, 2, 1) and t.nb == (12, 4, 48, 96)
    assert t.is_transposed() and t.is_permuted() and not t.is_contiguous()
    c = mg.cont(t)
    c2 = mg.cont_2d(t, 6, 4)
    c4 = mg.cont_4d(t, 2, 2, 3, 2)
    assert c.op == "CONT" and c.view_src is None and c.ne == (4, 3, 2, 1) and c.is_contiguous()
    compute(ctx, [c, c2, c4], {base: data})
    out = got(c)
    for i0, i1, i2, _ in indices(t.ne):
        assert at(out, i0, i1, i2) == at(data, i1, i0, i2)
    logical = [at(out, *i) for i in indices(t.ne)]
    for cc in (c2, c4):
        assert [at(got(cc), *i) for i in indices(cc.ne)] == logical


# ----------------------------------------------------------------------------------------------
# copies
# ----------------------------------------------------------------------------------------------
def test_cpy_flattened_order_into_other_shape_writes_through():
    rng = np.random.default_rng(8)
    ctx = mg.Context()
    src = ctx.new_tensor_2d(mg.f32, 3, 4)
    dst = ctx.new_tensor_2d(mg.f32, 6, 2)
    ds, dd = rand(rng, mg.f32, src.ne), rand(rng, mg.f32, dst.ne)
    a = mg.transpose(src)                                  # ne (4, 3), not contiguous
    out = mg.cpy(a, dst)
    assert out.op == "CPY" and out.view_src is dst and out.ne == dst.ne and out.nb == dst.nb
    assert out.srcs["a"] is a and out.srcs["b"] is dst
    compute(ctx, [out], {src: ds, dst: dd})
    flat_src = [at(ds, i1, i0) for i0, i1, _, _ in indices(a.ne)]   # a[i0, i1] = src[i1, i0]
    flat_dst = [at(got(dst), *i) for i in indices(dst.ne)]
    assert flat_dst == flat_src
    np.testing.assert_array_equal(got(out), got(dst))


def test_cpy_into_strided_view_leaves_other_bytes():
    rng = np.random.default_rng(9)
    ctx = mg.Context()
    src = ctx.new_tensor_1d(mg.f32, 6)
    dst = ctx.new_tensor_2d(mg.f32, 5, 4)
    ds, dd = rand(rng, mg.f32, src.ne), rand(rng, mg.f32, dst.ne)
    dv = mg.view_2d(dst, 2, 3, 24, 8)                      # rows of 2 at byte 8, 32, 56
    out = mg.cpy(src, dv)
    assert out.view_src is dst and out.view_offs == 8
    compute(ctx, [out], {src: ds, dst: dd})
    exp = bytearray(dd.tobytes())
    for f, (i0, i1, _, _) in enumerate(indices(dv.ne)):
        addr = 8 + i0 * 4 + i1 * 24
        exp[addr:addr + 4] = np.float32(at(ds, f)).tobytes()
    assert root_bytes(dst).tobytes() == bytes(exp)


def test_cpy_converts_to_destination_type():
    rng = np.random.default_rng(10)
    ctx = mg.Context()
    src = ctx.new_tensor_2d(mg.f32, 4, 3)
    dst = ctx.new_tensor_1d(mg.f16, 12)
    ds = rand(rng, mg.f32, src.ne)
    out = mg.cpy(src, dst)
    assert out.type == mg.f16
    compute(ctx, [out], {src: ds, dst: rand(rng, mg.f16, dst.ne)})
    for f, i in enumerate(indices(src.ne)):
        assert at(got(dst), f) == np.float16(at(ds, *i))


def test_cast_f32_to_i32_truncates_toward_zero():
    ctx = mg.Context()
    a = ctx.new_tensor_2d(mg.f32, 4, 2)
    vals = np.array([[-2.7, -0.5, 0.5, 2.99], [7.0, -7.0, 1e6 + 0.75, -3.5]], np.float32)
    c = mg.cast(a, mg.i32)
    assert c.op == "CPY" and c.type == mg.i32 and c.view_src is None and c.is_contiguous()
    compute(ctx, [c], {a: vals})
    exp = [[-2, 0, 0, 2], [7, -7, 1000000, -3]]
    np.testing.assert_array_equal(c.numpy(), np.array(exp, np.int32))


def test_cast_f16_both_ways_and_transposed_input():
    rng = np.random.default_rng(11)
    ctx = mg.Context()
    a = ctx.new_tensor_2d(mg.f32, 3, 5)
    h = ctx.new_tensor_2d(mg.f16, 4, 2)
    da, dh = rand(rng, mg.f32, a.ne), rand(rng, mg.f16, h.ne)
    to16 = mg.cast(mg.transpose(a), mg.f16)
    to32 = mg.cast(h, mg.f32)
    compute(ctx, [to16, to32], {a: da, h: dh})
    assert to16.ne == (5, 3, 1, 1) and to16.type == mg.f16
    for i0, i1, _, _ in indices(to16.ne):
        assert at(got(to16), i0, i1) == np.float16(at(da, i1, i0))
    for i in indices(h.ne):
        assert at(got(to32), *i) == np.float32(at(dh, *i))


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat_every_dim_with_transposed_input(dim):
    rng = np.random.default_rng(12 + dim)
    ctx = mg.Context()
    A = (2, 3, 2, 2)
    base = ctx.new_tensor_4d(mg.f32, A[1], A[0], A[2], A[3])
    a = mg.transpose(base)                                 # ne == A
    B = list(A)
    B[dim] = 3
    b = ctx.new_tensor_4d(mg.f32, *B)
    dbase, db = rand(rng, mg.f32, base.ne), rand(rng, mg.f32, B)
    c = mg.concat(a, b, dim)
    exp_ne = list(A)
    exp_ne[dim] = A[dim] + B[dim]
    assert c.ne == tuple(exp_ne) and c.is_contiguous()
    compute(ctx, [c], {base: dbase, b: db})
    out = got(c)
    for i in indices(c.ne):
        if i[dim] < A[dim]:
            exp = at(dbase, i[1], i[0], i[2], i[3])        # a[i0, i1] = base[i1, i0]
        else:
            j = list(i)
            j[dim] -= A[dim]
            exp = at(db, *j)
        assert at(out, *i) == exp


# ----------------------------------------------------------------------------------------------
# set_rows / get_rows / arange
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("idx_type", [mg.i32, mg.i64])
@pytest.mark.parametrize("src_type,dst_type", [(mg.f32, mg.f32), (mg.f32, mg.f16), (mg.f16, mg.f16), (mg.f16, mg.f32)])
def test_set_rows_broadcast_modulo(idx_type, src_type, dst_type):
    rng = np.random.default_rng(20)
    ctx = mg.Context()
    dst = ctx.new_tensor_4d(dst_type, 5, 6, 4, 4)
    b = ctx.new_tensor_4d(src_type, 5, 3, 4, 4)
    c = ctx.new_tensor_3d(idx_type, 3, 2, 2)              # b.ne2 % 2 == 0, b.ne3 % 2 == 0
    ddst, db = rand(rng, dst_type, dst.ne), rand(rng, src_type, b.ne)
    dc = np.zeros(shape4(c.ne), idx_type.np_dtype)
    for j2 in range(2):
        for j1 in range(2):
            dc[0, j2, j1, :] = rng.permutation(6)[:3]      # distinct rows per slice
    out = mg.set_rows(dst, b, c)
    assert out.op == "SET_ROWS" and out.view_src is dst and out.type == dst_type
    assert out.srcs["b"] is b and out.srcs["c"] is c and out.srcs["a"] is dst
    compute(ctx, [out], {dst: ddst, b: db, c: dc})
    exp = ddst.copy()
    written = set()
    for i in range(3):
        for i02 in range(4):
            for i03 in range(4):
                r = int(at(dc, i, i02 % 2, i03 % 2))
                written.add((r, i02, i03))
                for i00 in range(5):
                    put(exp, dst_type.np_dtype.type(np.float32(at(db, i00, i, i02, i03))), i00, r, i02, i03)
    assert len(written) < 6 * 4 * 4                        # some rows are not indexed ...
    np.testing.assert_array_equal(got(dst), exp)           # ... and stay untouched
    assert root_bytes(dst).tobytes() == exp.tobytes()


def test_set_rows_into_strided_destination_view_leaves_gaps():
    rng = np.random.default_rng(21)
    ctx = mg.Context()
    mem = ctx.new_tensor_2d(mg.f32, 8, 5)
    b = ctx.new_tensor_2d(mg.f32, 3, 2)
    c = ctx.new_tensor_1d(mg.i32, 2)
    dmem, db = rand(rng, mg.f32, mem.ne), rand(rng, mg.f32, b.ne)
    dview = mg.view_2d(mem, 3, 5, 32, 4)                   # columns 1..3 of every row
    out = mg.set_rows(dview, b, c)
    compute(ctx, [out], {mem: dmem, b: db, c: np.array([4, 1], np.int32)})
    exp = dmem.copy()
    for i, r in enumerate([4, 1]):
        for i0 in range(3):
            put(exp, at(db, i0, i), 1 + i0, r)
    np.testing.assert_array_equal(got(mem), exp)


def test_get_rows_broadcast_over_dims_2_3():
    rng = np.random.default_rng(22)
    for a_type, out_type in ((mg.f32, mg.f32), (mg.f16, mg.f32), (mg.i32, mg.i32)):
        ctx = mg.Context()
        a = ctx.new_tensor_4d(a_type, 4, 6, 3, 2)
        ids = ctx.new_tensor_3d(mg.i32, 5, 3, 2)           # a.ne2 == ids.ne1, a.ne3 == ids.ne2
        da = rand(rng, a_type, a.ne)
        di = rng.integers(0, 6, shape4(ids.ne)).astype(np.int32)
        out = mg.get_rows(a, ids)
        assert out.ne == (4, 5, 3, 2) and out.type == out_type
        compute(ctx, [out], {a: da, ids: di})
        o = got(out)
        for i0, i, j, k in indices(out.ne):
            r = int(at(di, i, j, k))
            assert at(o, i0, i, j, k) == out_type.np_dtype.type(at(da, i0, r, j, k))


def test_get_rows_from_transposed_rows_view():
    rng = np.random.default_rng(23)
    ctx = mg.Context()
    base = ctx.new_tensor_2d(mg.f32, 5, 4)
    ids = ctx.new_tensor_1d(mg.i32, 3)
    db = rand(rng, mg.f32, base.ne)
    a = mg.view_2d(base, 3, 4, 20, 8)                      # rows of 3 starting at column 2
    out = mg.get_rows(a, ids)
    compute(ctx, [out], {base: db, ids: np.array([3, 0, 3], np.int32)})
    for i0, i, _, _ in indices(out.ne):
        assert at(got(out), i0, i) == at(db, 2 + i0, [3, 0, 3][i])


@pytest.mark.parametrize("start,stop,step", [(0, 5, 1), (0, 5, 2), (1, 2, 0.3), (0.5, 3, 1), (-3, 3, 0.5), (0, 1, 0.1)])
def test_arange(start, stop, step):
    ctx = mg.Context()
    t = mg.arange(ctx, start, stop, step)
    n = math.ceil((stop - start) / step)
    assert t.ne == (n, 1, 1, 1) and t.type == mg.f32 and t.op == "ARANGE" and not t.srcs
    compute(ctx, [t], {})
    exp = [np.float32(start) + np.float32(step) * np.float32(i) for i in range(n)]
    np.testing.assert_array_equal(t.numpy(), np.array(exp, np.float32))


# ----------------------------------------------------------------------------------------------
# elementwise, matmul, reductions
# ----------------------------------------------------------------------------------------------
def test_scale_and_scale_bias():
    rng = np.random.default_rng(30)
    ctx = mg.Context()
    a = ctx.new_tensor_2d(mg.f32, 5, 3)
    da = rand(rng, mg.f32, a.ne)
    s = mg.scale(a, 1.5)
    sb = mg.scale_bias(a, -0.25, 3.0)
    assert sb.op == "SCALE" and sb.params["s"] == -0.25 and sb.params["b"] == 3.0
    compute(ctx, [s, sb], {a: da})
    for i in indices(a.ne):
        x = at(da, *i)
        assert at(got(s), *i) == np.float32(x * np.float32(1.5))
        assert at(got(sb), *i) == pytest.approx(float(x) * -0.25 + 3.0, rel=1e-6)


def test_scale_inplace_writes_through():
    rng = np.random.default_rng(31)
    ctx = mg.Context()
    a = ctx.new_tensor_1d(mg.f32, 6)
    da = rand(rng, mg.f32, a.ne)
    v = mg.view_1d(a, 2, 8)
    z = mg.scale_inplace(v, 0.0)
    assert z.view_src is a and z.view_offs == 8
    compute(ctx, [z], {a: da})
    exp = da.copy().reshape(-1)
    exp[2:4] = 0
    np.testing.assert_array_equal(a.numpy(), exp)


@pytest.mark.parametrize("opname", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("b_ne", [(3, 2, 1, 2), (6, 4, 3, 2), (1, 1, 1, 1), (6, 1, 3, 1)])
def test_binary_broadcast_by_tiling(opname, b_ne):
    rng = np.random.default_rng(32)
    ctx = mg.Context()
    a = ctx.new_tensor_4d(mg.f32, 6, 4, 3, 2)
    b = ctx.new_tensor_4d(mg.f32, *b_ne)
    da, db = rand(rng, mg.f32, a.ne), rand(rng, mg.f32, b.ne)
    out = getattr(mg, opname)(a, b)
    assert out.op == opname.upper() and out.ne == a.ne
    compute(ctx, [out], {a: da, b: db})
    f = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y,
         "mul": lambda x, y: x * y, "div": lambda x, y: x / y}[opname]
    o = got(out)
    for i in indices(a.ne):
        j = [i[d] % b_ne[d] for d in range(4)]
        assert at(o, *i) == f(np.float32(at(da, *i)), np.float32(at(db, *j)))


def test_mul_mat_orientation_and_broadcast_by_division():
    rng = np.random.default_rng(33)
    ctx = mg.Context()
    K, M, N = 5, 3, 4
    a = ctx.new_tensor_4d(mg.f32, K, M, 2, 3)
    b = ctx.new_tensor_4d(mg.f32, K, N, 4, 6)
    da, db = rand(rng, mg.f32, a.ne), rand(rng, mg.f32, b.ne)
    out = mg.mul_mat(a, b)
    assert out.ne == (M, N, 4, 6) and out.type == mg.f32
    compute(ctx, [out], {a: da, b: db})
    o = got(out)
    for m, n, i2, i3 in indices(out.ne):
        exp = sum(float(at(da, k, m, i2 // 2, i3 // 2)) * float(at(db, k, n, i2, i3)) for k in range(K))
        assert at(o, m, n, i2, i3) == pytest.approx(exp, rel=1e-5, abs=1e-6)


def test_mul_mat_with_transposed_b():
    rng = np.random.default_rng(34)
    ctx = mg.Context()
    a = ctx.new_tensor_2d(mg.f32, 4, 3)
    bb = ctx.new_tensor_2d(mg.f32, 2, 4)                  # stored [N, K]
    da, db = rand(rng, mg.f32, a.ne), rand(rng, mg.f32, bb.ne)
    b = mg.cont(mg.transpose(bb))                          # b[k, n] = bb[n, k]
    out = mg.mul_mat(a, b)
    assert out.ne == (3, 2, 1, 1)
    compute(ctx, [out], {a: da, bb: db})
    for m, n, _, _ in indices(out.ne):
        exp = sum(float(at(da, k, m)) * float(at(db, n, k)) for k in range(4))
        assert at(got(out), m, n) == pytest.approx(exp, rel=1e-5)


def test_ssm_conv_is_cross_correlation():
    rng = np.random.default_rng(35)
    ctx = mg.Context()
    d_conv, n_t, d_inner, n_s = 4, 5, 3, 2
    sx = ctx.new_tensor_3d(mg.f32, d_conv - 1 + n_t, d_inner, n_s)
    c = ctx.new_tensor_2d(mg.f32, d_conv, d_inner)
    dsx, dc = rand(rng, mg.f32, sx.ne), rand(rng, mg.f32, c.ne)
    out = mg.ssm_conv(sx, c)
    assert out.ne == (d_inner, n_t, n_s, 1)
    compute(ctx, [out], {sx: dsx, c: dc})
    o = got(out)
    for ch, t, s, _ in indices(out.ne):
        acc = np.float32(0)
        for k in range(d_conv):                            # f32, taps ascending, no flip
            acc = np.float32(acc + np.float32(at(dsx, t + k, ch, s) * at(dc, k, ch)))
        assert at(o, ch, t, s) == acc


def test_ssm_conv_with_free_dim2_stride():
    rng = np.random.default_rng(36)
    ctx = mg.Context()
    big = ctx.new_tensor_3d(mg.f32, 6, 2, 3)
    c = ctx.new_tensor_2d(mg.f32, 3, 2)
    dbig, dc = rand(rng, mg.f32, big.ne), rand(rng, mg.f32, c.ne)
    sx = mg.view_3d(big, 6, 2, 2, 24, 96, 0)               # skip the middle seq: nb2 free
    out = mg.ssm_conv(sx, c)
    compute(ctx, [out], {big: dbig, c: dc})
    for ch, t, s, _ in indices(out.ne):
        exp = sum(float(at(dbig, t + k, ch, 2 * s)) * float(at(dc, k, ch)) for k in range(3))
        assert at(got(out), ch, t, s) == pytest.approx(exp, rel=1e-5, abs=1e-6)


def test_rms_norm_l2_norm_sum_rows():
    rng = np.random.default_rng(37)
    ctx = mg.Context()
    a = ctx.new_tensor_3d(mg.f32, 7, 3, 2)
    da = rand(rng, mg.f32, a.ne)
    da[0, 1, 2, :] *= 1e-4                                 # a tiny row: l2's eps branch below
    eps = 1e-5
    rn, l2, l2big, sr = mg.rms_norm(a, eps), mg.l2_norm(a, eps), mg.l2_norm(a, 0.5), mg.sum_rows(a)
    assert sr.ne == (1, 3, 2, 1)
    compute(ctx, [rn, l2, l2big, sr], {a: da})
    for i1, i2 in itertools.product(range(3), range(2)):
        row = [float(at(da, i0, i1, i2)) for i0 in range(7)]
        ss = sum(x * x for x in row)
        assert at(got(sr), 0, i1, i2) == pytest.approx(sum(row), rel=1e-6, abs=1e-6)
        for i0 in range(7):
            assert at(got(rn), i0, i1, i2) == pytest.approx(row[i0] / math.sqrt(ss / 7 + eps), rel=1e-5)
            assert at(got(l2), i0, i1, i2) == pytest.approx(row[i0] / max(math.sqrt(ss), eps), rel=1e-5)
            assert at(got(l2big), i0, i1, i2) == pytest.approx(row[i0] / max(math.sqrt(ss), 0.5), rel=1e-5)


def test_repeat_tiles():
    rng = np.random.default_rng(38)
    ctx = mg.Context()
    a = ctx.new_tensor_4d(mg.f32, 2, 3, 1, 2)
    like = ctx.new_tensor_4d(mg.f32, 4, 6, 3, 2)
    da = rand(rng, mg.f32, a.ne)
    r = mg.repeat(a, like)
    r4 = mg.repeat_4d(a, 6, 3, 2, 4)
    assert r.ne == like.ne and r4.ne == (6, 3, 2, 4)
    compute(ctx, [r, r4], {a: da, like: rand(rng, mg.f32, like.ne)})
    for t in (r, r4):
        for i in indices(t.ne):
            assert at(got(t), *i) == at(da, *[i[d] % a.ne[d] for d in range(4)])


# ----------------------------------------------------------------------------------------------
# ssm_scan and gated_delta_net with K snapshots
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,K", [(5, 3), (2, 4), (3, 1), (1, 2)])
def test_ssm_scan_snapshots(T, K):
    rng = np.random.default_rng(40 + T * 10 + K)
    d_state, head_dim, n_head, n_group, n_seqs, rows = 3, 2, 4, 2, 2, 5
    ctx = mg.Context()
    s = ctx.new_tensor_4d(mg.f32, d_state, head_dim, n_head, rows)
    x = ctx.new_tensor_4d(mg.f32, head_dim, n_head, T, n_seqs)
    dt = ctx.new_tensor_3d(mg.f32, n_head, T, n_seqs)
    A = ctx.new_tensor_2d(mg.f32, 1, n_head)
    B = ctx.new_tensor_4d(mg.f32, d_state, n_group, T, n_seqs)
    C = ctx.new_tensor_4d(mg.f32, d_state, n_group, T, n_seqs)
    ids = ctx.new_tensor_1d(mg.i32, n_seqs)
    data = {s: rand(rng, mg.f32, s.ne), x: rand(rng, mg.f32, x.ne), dt: rand(rng, mg.f32, dt.ne),
            A: -rng.uniform(0.1, 1.0, shape4(A.ne)).astype(np.float32),
            B: rand(rng, mg.f32, B.ne), C: rand(rng, mg.f32, C.ne), ids: np.array([3, 1], np.int32)}
    y = mg.ssm_scan(s, x, dt, A, B, C, ids, K)
    D = d_state * head_dim * n_head
    n_x = head_dim * n_head * T * n_seqs
    assert y.ne == (n_x + K * D * n_seqs, 1, 1, 1)
    compute(ctx, [y], data)
    out = y.numpy()

    ds_, dx, ddt, dA, dB, dC = (data[t] for t in (s, x, dt, A, B, C))
    for q in range(n_seqs):
        row = int(data[ids][q])
        for h in range(n_head):
            g = h // (n_head // n_group)
            st = [[float(at(ds_, i0, i1, h, row)) for i0 in range(d_state)] for i1 in range(head_dim)]
            for t in range(T):
                dsp = softplus(float(at(ddt, h, t, q)))
                dA_ = math.exp(dsp * float(at(dA, 0, h)))
                for i1 in range(head_dim):
                    xdt = float(at(dx, i1, h, t, q)) * dsp
                    yv = 0.0
                    for i0 in range(d_state):
                        st[i1][i0] = st[i1][i0] * dA_ + float(at(dB, i0, g, t, q)) * xdt
                        yv += st[i1][i0] * float(at(dC, i0, g, t, q))
                    assert out[i1 + head_dim * (h + n_head * (t + T * q))] == pytest.approx(yv, rel=1e-4, abs=1e-5)
                slot = T - 1 - t
                if slot < K:
                    for i1, i0 in itertools.product(range(head_dim), range(d_state)):
                        k = n_x + (slot * n_seqs + q) * D + h * d_state * head_dim + i1 * d_state + i0
                        assert out[k] == pytest.approx(st[i1][i0], rel=1e-4, abs=1e-5)
    # the initial states are only read
    np.testing.assert_array_equal(got(s), data[s])


@pytest.mark.parametrize("T,K,kda,H_k,nsqk", [(4, 3, False, 2, 2), (2, 4, True, 2, 1), (3, 1, False, 4, 2),
                                              (5, 5, True, 1, 2)])
def test_gated_delta_net_snapshots(T, K, kda, H_k, nsqk):
    rng = np.random.default_rng(50 + T + 7 * K)
    S, H, ns = 3, 4, 2
    ctx = mg.Context()
    q = ctx.new_tensor_4d(mg.f32, S, H_k, T, nsqk)
    k = ctx.new_tensor_4d(mg.f32, S, H_k, T, nsqk)
    v = ctx.new_tensor_4d(mg.f32, S, H, T, ns)
    g = ctx.new_tensor_4d(mg.f32, S if kda else 1, H, T, ns)
    beta = ctx.new_tensor_4d(mg.f32, 1, H, T, ns)
    state = ctx.new_tensor_4d(mg.f32, S, S, H, ns)
    data = {q: rand(rng, mg.f32, q.ne, -0.6, 0.6), k: rand(rng, mg.f32, k.ne, -0.6, 0.6),
            v: rand(rng, mg.f32, v.ne),
            g: -rng.uniform(0.05, 1.0, shape4(g.ne)).astype(np.float32),
            beta: rng.uniform(0.1, 0.9, shape4(beta.ne)).astype(np.float32),
            state: rand(rng, mg.f32, state.ne, -0.5, 0.5)}
    out = mg.gated_delta_net(q, k, v, g, beta, state, K)
    assert out.ne == (S * H, T * ns + K * S * ns, 1, 1)
    compute(ctx, [out], data)
    o = out.numpy().reshape(-1)
    dq, dk, dv, dg, dbeta, dst = (data[t] for t in (q, k, v, g, beta, state))
    scale = 1.0 / math.sqrt(S)
    D = S * S * H
    n_o = S * H * T * ns
    for sq in range(ns):
        sqk = sq // (ns // nsqk)
        for h in range(H):
            hk = h % H_k
            M = [[float(at(dst, i, j, h, sq)) for i in range(S)] for j in range(S)]   # M[j][i]
            for t in range(T):
                for j in range(S):
                    for i in range(S):
                        gi = at(dg, i if kda else 0, h, t, sq)
                        M[j][i] *= math.exp(float(gi))
                kt = [float(at(dk, i, hk, t, sqk)) for i in range(S)]
                qt = [float(at(dq, i, hk, t, sqk)) for i in range(S)]
                bt = float(at(dbeta, 0, h, t, sq))
                delta = [(float(at(dv, j, h, t, sq)) - sum(M[j][i] * kt[i] for i in range(S))) * bt for j in range(S)]
                for j in range(S):
                    for i in range(S):
                        M[j][i] += kt[i] * delta[j]
                for j in range(S):
                    oj = scale * sum(M[j][i] * qt[i] for i in range(S))
                    assert o[j + S * (h + H * (t + T * sq))] == pytest.approx(oj, rel=1e-4, abs=1e-5)
                slot = T - 1 - t
                if slot < K:
                    base = n_o + slot * D * ns + (sq * H + h) * S * S
                    for j in range(S):
                        for i in range(S):
                            assert o[base + j * S + i] == pytest.approx(M[j][i], rel=1e-4, abs=1e-5)


def test_ssm_state_store_leaves_slots_ge_T_untouched():
    """Mamba-2 state store: n_written = min(T, K) snapshots are copied into the
    cache rows j*mem_size + head + q; older slots keep their stale contents."""
    rng = np.random.default_rng(60)
    d_state, head_dim, n_head, n_seqs, T, K, mem_size, head = 2, 2, 2, 2, 2, 4, 4, 1
    D = d_state * head_dim * n_head
    ctx = mg.Context()
    cache = ctx.new_tensor_2d(mg.f32, D, mem_size * K)
    x = ctx.new_tensor_4d(mg.f32, head_dim, n_head, T, n_seqs)
    dt = ctx.new_tensor_3d(mg.f32, n_head, T, n_seqs)
    A = ctx.new_tensor_2d(mg.f32, 1, n_head)
    B = ctx.new_tensor_4d(mg.f32, d_state, 1, T, n_seqs)
    C = ctx.new_tensor_4d(mg.f32, d_state, 1, T, n_seqs)
    ids = ctx.new_tensor_1d(mg.i32, n_seqs)
    states = mg.reshape_4d(cache, d_state, head_dim, n_head, mem_size * K)
    y = mg.ssm_scan(states, x, dt, A, B, C, ids, K)
    n_x = x.nelements()
    n_written = min(T, K)
    src = mg.view_3d(y, D, n_seqs, n_written, D * 4, D * 4 * n_seqs, n_x * 4)
    dstv = mg.view_3d(cache, D, n_seqs, n_written, cache.nb[1], mem_size * cache.nb[1], head * cache.nb[1])
    st = mg.cpy(src, dstv)
    dcache = rand(rng, mg.f32, cache.ne)
    feeds = {cache: dcache, x: rand(rng, mg.f32, x.ne), dt: rand(rng, mg.f32, dt.ne),
             A: -rng.uniform(0.1, 1, shape4(A.ne)).astype(np.float32), B: rand(rng, mg.f32, B.ne),
             C: rand(rng, mg.f32, C.ne), ids: np.array([1, 2], np.int32)}
    compute(ctx, [y, st], feeds)
    yy = y.numpy()
    after = got(cache)
    for r in range(mem_size * K):
        j, cell = divmod(r, mem_size)
        qq = cell - head
        if j < n_written and 0 <= qq < n_seqs:
            off = n_x + (j * n_seqs + qq) * D
            np.testing.assert_array_equal(after[0, 0, r], yy[off:off + D])
        else:
            np.testing.assert_array_equal(after[0, 0, r], dcache[0, 0, r])


# ----------------------------------------------------------------------------------------------
# the conv-state store with rollback slots
# ----------------------------------------------------------------------------------------------
def build_conv_state_store(ctx, s, conv_x, n_cols, offs, head, mem_size, K):
    """The graph of build_conv_state_store with n_rs_seq = K-1 > 0."""
    elt = 4
    n = conv_x.ne[0] - n_cols
    channels, n_seqs = conv_x.ne[1], conv_x.ne[2]
    row_size = s.nb[1]
    cell_offs = head * row_size + offs
    Kw = min(n, K)
    s_slot_rev = mg.cast(mg.scale_bias(mg.arange(ctx, 0, K, 1), -1, K - 1), mg.i32).set_name("s_slot_rev")
    slot_order = mg.view_1d(s_slot_rev, Kw, (K - Kw) * 4)
    windows = mg.view_4d(conv_x, n_cols, Kw, channels, n_seqs, elt, conv_x.nb[1], conv_x.nb[2], (n - (Kw - 1)) * elt)
    slots = mg.view_4d(s, n_cols, K, channels, n_seqs, mem_size * row_size, n_cols * elt, row_size, cell_offs)
    assert slots.is_permuted() and not windows.is_permuted()
    return mg.set_rows(slots, windows, slot_order), s_slot_rev, slot_order


def conv_store_step(rng, cache, n, n_cols, channels, n_seqs, part, head, mem_size, K):
    """Build conv_x = concat(prev, transpose(x), 0) in a fresh context, store it, return
    (conv_x as a 4-D array, slot order values, s_slot_rev values)."""
    ctx = mg.Context()
    prev = ctx.new_tensor_3d(mg.f32, n_cols, channels, n_seqs)
    x = ctx.new_tensor_3d(mg.f32, channels, n, n_seqs)
    conv_x = mg.concat(prev, mg.transpose(x), 0)
    assert conv_x.ne == (n_cols + n, channels, n_seqs, 1)
    offs = part * n_cols * channels * 4
    store, rev, order = build_conv_state_store(ctx, cache, conv_x, n_cols, offs, head, mem_size, K)
    gf = mg.Graph()
    gf.build_forward_expand(store)
    gf.build_forward_expand(order)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    dprev, dx = rand(rng, mg.f32, prev.ne), rand(rng, mg.f32, x.ne)
    prev.set(dprev)
    x.set(dx)
    be.graph_compute(gf)
    cx = np.empty(shape4(conv_x.ne), np.float32)
    for col, ch, q, _ in indices(conv_x.ne):
        put(cx, at(dprev, col, ch, q) if col < n_cols else at(dx, ch, col - n_cols, q), col, ch, q)
    return cx, order.numpy().tolist(), rev.numpy().tolist()


@pytest.mark.parametrize("n_cols,K,n,channels,n_seqs,part,head,mem_size", [
    (3, 3, 5, 2, 2, 1, 1, 4),       # n=5 into K=3 slots: windows at columns 3, 4, 5 -> slots 2, 1, 0
    (3, 3, 1, 2, 2, 2, 2, 4),       # decode: Kw = 1, slot 0 only
    (2, 4, 2, 3, 1, 0, 3, 5),       # Kw = 2 < K
    (3, 4, 4, 2, 2, 2, 1, 3),       # the window view the contiguous-size check would reject
])
def test_conv_state_store_seed000(n_cols, K, n, channels, n_seqs, part, head, mem_size):
    rng = np.random.default_rng(70 + n + K)
    n_embd_r = 3 * n_cols * channels                      # three parts per row (KDA layout)
    ctx = mg.Context()
    cache = ctx.new_tensor_2d(mg.f32, n_embd_r, mem_size * K)
    mg.alloc_ctx_tensors(ctx, mg.backend("ref"))
    dcache = rand(rng, mg.f32, cache.ne)
    cache.set(dcache)
    before = root_bytes(cache).tobytes()
    cx, order, rev = conv_store_step(rng, cache, n, n_cols, channels, n_seqs, part, head, mem_size, K)
    Kw = min(n, K)
    assert rev == list(range(K - 1, -1, -1))
    assert order == list(range(Kw - 1, -1, -1))
    # expected cache, byte by byte: slot j (< Kw) of cell head+q, part offset, channel-major taps
    exp = bytearray(before)
    row_size = n_embd_r * 4
    offs = part * n_cols * channels * 4
    for j in range(Kw):
        for q in range(n_seqs):
            for ch in range(channels):
                for c in range(n_cols):
                    addr = (j * mem_size + head + q) * row_size + offs + (ch * n_cols + c) * 4
                    exp[addr:addr + 4] = np.float32(at(cx, n - j + c, ch, q)).tobytes()
    assert root_bytes(cache).tobytes() == bytes(exp)
    if (n_cols, K, n) == (3, 3, 5):
        # windows start at columns 3, 4, 5 -> slots 2, 1, 0
        after = got(cache)
        for slot, first in ((2, 3), (1, 4), (0, 5)):
            for q, ch in itertools.product(range(n_seqs), range(channels)):
                r = slot * mem_size + head + q
                e0 = offs // 4 + ch * n_cols
                np.testing.assert_array_equal(after[0, 0, r, e0:e0 + 3], cx[0, q, ch, first:first + 3])
    if n == 1:
        after = got(cache)
        for q, ch in itertools.product(range(n_seqs), range(channels)):
            e0 = offs // 4 + ch * n_cols
            np.testing.assert_array_equal(after[0, 0, head + q, e0:e0 + 3], cx[0, q, ch, 1:4])


def test_conv_state_store_prefill_then_decode_keeps_stale_slots():
    rng = np.random.default_rng(80)
    n_cols, K, channels, n_seqs, head, mem_size = 3, 3, 2, 1, 1, 2
    n_embd_r = n_cols * channels
    ctx = mg.Context()
    cache = ctx.new_tensor_2d(mg.f32, n_embd_r, mem_size * K)
    mg.alloc_ctx_tensors(ctx, mg.backend("ref"))
    cache.set(rand(rng, mg.f32, cache.ne))
    conv_store_step(rng, cache, 5, n_cols, channels, n_seqs, 0, head, mem_size, K)
    after_prefill = got(cache).copy()
    cx, order, _ = conv_store_step(rng, cache, 1, n_cols, channels, n_seqs, 0, head, mem_size, K)
    assert order == [0]
    after = got(cache)
    for r in range(mem_size * K):
        if r == head:                                      # slot 0 of the cell
            for ch, c in itertools.product(range(channels), range(n_cols)):
                assert after[0, 0, r, ch * n_cols + c] == at(cx, 1 + c, ch, 0)
        else:                                              # slots 1, 2 and other cells: stale
            np.testing.assert_array_equal(after[0, 0, r], after_prefill[0, 0, r])


# ----------------------------------------------------------------------------------------------
# tensor helpers
# ----------------------------------------------------------------------------------------------
def test_nelements_nbytes():
    ctx = mg.Context()
    a = ctx.new_tensor_3d(mg.f16, 5, 4, 3)
    assert a.nelements() == 60 and a.nbytes() == 120
    assert a.nb == (2, 10, 40, 120)
    win = mg.view_2d(a, 4, 6, 2, 6)                        # overlapping: nb1 == element size
    assert win.nelements() == 24
    assert win.nbytes() == 2 + 3 * 2 + 5 * 2               # true extent, not 24*2
    gaps = mg.view_3d(a, 2, 2, 2, 20, 80, 0)
    assert gaps.nbytes() == 2 + 1 * 2 + 1 * 20 + 1 * 80
    assert ctx.new_tensor_1d(mg.i64, 7).nbytes() == 56
    assert ctx.new_tensor_2d(mg.f32, 0, 3).nbytes() == 0


def test_is_contiguous_rules():
    ctx = mg.Context()
    a = ctx.new_tensor_3d(mg.f32, 4, 3, 2)
    assert a.is_contiguous() and a.is_contiguous_rows() and not a.is_permuted() and not a.is_transposed()
    # ne0 == 1: any nb0 is fine (ggml checks nb0 only when ne0 != block size)
    t = mg.Tensor(None, mg.f32, (1, 4), (100, 4, 16, 16))
    assert t.is_contiguous() and t.is_contiguous_rows()
    # dims with ne == 1 have free strides
    t = mg.Tensor(None, mg.f32, (4, 1, 3), (4, 999, 16, 48))
    assert t.is_contiguous()
    t = mg.Tensor(None, mg.f32, (4, 2, 3), (4, 20, 40, 120))          # padded rows
    assert not t.is_contiguous() and t.is_contiguous_rows() and t.is_contiguous_1()
    t = mg.Tensor(None, mg.f32, (4, 2), (8, 32, 64, 64))
    assert not t.is_contiguous_rows() and not t.is_contiguous()
    assert mg.view_2d(a, 4, 6, 16, 0).is_contiguous()
    assert not mg.view_2d(a, 2, 6, 16, 0).is_contiguous()
    assert not mg.transpose(a).is_contiguous()
    assert mg.cont(mg.transpose(a)).is_contiguous()


def test_is_permuted_is_transposed_strict():
    ctx = mg.Context()
    a = ctx.new_tensor_2d(mg.f32, 10, 3)
    win = mg.view_3d(a, 4, 5, 3, 4, 40, 0)                 # nb0 == nb1: not permuted
    assert win.nb[0] == win.nb[1] and not win.is_permuted() and not win.is_transposed()
    t = mg.transpose(a)
    assert t.is_transposed() and t.is_permuted()
    p = mg.permute(ctx.new_tensor_3d(mg.f32, 2, 3, 4), 0, 2, 1, 3)
    assert p.is_permuted() and not p.is_transposed()
    slots = mg.view_4d(ctx.new_tensor_2d(mg.f32, 6, 12), 3, 3, 2, 2, 4 * 24, 12, 24, 24)
    assert slots.is_permuted() and not slots.is_transposed()
    # equal strides in higher dims (ne == 1 views) are not permuted either
    assert not mg.view_1d(a, 5, 0).is_permuted()


def test_shape_is_numpy_order():
    ctx = mg.Context()
    assert ctx.new_tensor_4d(mg.f32, 3, 1, 2, 1).shape == (2, 1, 3)
    assert ctx.new_tensor_4d(mg.f32, 3, 1, 1, 1).shape == (3,)
    assert ctx.new_tensor_4d(mg.f32, 1, 1, 1, 1).shape == (1,)
    assert ctx.new_tensor_4d(mg.f32, 2, 3, 4, 5).shape == (5, 4, 3, 2)
    a = ctx.new_tensor_3d(mg.f32, 2, 3, 4)
    mg.alloc_ctx_tensors(ctx, mg.backend("ref"))
    d = np.arange(24, dtype=np.float32).reshape(4, 3, 2) + 1
    a.set(d)
    assert a.numpy().shape == (4, 3, 2)
    np.testing.assert_array_equal(a.numpy(), d)
    assert at(got(a), 1, 2, 3) == d[3, 2, 1]


def test_set_checks_dtype_and_shape():
    ctx = mg.Context()
    a = ctx.new_tensor_2d(mg.f32, 4, 3).set_name("w")
    mg.alloc_ctx_tensors(ctx, mg.backend("ref"))
    with pytest.raises(mg.OpError, match="'w'"):
        a.set(np.ones((3, 4), np.float64))
    with pytest.raises(mg.OpError, match="'w'"):
        a.set(np.ones((4, 3), np.float32))
    with pytest.raises(mg.OpError, match="'w'"):
        a.set(np.ones((12,), np.float32))
    a.set(np.full((1, 3, 4), 2.5, np.float32))             # leading unit dims are fine
    assert np.all(a.numpy() == 2.5)


# ----------------------------------------------------------------------------------------------
# graph
# ----------------------------------------------------------------------------------------------
def small_graph():
    ctx = mg.Context()
    x = ctx.new_tensor_2d(mg.f32, 4, 3).set_name("x").set_input()
    w = ctx.new_tensor_2d(mg.f32, 4, 5).set_name("w").set_weight()
    cache = ctx.new_tensor_2d(mg.f32, 5, 6).set_name("cache")
    idx = ctx.new_tensor_1d(mg.i32, 3).set_name("idx")
    h = mg.mul_mat(w, x).set_name("h")                    # [5, 3]
    hs = mg.silu(h).set_name("hs")
    ht = mg.transpose(hs).set_name("ht")
    hc = mg.cont(ht).set_name("hc")
    st = mg.set_rows(cache, hs, idx).set_name("store")
    out = mg.add(hc, mg.view_2d(cache, 3, 5, 20, 0).set_name("cv")).set_name("out")
    return ctx, dict(x=x, w=w, cache=cache, idx=idx, h=h, hs=hs, ht=ht, hc=hc, st=st, out=out)


def test_graph_nodes_in_dependency_order_and_leafs():
    ctx, t = small_graph()
    gf = mg.Graph()
    gf.build_forward_expand(t["st"])
    gf.build_forward_expand(t["out"])
    gf.build_forward_expand(t["out"])                     # idempotent
    pos = {n.id: i for i, n in enumerate(gf.nodes)}
    leaf_ids = {l.id for l in gf.leafs}
    assert leaf_ids == {t[k].id for k in ("x", "w", "cache", "idx")}
    assert all(l.op == "NONE" for l in gf.leafs)
    assert len(gf.nodes) == len({n.id for n in gf.nodes}) == len(gf)
    assert {n.id for n in gf.nodes} == {t[k].id for k in ("h", "hs", "ht", "hc", "st", "out")} | {
        t["out"].srcs["b"].id}
    for n in gf.nodes:
        for s in list(n.srcs.values()) + ([n.view_src] if n.view_src is not None else []):
            assert s.id in leaf_ids or pos[s.id] < pos[n.id]
    assert pos[t["st"].id] < pos[t["out"].id]             # the first expanded root comes first


def test_graph_dump_text():
    ctx, t = small_graph()
    gf = mg.Graph().build_forward_expand(t["out"])
    text = gf.dump()
    assert text.startswith(f"graph: {len(gf.nodes)} nodes, {len(gf.leafs)} leafs")
    for name in ("MUL_MAT", "SILU", "TRANSPOSE", "CONT", "ADD", "'h'", "'out'", "'w'", "'x'", "(view)"):
        assert name in text
    assert str(gf) == text
    assert len(text.splitlines()) == 1 + len(gf.nodes) + len(gf.leafs)


def test_graph_to_networkx_attributes():
    ctx, t = small_graph()
    gf = mg.Graph()
    gf.build_forward_expand(t["st"])
    gf.build_forward_expand(t["out"])
    g = gf.to_networkx()
    assert set(g.nodes) == {n.id for n in gf.nodes + gf.leafs}
    for tt in gf.nodes + gf.leafs:
        a = g.nodes[tt.id]
        for key in ("op", "name", "type", "ne", "nb", "is_view", "view_src", "view_offs"):
            assert key in a
        assert a["op"] == tt.op and a["name"] == tt.name and a["type"] == tt.type.name
        assert a["ne"] == list(tt.ne) and a["nb"] == list(tt.nb)
        assert a["is_view"] == (tt.view_src is not None)
        assert a["view_src"] == (tt.view_src.id if tt.view_src is not None else None)
        assert a["view_offs"] == tt.view_offs
    assert g.nodes[t["st"].id]["view_src"] == t["cache"].id
    assert g.nodes[t["ht"].id]["is_view"] and g.nodes[t["ht"].id]["op"] == "TRANSPOSE"
    assert g.has_edge(t["w"].id, t["h"].id) and g.edges[t["w"].id, t["h"].id]["role"] == "a"
    assert g.has_edge(t["x"].id, t["h"].id) and g.edges[t["x"].id, t["h"].id]["role"] == "b"
    assert g.has_edge(t["cache"].id, t["st"].id)
    import networkx as nx
    assert nx.is_directed_acyclic_graph(g)


def test_small_graph_computes():
    rng = np.random.default_rng(90)
    ctx, t = small_graph()
    feeds = {t["x"]: rand(rng, mg.f32, t["x"].ne), t["w"]: rand(rng, mg.f32, t["w"].ne),
             t["cache"]: rand(rng, mg.f32, t["cache"].ne), t["idx"]: np.array([5, 0, 2], np.int32)}
    cache0 = feeds[t["cache"]].copy()
    compute(ctx, [t["st"], t["out"]], feeds)
    dx, dw = feeds[t["x"]], feeds[t["w"]]
    hs = np.empty((1, 1, 3, 5))
    for m, n, _, _ in indices((5, 3)):
        hv = sum(float(at(dw, k, m)) * float(at(dx, k, n)) for k in range(4))
        put(hs, hv / (1 + math.exp(-hv)), m, n)
    cache_exp = cache0.astype(np.float64)
    for i, r in enumerate([5, 0, 2]):
        for i0 in range(5):
            put(cache_exp, at(hs, i0, i), i0, r)
    np.testing.assert_allclose(got(t["cache"]), cache_exp, rtol=1e-5, atol=1e-6)
    # out = transpose(hs) + view of the cache: the view is read in node order (after the store)
    o = got(t["out"])
    for i0, i1, _, _ in indices(t["out"].ne):
        assert at(o, i0, i1) == pytest.approx(at(hs, i1, i0) + float(at(got(t["cache"]), i0, i1)), rel=1e-5, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# allocator and repeated computes
# ----------------------------------------------------------------------------------------------
def chain(ctx, x, n=50, out_at=()):
    outs = {}
    y = x
    for i in range(n):
        y = [mg.scale(y, 1.01), mg.silu(y), mg.add(y, x), mg.neg(y)][i % 4].set_name(f"y{i}")
        if i in out_at:
            y.set_output()
            outs[i] = y
    return y, outs


def chain_expect(dx, n):
    xs = dx.astype(np.float32)
    y = xs
    vals = []
    for i in range(n):
        k = i % 4
        if k == 0:
            y = (y * np.float32(1.01)).astype(np.float32)
        elif k == 1:
            y = (y / (np.float32(1) + np.exp(-y))).astype(np.float32)
        elif k == 2:
            y = (y + xs).astype(np.float32)
        else:
            y = -y
        vals.append(y)
    return vals


def test_allocator_reuses_memory_in_a_long_chain():
    rng = np.random.default_rng(100)
    ctx = mg.Context()
    x = ctx.new_tensor_2d(mg.f32, 64, 16)
    y, _ = chain(ctx, x, 50)
    gf = mg.Graph().build_forward_expand(y)
    plan = plan_graph(gf.nodes)
    one = x.nbytes()
    assert plan.naive_size >= 50 * one
    assert plan.size <= 3 * one                            # far below the sum of intermediates
    be = type(mg.backend("ref"))()
    mg.alloc_ctx_tensors(ctx, be)
    dx = rand(rng, mg.f32, x.ne)
    x.set(dx)
    size = be.graph_compute(gf)
    assert size == plan.size
    np.testing.assert_allclose(got(y), chain_expect(dx, 50)[-1], rtol=1e-5, atol=1e-6)


def test_outputs_are_never_overwritten():
    rng = np.random.default_rng(101)
    ctx = mg.Context()
    x = ctx.new_tensor_2d(mg.f32, 32, 8)
    y, outs = chain(ctx, x, 50, out_at=(9, 22, 37))
    gf = mg.Graph().build_forward_expand(y)
    be = type(mg.backend("ref"))()
    mg.alloc_ctx_tensors(ctx, be)
    dx = rand(rng, mg.f32, x.ne)
    x.set(dx)
    be.graph_compute(gf)
    exp = chain_expect(dx, 50)
    for i, t in outs.items():
        np.testing.assert_allclose(got(t), exp[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got(y), exp[-1], rtol=1e-5, atol=1e-6)
    # and by construction: no tensor placed after an output overlaps it
    plan = gf.cache[("alloc", be.name)][0]
    for i, t in outs.items():
        o0, o1 = plan.offsets[t.id], plan.offsets[t.id] + t.nbytes()
        later = plan.tensors[plan.tensors.index(t) + 1:]
        for u in later:
            u0, u1 = plan.offsets[u.id], plan.offsets[u.id] + u.nbytes()
            assert u1 <= o0 or u0 >= o1


def test_guard_bytes_stay_intact():
    rng = np.random.default_rng(102)
    ctx = mg.Context()
    x = ctx.new_tensor_3d(mg.f32, 5, 3, 2)
    idx = ctx.new_tensor_1d(mg.i64, 2)
    y, _ = chain(ctx, x, 12)
    t = mg.cont(mg.transpose(y))
    z = ctx.new_tensor_2d(mg.f32, 3, 5)                    # a leaf destination
    tmp = mg.mul(mg.concat(t, t, 1), mg.scale(mg.concat(t, t, 1), 0.5))
    r = mg.get_rows(tmp, ctx.new_tensor_2d(mg.i32, 2, 2))
    mid = mg.cont(mg.view_3d(y, 3, 3, 2, 20, 60, 8))
    buf = mg.scale(mid, 2.0)
    st = mg.set_rows(buf, mg.view_3d(mid, 3, 2, 2, 20, 36, 0), idx)   # write-through into an intermediate
    c = mg.cpy(mg.view_1d(st, 15, 0), z)
    be = type(mg.backend("ref"))()
    be.guard = 64
    gf = mg.Graph()
    for o in (r, c, st):
        gf.build_forward_expand(o)
    mg.alloc_ctx_tensors(ctx, be)
    x.set(rand(rng, mg.f32, x.ne))
    idx.set(np.array([2, 0], np.int64))
    r.srcs["b"].set(np.array([[1, 4], [0, 9]], np.int32))
    z.set(rand(rng, mg.f32, z.ne))
    be.graph_compute(gf)
    assert be.guards_intact(gf)
    be.graph_compute(gf)
    assert be.guards_intact(gf)


def test_recompute_after_new_inputs_and_weights_persist():
    rng = np.random.default_rng(103)
    ctx = mg.Context()
    w = ctx.new_tensor_2d(mg.f32, 4, 3).set_weight()
    x = ctx.new_tensor_2d(mg.f32, 4, 2).set_input()
    out = mg.mul_mat(w, x)
    gf = mg.Graph().build_forward_expand(out)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    dw = rand(rng, mg.f32, w.ne)
    w.set(dw)
    for step in range(3):
        dx = rand(rng, mg.f32, x.ne)
        x.set(dx)
        be.graph_compute(gf)
        for m, n, _, _ in indices(out.ne):
            exp = sum(float(at(dw, k, m)) * float(at(dx, k, n)) for k in range(4))
            assert at(got(out), m, n) == pytest.approx(exp, rel=1e-5)
        np.testing.assert_array_equal(got(w), dw)


def test_recompute_after_a_compute_that_raised():
    rng = np.random.default_rng(104)
    ctx = mg.Context()
    dst = ctx.new_tensor_2d(mg.f32, 3, 4)
    b = ctx.new_tensor_2d(mg.f32, 3, 2)
    c = ctx.new_tensor_1d(mg.i32, 2)
    st = mg.set_rows(dst, b, c).set_name("st")
    out = mg.scale(st, 2.0)
    gf = mg.Graph().build_forward_expand(out)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    ddst, db = rand(rng, mg.f32, dst.ne), rand(rng, mg.f32, b.ne)
    dst.set(ddst)
    b.set(db)
    c.set(np.array([1, 4], np.int32))
    with pytest.raises(mg.OpError, match="SET_ROWS"):
        be.graph_compute(gf)
    np.testing.assert_array_equal(got(dst), ddst)
    c.set(np.array([1, 3], np.int32))
    be.graph_compute(gf)
    exp = ddst.copy()
    exp[0, 0, 1], exp[0, 0, 3] = db[0, 0, 0], db[0, 0, 1]
    np.testing.assert_array_equal(got(dst), exp)
    np.testing.assert_array_equal(got(out), exp * np.float32(2))


# ----------------------------------------------------------------------------------------------
# reading intermediates after a compute; bad input to the core
# ----------------------------------------------------------------------------------------------
def scale_chain(be):
    ctx = mg.Context()
    a = ctx.new_tensor_2d(mg.f32, 8, 4)
    mg.alloc_ctx_tensors(ctx, be)
    a.set(np.ones((4, 8), np.float32))
    h1 = mg.scale(a, 2.0)
    h2 = mg.silu(h1)
    h3 = mg.scale(h2, 3.0)
    out = mg.sum_rows(mg.exp(h3))
    return ctx, h1, h2, h3, out, mg.Graph().build_forward_expand(out)


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_reading_an_intermediate_whose_memory_was_reused_raises(device):
    be = mg.backend(device)
    _, h1, h2, h3, out, gf = scale_chain(be)
    be.graph_compute(gf)
    with pytest.raises(mg.OpError, match=r"memory was reused by .* call set_output\(\) on"):
        h1.numpy()
    with pytest.raises(mg.OpError, match="memory was reused"):
        mg.view_1d(h1, 4, 0).numpy()                     # a view reads the same bytes
    np.testing.assert_allclose(out.numpy(), np.full((4, 1), 8 * np.exp(3 * 2 / (1 + np.exp(-2)))), rtol=1e-5)


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_set_output_keeps_an_intermediate_even_after_a_first_compute(device):
    be = mg.backend(device)
    _, h1, h2, h3, out, gf = scale_chain(be)
    be.graph_compute(gf)
    h1.set_output()                                       # flagged late: the graph plans again
    be.graph_compute(gf)
    np.testing.assert_array_equal(h1.numpy(), np.full((4, 8), 2.0, np.float32))
    _, g1, _, _, _, gf2 = scale_chain(be)
    g1.set_output()
    be.graph_compute(gf2)
    np.testing.assert_array_equal(g1.numpy(), np.full((4, 8), 2.0, np.float32))


def test_plan_marks_exactly_the_intermediates_given_away():
    ctx = mg.Context()
    x = ctx.new_tensor_2d(mg.f32, 64, 16)
    y, _ = chain(ctx, x, 12)
    gf = mg.Graph().build_forward_expand(y)
    plan = plan_graph(gf.nodes)
    for t in plan.tensors:
        o0, o1 = plan.offsets[t.id], plan.offsets[t.id] + t.nbytes()
        later = plan.tensors[plan.tensors.index(t) + 1:]
        overlapped = [u for u in later if plan.offsets[u.id] < o1 and o0 < plan.offsets[u.id] + u.nbytes()]
        if overlapped:
            assert plan.overwritten[t.id]() is overlapped[0]
        else:
            assert t.id not in plan.overwritten
    assert plan.overwritten and y.id not in plan.overwritten


@pytest.mark.parametrize("given", ["f32", "F32", mg.f32, np.float32, np.dtype("float32")])
def test_tensor_types_by_ggml_name_or_numpy_dtype(given):
    t = mg.Context().new_tensor_2d(given, 4, 3)
    assert t.type is mg.f32 and t.nb == (4, 16, 48, 48)


@pytest.mark.parametrize("given, error, text", [
    ("q5_1", ValueError, "type: unknown type name 'q5_1'; valid types are mg.f32, mg.f16, mg.i32, mg.i64, mg.bf16, mg.q8_0"),
    (np.float64, TypeError, "type: NumPy dtype float64 is not a minigraph type; valid types are mg.f32"),
    (None, TypeError, "type: NoneType None is not a minigraph type"),
    (4, TypeError, "type: int 4 is not a minigraph type"),
])
def test_bad_tensor_types_name_the_argument_and_the_valid_types(given, error, text):
    with pytest.raises(error) as e:
        mg.Context().new_tensor_2d(given, 4, 3)
    assert str(e.value).startswith(text) and "\n" not in str(e.value)


@pytest.mark.parametrize("ne, text", [((4.5, 3), "ne must hold integers, got 4.5 (float)"),
                                      ((True, 3), "ne must hold integers, got True (bool)"),
                                      ((), "a tensor has 1 to 4 dims"), ((-1,), "negative extent")])
def test_bad_extents_raise_one_line_op_errors(ne, text):
    with pytest.raises(mg.OpError, match=re.escape(text)):
        mg.Context().new_tensor(mg.f32, ne)


def test_build_forward_expand_names_a_non_tensor_argument():
    with pytest.raises(TypeError, match=r"^build_forward_expand: tensor must be a minigraph Tensor, got numpy.ndarray$"):
        mg.Graph().build_forward_expand(np.zeros(3))


def test_nodes_join_no_context_and_the_graph_version_counts_growth():
    ctx = mg.Context()
    w = ctx.new_tensor_1d(mg.f32, 4)
    y = mg.silu(w)
    assert y.ctx is None and ctx.tensors == [w]
    gf = mg.Graph()
    assert gf.version == 0
    gf.build_forward_expand(y)
    assert gf.version == 1
    gf.build_forward_expand(y)                            # nothing new: same version
    assert gf.version == 1
    gf.build_forward_expand(mg.exp(y))
    assert gf.version == 2
