"""Property tests (hypothesis) for views, set_rows/get_rows broadcasting and cpy between strided
views. Expectations come from loops over byte addresses."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import minigraph as mg

TYPES = [mg.f32, mg.f16, mg.i32]


def pad(t, fill=1):
    t = tuple(int(x) for x in t)
    return t + (fill,) * (4 - len(t))


def indices(ne):
    ne = pad(ne)
    for i3 in range(ne[3]):
        for i2 in range(ne[2]):
            for i1 in range(ne[1]):
                for i0 in range(ne[0]):
                    yield i0, i1, i2, i3


def rand_bytes(rng, type, n):
    """n elements of random, never-zero data of ``type`` as a flat array."""
    if type.is_float:
        x = rng.uniform(-4, 4, n)
        return np.where(np.abs(x) < 1e-2, 1.5, x).astype(type.np_dtype)
    return (rng.integers(1, 1000, n) * rng.choice([-1, 1], n)).astype(type.np_dtype)


def leaf_with_data(ctx, rng, type, ne):
    t = ctx.new_tensor(type, ne)
    data = rand_bytes(rng, type, t.nelements()).reshape(tuple(reversed(t.ne)))
    return t, data


def loop_read(raw: bytes, type, ne, nb, offset):
    out = np.empty(tuple(reversed(pad(ne))), type.np_dtype)
    for i0, i1, i2, i3 in indices(ne):
        addr = offset + i0 * nb[0] + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]
        out[i3, i2, i1, i0] = np.frombuffer(raw, type.np_dtype, 1, addr)[0]
    return out


# ----------------------------------------------------------------------------------------------
# random views: refused exactly when the true strided extent passes the end, else exact reads
# ----------------------------------------------------------------------------------------------
@st.composite
def view_cases(draw):
    type = draw(st.sampled_from(TYPES))
    es = type.size
    base_ne = tuple(draw(st.integers(1, 5)) for _ in range(draw(st.integers(1, 3))))
    base_n = int(np.prod(base_ne))
    ndim = draw(st.integers(1, 4))
    ne = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    # strides (in elements) for dims 1..ndim-1: overlapping (1, or below the row), gaps, anything
    nb_el = tuple(draw(st.sampled_from([1, 2]) | st.integers(0, base_n)) for _ in range(ndim - 1))
    offset_el = draw(st.integers(0, base_n // 2) | st.integers(0, base_n))
    # an optional first view to view through (views of views collapse onto the root)
    pre = draw(st.none() | st.integers(0, base_n - 1))
    seed = draw(st.integers(0, 2**32 - 1))
    return type, base_ne, ne, tuple(x * es for x in nb_el), offset_el * es, (None if pre is None else pre * es), seed


def make_view(src, ne, nb_given, offset):
    n = len(ne)
    if n == 1:
        return mg.view_1d(src, ne[0], offset)
    if n == 2:
        return mg.view_2d(src, ne[0], ne[1], nb_given[0], offset)
    if n == 3:
        return mg.view_3d(src, *ne, *nb_given, offset)
    return mg.view_4d(src, *ne, *nb_given, offset)


@given(view_cases())
def test_random_views(case):
    type, base_ne, ne, nb_given, offset, pre, seed = case
    rng = np.random.default_rng(seed)
    ctx = mg.Context()
    base, data = leaf_with_data(ctx, rng, type, base_ne)
    es = type.size
    src, pre_offs = base, 0
    if pre is not None:
        src = mg.view_1d(base, (base.nbytes() - pre) // es, pre)
        pre_offs = pre
    # ggml's view_Nd strides: nb0 = type size, the unspecified higher ones nb[N-1]*ne[N-1]
    nb = [es] + list(nb_given)
    ne4 = pad(ne)
    for i in range(len(ne), 4):
        nb.append(nb[i - 1] * ne4[i - 1])
    start = pre_offs + offset
    end = start + es + sum((n - 1) * b for n, b in zip(ne4, nb))
    overlapping = any(0 < b < es * n_prev for b, n_prev in zip(nb[1:], ne4[:3]))
    event("overlapping strides" if overlapping else "non-overlapping strides")
    if end > base.nbytes():
        event("refused: past the end")
        with pytest.raises(mg.OpError, match="VIEW"):
            make_view(src, ne, nb_given, offset)
        return
    event("accepted")
    v = make_view(src, ne, nb_given, offset)
    assert v.view_src is base and v.view_offs == start
    assert v.ne == ne4 and v.nb == tuple(nb)
    assert v.nbytes() == end - start
    c = mg.cont(v)
    gf = mg.Graph().build_forward_expand(c)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    base.set(data)
    be.graph_compute(gf)
    exp = loop_read(data.tobytes(), type, ne4, nb, start)
    np.testing.assert_array_equal(v.numpy().reshape(exp.shape), exp)
    np.testing.assert_array_equal(c.numpy().reshape(exp.shape), exp)
    np.testing.assert_array_equal(base.numpy().reshape(data.shape), data)   # reading wrote nothing


# ----------------------------------------------------------------------------------------------
# set_rows then get_rows: a broadcasting round trip
# ----------------------------------------------------------------------------------------------
@st.composite
def rows_cases(draw):
    ne0 = draw(st.integers(1, 4))
    n1 = draw(st.integers(1, 4))                    # rows written per (i2, i3)
    R = draw(st.integers(n1, n1 + 3))               # destination rows
    c1 = draw(st.integers(1, 3))
    c2 = draw(st.integers(1, 2))
    n2 = c1 * draw(st.integers(1, 2))               # b.ne2 % c.ne1 == 0
    n3 = c2 * draw(st.integers(1, 2))               # b.ne3 % c.ne2 == 0
    idx_type = draw(st.sampled_from([mg.i32, mg.i64]))
    src_type = draw(st.sampled_from([mg.f32, mg.f16]))
    dst_type = draw(st.sampled_from([mg.f32, mg.f16]))
    seed = draw(st.integers(0, 2**32 - 1))
    return ne0, n1, R, c1, c2, n2, n3, idx_type, src_type, dst_type, seed


@given(rows_cases())
def test_set_rows_get_rows_round_trip(case):
    ne0, n1, R, c1, c2, n2, n3, idx_type, src_type, dst_type, seed = case
    rng = np.random.default_rng(seed)
    ctx = mg.Context()
    dst, ddst = leaf_with_data(ctx, rng, dst_type, (ne0, R, n2, n3))
    b, db = leaf_with_data(ctx, rng, src_type, (ne0, n1, n2, n3))
    c = ctx.new_tensor_3d(idx_type, n1, c1, c2)
    dc = np.zeros((c2, c1, n1), idx_type.np_dtype)
    for j2 in range(c2):
        for j1 in range(c1):
            dc[j2, j1] = rng.permutation(R)[:n1]    # distinct rows in each index slice
    # get_rows does not broadcast by modulo: give it the full index tensor
    ids = ctx.new_tensor_3d(mg.i32, n1, n2, n3)
    dids = np.zeros((n3, n2, n1), np.int32)
    for i3 in range(n3):
        for i2 in range(n2):
            dids[i3, i2] = dc[i3 % c2, i2 % c1]
    stored = mg.set_rows(dst, b, c)
    back = mg.get_rows(stored, ids)
    gf = mg.Graph().build_forward_expand(back)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    dst.set(ddst)
    b.set(db)
    c.set(dc.reshape(1, c2, c1, n1))
    ids.set(dids.reshape(1, n3, n2, n1))
    be.graph_compute(gf)
    # rows come back converted through the destination type
    conv = db.astype(dst_type.np_dtype).astype(np.float32)
    np.testing.assert_array_equal(back.numpy().reshape(conv.shape), conv)
    # destination: the indexed rows hold the source, every other row is untouched
    exp = ddst.copy()
    for i3 in range(n3):
        for i2 in range(n2):
            for i in range(n1):
                exp[i3, i2, int(dc[i3 % c2, i2 % c1, i])] = db[i3, i2, i].astype(dst_type.np_dtype)
    got = dst.numpy().reshape(exp.shape)
    assert got.tobytes() == exp.tobytes()


# ----------------------------------------------------------------------------------------------
# cpy between random strided views == flattened-order copy
# ----------------------------------------------------------------------------------------------
def factor_shape(draw, n):
    """A random 4-D extent whose product is n."""
    ne = []
    rest = n
    for _ in range(3):
        divs = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divs))
        ne.append(d)
        rest //= d
    ne.append(rest)
    perm = draw(st.permutations(range(4)))
    return tuple(ne[p] for p in perm)


@st.composite
def cpy_cases(draw):
    n = draw(st.integers(1, 24))
    src_ne = factor_shape(draw, n)
    dst_ne = factor_shape(draw, n)
    src_type = draw(st.sampled_from([mg.f32, mg.f16]))
    dst_type = draw(st.sampled_from([mg.f32, mg.f16]))
    # source: padded leaf (possibly overlapping reads through stride 1 on a dim) then permuted
    src_pad = tuple(draw(st.integers(0, 2)) for _ in range(4))
    src_overlap = draw(st.booleans())
    src_axes = tuple(draw(st.permutations(range(4))))
    src_off = draw(st.integers(0, 3))
    # destination: never overlapping itself (padding >= 0, then a permutation)
    dst_pad = tuple(draw(st.integers(0, 2)) for _ in range(4))
    dst_axes = tuple(draw(st.permutations(range(4))))
    dst_off = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    return (src_ne, dst_ne, src_type, dst_type, src_pad, src_overlap, src_axes, src_off, dst_pad,
            dst_axes, dst_off, seed)


def strided_view(ctx, rng, type, ne, padding, axes, off, overlap=False):
    """A view of a fresh leaf with extents ne after permute(axes): the stored layout has extents
    pne (with pne[axes[i]] = ne... inverted), padded by `padding` elements per dim."""
    # stored extents: dim i of the stored tensor becomes dim axes[i] of the view
    sne = [ne[axes[i]] for i in range(4)]
    es = type.size
    nb = [es]
    for i in range(1, 4):
        nb.append(nb[i - 1] * (sne[i - 1] + padding[i - 1]))
    if overlap and sne[0] > 1 and sne[1] > 1:
        nb[1] = es                                   # rows overlap: windows of stride 1
        nb[2] = max(nb[2], es * (sne[0] + sne[1]))
        nb[3] = max(nb[3], nb[2] * sne[2])
    total_el = off + 1 + sum((n - 1) * b // es for n, b in zip(sne, nb)) + padding[3]
    base = ctx.new_tensor_1d(type, total_el)
    data = rand_bytes(rng, type, total_el)
    stored = mg.view_4d(base, *sne, nb[1], nb[2], nb[3], off * es)
    v = mg.permute(stored, *axes)
    assert v.ne == tuple(ne)
    return base, data, v


@given(cpy_cases())
def test_cpy_between_strided_views(case):
    (src_ne, dst_ne, src_type, dst_type, src_pad, src_overlap, src_axes, src_off, dst_pad, dst_axes,
     dst_off, seed) = case
    rng = np.random.default_rng(seed)
    ctx = mg.Context()
    sbase, sdata, sv = strided_view(ctx, rng, src_type, src_ne, src_pad, src_axes, src_off, src_overlap)
    dbase, ddata, dv = strided_view(ctx, rng, dst_type, dst_ne, dst_pad, dst_axes, dst_off)
    out = mg.cpy(sv, dv)
    assert out.view_src is dbase and out.view_offs == dv.view_offs and out.nb == dv.nb
    gf = mg.Graph().build_forward_expand(out)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    sbase.set(sdata)
    dbase.set(ddata)
    be.graph_compute(gf)
    # expected: read the source in flattened logical order by byte address, write the
    # destination in its flattened logical order by byte address; other bytes stay
    sraw = sdata.tobytes()
    vals = [np.frombuffer(sraw, src_type.np_dtype, 1, sv.view_offs + sum(i * b for i, b in zip(idx, sv.nb)))[0]
            for idx in indices(sv.ne)]
    exp = bytearray(ddata.tobytes())
    es = dst_type.size
    for val, idx in zip(vals, indices(dv.ne)):
        addr = dv.view_offs + sum(i * b for i, b in zip(idx, dv.nb))
        exp[addr:addr + es] = dst_type.np_dtype.type(np.float32(val)).tobytes()
    assert dbase.numpy().tobytes() == bytes(exp)
    np.testing.assert_array_equal(sbase.numpy(), sdata)
