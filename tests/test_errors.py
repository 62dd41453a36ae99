"""Every shape / type / bounds rule raises mg.OpError when the graph is built, with a message that
names the op and the tensor; out-of-range indices raise at compute time, name the node and leave
the destination's bytes untouched."""
from __future__ import annotations

import re

import numpy as np
import pytest

import minigraph as mg
from minigraph.registry import build


def names(*parts):
    """A regex that requires every part, in any order (re.search semantics)."""
    return "".join(f"(?=.*{re.escape(p)})" for p in parts)


def raises(*parts):
    return pytest.raises(mg.OpError, match=re.compile(names(*parts), re.S))


def T(ctx, type, *ne, name):
    return ctx.new_tensor(type, ne).set_name(name)


def rand(rng, t):
    shape = tuple(reversed(t.ne))
    if t.type.is_float:
        x = rng.uniform(-1, 1, shape)
        return np.where(np.abs(x) < 1e-2, 0.5, x).astype(t.type.np_dtype)
    return rng.integers(1, 50, shape).astype(t.type.np_dtype)


@pytest.fixture
def ctx():
    return mg.Context()


# ----------------------------------------------------------------------------------------------
# views
# ----------------------------------------------------------------------------------------------
def test_view_past_end_uses_true_strided_extent(ctx):
    base = T(ctx, mg.f32, 10, 3, name="base")              # 120 bytes
    # overlapping windows: contiguous size 4*5*3*4 = 240 bytes, true extent 116 bytes -> accepted
    ok = mg.view_3d(base, 4, 5, 3, 4, 40, 4)
    assert ok.nbytes() + 4 == 116
    # the same view two elements later reaches byte 124 -> refused
    with raises("VIEW", "'base'", "124"):
        mg.view_3d(base, 4, 5, 3, 4, 40, 12)
    with raises("VIEW", "'base'"):
        mg.view_1d(base, 31, 0)
    with raises("VIEW", "'base'"):
        mg.view_1d(base, 1, 120)
    mg.view_1d(base, 1, 116)                               # the last element is fine
    with raises("VIEW", "'base'"):
        mg.view_2d(base, 10, 3, 44, 0)                     # padded rows past the end
    with raises("VIEW", "'base'"):
        mg.view_4d(base, 2, 2, 2, 2, 8, 16, 100, 0)        # 4+4+8+16+100 = 132
    mg.view_4d(base, 2, 2, 2, 2, 8, 16, 88, 0)             # 120 exactly


def test_view_of_view_is_checked_against_the_root(ctx):
    base = T(ctx, mg.f32, 10, 3, name="base")
    v = mg.view_2d(base, 5, 2, 40, 40).set_name("v")       # bytes 40 .. 100
    mg.view_1d(v, 20, 0)                                   # bytes 40 .. 120: fits the root
    with raises("VIEW", "'v'", "'base'"):
        mg.view_1d(v, 21, 0)
    with raises("VIEW", "'v'", "'base'"):
        mg.view_1d(v, 1, 80)


def test_view_negative_offset(ctx):
    base = T(ctx, mg.f32, 10, name="base")
    with raises("VIEW", "'base'", "negative offset"):
        mg.view_1d(base, 2, -4)
    v = mg.view_1d(base, 4, 8).set_name("v")
    with raises("VIEW", "'v'", "negative offset"):
        mg.view_1d(v, 2, -4)


def test_reshape_rules(ctx):
    a = T(ctx, mg.f32, 4, 3, name="a")
    at = mg.transpose(a).set_name("a_t")
    with raises("RESHAPE", "'a_t'", "contiguous"):
        mg.reshape_2d(at, 4, 3)
    with raises("RESHAPE", "'a_t'"):
        mg.reshape_1d(at, 12)
    gaps = mg.view_2d(a, 2, 3, 16, 0).set_name("gaps")
    with raises("RESHAPE", "'gaps'"):
        mg.reshape_1d(gaps, 6)
    with raises("RESHAPE", "'a'", "12"):
        mg.reshape_2d(a, 5, 2)
    with raises("RESHAPE", "'a'"):
        mg.reshape(a, T(ctx, mg.f32, 13, name="like"))


@pytest.mark.parametrize("axes", [(0, 0, 1, 2), (0, 1, 2, 4), (-1, 0, 1, 2), (3, 2, 1, 1)])
def test_permute_bad_axes(ctx, axes):
    a = T(ctx, mg.f32, 2, 3, 4, name="a")
    with raises("PERMUTE", "'a'"):
        mg.permute(a, *axes)


def test_concat_rules(ctx):
    a = T(ctx, mg.f32, 3, 4, 2, name="a")
    b = T(ctx, mg.f32, 3, 5, 2, name="b")
    with raises("CONCAT", "'a'", "'b'"):
        mg.concat(a, b, 0)                                 # ne1 differs
    mg.concat(a, b, 1)
    c = T(ctx, mg.f16, 3, 4, 2, name="c")
    with raises("CONCAT", "'a'", "'c'"):
        mg.concat(a, c, 0)
    with raises("CONCAT", "dim"):
        mg.concat(a, a, 4)
    bt = mg.transpose(T(ctx, mg.f32, 5, 3, 2, name="bb")).set_name("b_t")   # ne (3, 5, 2)
    with raises("CONCAT", "'a'", "'b_t'"):
        mg.concat(a, bt, 2)


def test_cpy_rules(ctx):
    a = T(ctx, mg.f32, 3, 4, name="a")
    b = T(ctx, mg.f32, 5, 2, name="b")
    with raises("CPY", "'a'", "'b'", "12", "10"):
        mg.cpy(a, b)
    mg.cpy(a, T(ctx, mg.f16, 2, 6, name="b16"))            # shape and type may differ
    with raises("CPY", "'a'"):
        mg.cast(a, mg.i64)


# ----------------------------------------------------------------------------------------------
# set_rows: each assert ggml's set_rows makes
# ----------------------------------------------------------------------------------------------
def set_rows_args(ctx, a_ne=(5, 6, 4, 2), b_ne=(5, 3, 4, 2), c_ne=(3, 2, 1), a_type=mg.f32,
                  b_type=mg.f32, c_type=mg.i32):
    return (T(ctx, a_type, *a_ne, name="dst"), T(ctx, b_type, *b_ne, name="src"),
            T(ctx, c_type, *c_ne, name="idx"))


def test_set_rows_valid_baseline(ctx):
    mg.set_rows(*set_rows_args(ctx))
    mg.set_rows(*set_rows_args(ctx, c_type=mg.i64, a_type=mg.f16, b_type=mg.f16))


@pytest.mark.parametrize("kw,must_name", [
    (dict(a_ne=(4, 6, 4, 2)), ("'dst'", "'src'")),                    # a.ne0 == b.ne0
    (dict(a_ne=(5, 6, 3, 2)), ("'dst'", "'src'")),                    # a.ne2 == b.ne2
    (dict(a_ne=(5, 6, 4, 1)), ("'dst'", "'src'")),                    # a.ne3 == b.ne3
    (dict(c_ne=(4, 2, 1)), ("'src'", "'idx'")),                       # b.ne1 == c.ne0
    (dict(c_ne=(3, 3, 1)), ("'src'", "'idx'")),                       # b.ne2 % c.ne1 == 0
    (dict(c_ne=(3, 2, 3)), ("'src'", "'idx'")),                       # b.ne3 % c.ne2 == 0
    (dict(c_ne=(3, 2, 1, 2)), ("'idx'",)),                            # c.ne3 == 1
    (dict(b_type=mg.i32), ("'src'",)),                                # b type F32 or F16
    (dict(c_type=mg.f32), ("'idx'",)),                                # c type I64 or I32
    (dict(c_type=mg.f16), ("'idx'",)),
    (dict(a_type=mg.i32), ("'dst'",)),                                # destination type
])
def test_set_rows_each_rule(ctx, kw, must_name):
    a, b, c = set_rows_args(ctx, **kw)
    with raises("SET_ROWS", *must_name):
        mg.set_rows(a, b, c)


def test_set_rows_contiguous_rows(ctx):
    a, b, c = set_rows_args(ctx, a_ne=(5, 5, 4, 2))
    at = mg.permute(T(ctx, mg.f32, 5, 5, 4, 2, name="mem"), 1, 0, 2, 3).set_name("dst_t")
    with raises("SET_ROWS", "'dst_t'", "contiguous"):
        mg.set_rows(at, b, c)
    bt = mg.permute(T(ctx, mg.f32, 3, 5, 4, 2, name="rows"), 1, 0, 2, 3).set_name("src_t")
    with raises("SET_ROWS", "'src_t'", "contiguous"):
        mg.set_rows(a, bt, c)
    # overlapping source rows (nb1 == element size) are fine: rows are contiguous
    x = T(ctx, mg.f32, 12, 4, 2, name="x")
    win = mg.view_4d(x, 5, 3, 4, 2, 4, 48, 192, 0)
    mg.set_rows(a, win, c)


# ----------------------------------------------------------------------------------------------
# other ops
# ----------------------------------------------------------------------------------------------
def test_get_rows_rules(ctx):
    a = T(ctx, mg.f32, 4, 6, 3, name="a")
    with raises("GET_ROWS", "'ids64'", "i32"):
        mg.get_rows(a, T(ctx, mg.i64, 5, 3, name="ids64"))
    with raises("GET_ROWS", "'a'", "'ids'"):
        mg.get_rows(a, T(ctx, mg.i32, 5, 2, name="ids"))   # a.ne2 == ids.ne1
    with raises("GET_ROWS", "'idf'"):
        mg.get_rows(a, T(ctx, mg.f32, 5, 3, name="idf"))
    mg.get_rows(a, T(ctx, mg.i32, 5, 3, name="good"))


def test_binary_rules(ctx):
    a = T(ctx, mg.f32, 6, 4, name="a")
    for fn, opname in ((mg.add, "ADD"), (mg.sub, "SUB"), (mg.mul, "MUL"), (mg.div, "DIV")):
        with raises(opname, "'a'", "'b'"):
            fn(a, T(ctx, mg.f32, 4, 4, name="b"))
        with raises(opname, "'a'", "'big'"):
            fn(a, T(ctx, mg.f32, 6, 8, name="big"))        # b broadcasts to a, not the reverse
        with raises(opname, "'a'", "'h'"):
            fn(a, T(ctx, mg.f16, 6, 4, name="h"))
        fn(a, T(ctx, mg.f32, 3, 2, name="ok"))


def test_mul_mat_rules(ctx):
    a = T(ctx, mg.f32, 4, 3, name="a")
    with raises("MUL_MAT", "'a'", "'b'"):
        mg.mul_mat(a, T(ctx, mg.f32, 5, 2, name="b"))
    at = mg.transpose(T(ctx, mg.f32, 3, 4, name="raw")).set_name("a_t")   # ne (4, 3)
    with raises("MUL_MAT", "'a_t'", "transposed"):
        mg.mul_mat(at, T(ctx, mg.f32, 4, 2, name="b2"))
    with raises("MUL_MAT", "'a3'", "'b3'"):
        mg.mul_mat(T(ctx, mg.f32, 4, 3, 2, name="a3"), T(ctx, mg.f32, 4, 2, 3, name="b3"))


def test_ssm_conv_rules(ctx):
    c = T(ctx, mg.f32, 3, 2, name="w")
    big = T(ctx, mg.f32, 8, 2, 2, name="big")
    sx = mg.view_3d(big, 6, 2, 2, 32, 64, 0).set_name("sx_gaps")   # nb1 = 32 != ne0*4
    with raises("SSM_CONV", "'sx_gaps'", "dense"):
        mg.ssm_conv(sx, c)
    with raises("SSM_CONV", "'sx_t'"):
        mg.ssm_conv(mg.permute(T(ctx, mg.f32, 2, 6, 2, name="r"), 1, 0, 2, 3).set_name("sx_t"), c)
    with raises("SSM_CONV", "'sx3'", "'w'"):
        mg.ssm_conv(T(ctx, mg.f32, 6, 3, 2, name="sx3"), c)          # channels differ
    with raises("SSM_CONV", "'short'"):
        mg.ssm_conv(T(ctx, mg.f32, 1, 2, 2, name="short"), c)        # fewer than d_conv-1 columns
    mg.ssm_conv(mg.view_3d(T(ctx, mg.f32, 6, 2, 3, name="ok"), 6, 2, 2, 24, 96, 0), c)


def scan_args(ctx, ds=3, hd=2, nh=4, ng=2, T_=3, ns=2, rows=4, A0=1, **override):
    t = dict(s=T(ctx, mg.f32, ds, hd, nh, rows, name="s"), x=T(ctx, mg.f32, hd, nh, T_, ns, name="x"),
             dt=T(ctx, mg.f32, nh, T_, ns, name="dt"), A=T(ctx, mg.f32, A0, nh, name="A"),
             B=T(ctx, mg.f32, ds, ng, T_, ns, name="B"), C=T(ctx, mg.f32, ds, ng, T_, ns, name="C"),
             ids=T(ctx, mg.i32, ns, name="ids"))
    for k, ne in override.items():
        ty = mg.i32 if k == "ids" else mg.f32
        if isinstance(ne, tuple) and ne and isinstance(ne[0], mg.DType):
            ty, ne = ne[0], ne[1:]
        t[k] = T(ctx, ty, *ne, name=f"{k}_bad")
    return t


def test_ssm_scan_valid_baseline(ctx):
    t = scan_args(ctx)
    mg.ssm_scan(**t, K=3)
    mg.ssm_scan(**scan_args(ctx, A0=3), K=1)                         # Mamba-1 A with K == 1


@pytest.mark.parametrize("override,bad", [
    (dict(dt=(4, 2, 2)), "'dt_bad'"),
    (dict(B=(3, 2, 3, 1)), "'B_bad'"),
    (dict(C=(3, 1, 3, 2)), "'C_bad'"),
    (dict(ids=(3,)), "'ids_bad'"),
    (dict(ids=(mg.i64, 2)), "'ids_bad'"),
    (dict(A=(1, 3)), "'A_bad'"),
    (dict(A=(3, 4)), "'A_bad'"),                                     # Mamba-1 A with K > 1
    (dict(s=(3, 2, 3, 4)), "'s_bad'"),
    (dict(s=(mg.f16, 3, 2, 4, 4)), "'s_bad'"),
    (dict(B=(3, 3, 3, 2), C=(3, 3, 3, 2)), "n_group"),
])
def test_ssm_scan_rules(ctx, override, bad):
    t = scan_args(ctx, **override)
    with raises("SSM_SCAN", bad):
        mg.ssm_scan(**t, K=3)


def test_ssm_scan_K_and_layout(ctx):
    with raises("SSM_SCAN", "K"):
        mg.ssm_scan(**scan_args(ctx), K=0)
    t = scan_args(ctx)
    t["x"] = mg.permute(T(ctx, mg.f32, 4, 2, 3, 2, name="xp"), 1, 0, 2, 3).set_name("x_perm")
    with raises("SSM_SCAN", "'x_perm'"):
        mg.ssm_scan(**t, K=2)


def gdn_args(ctx, S=3, H=4, Hk=2, T_=3, ns=2, **override):
    t = dict(q=T(ctx, mg.f32, S, Hk, T_, ns, name="q"), k=T(ctx, mg.f32, S, Hk, T_, ns, name="k"),
             v=T(ctx, mg.f32, S, H, T_, ns, name="v"), g=T(ctx, mg.f32, 1, H, T_, ns, name="g"),
             beta=T(ctx, mg.f32, 1, H, T_, ns, name="beta"), state=T(ctx, mg.f32, S, S, H, ns, name="state"))
    for k, ne in override.items():
        t[k] = T(ctx, mg.f32, *ne, name=f"{k}_bad")
    return t


def test_gdn_valid_baseline(ctx):
    mg.gated_delta_net(**gdn_args(ctx), K=2)
    t = gdn_args(ctx)
    t["g"] = T(ctx, mg.f32, 3, 4, 3, 2, name="g_kda")
    mg.gated_delta_net(**t, K=1)


@pytest.mark.parametrize("override,bad", [
    (dict(state=(3, 3, 4, 1)), "'state_bad'"),
    (dict(state=(2, 3, 4, 2)), "'state_bad'"),
    (dict(beta=(3, 4, 3, 2)), "'beta_bad'"),
    (dict(beta=(1, 4, 2, 2)), "'beta_bad'"),
    (dict(g=(2, 4, 3, 2)), "'g_bad'"),
    (dict(g=(1, 4, 3, 1)), "'g_bad'"),
    (dict(q=(2, 2, 3, 2)), "'q_bad'"),
    (dict(k=(3, 3, 3, 2)), "'k_bad'"),                                # H % H_k != 0
    (dict(q=(3, 2, 2, 2)), "'q_bad'"),                                # T differs
    (dict(k=(3, 2, 3, 3)), "'k_bad'"),                                # n_seqs % n != 0
])
def test_gdn_rules(ctx, override, bad):
    with raises("GATED_DELTA_NET", bad):
        mg.gated_delta_net(**gdn_args(ctx, **override), K=2)


def test_gdn_K_and_types(ctx):
    with raises("GATED_DELTA_NET", "K"):
        mg.gated_delta_net(**gdn_args(ctx), K=0)
    t = gdn_args(ctx)
    t["v"] = T(ctx, mg.f16, 3, 4, 3, 2, name="v16")
    with raises("GATED_DELTA_NET", "'v16'"):
        mg.gated_delta_net(**t, K=1)
    t = gdn_args(ctx)
    t["state"] = mg.permute(T(ctx, mg.f32, 3, 3, 4, 2, name="sp"), 1, 0, 2, 3).set_name("state_t")
    with raises("GATED_DELTA_NET", "'state_t'"):
        mg.gated_delta_net(**t, K=1)


@pytest.mark.parametrize("start,stop,step", [(0, 0, 1), (5, 0, 1), (0, 5, -1), (0, 5, 0), (1.0, 1.0 + 1e-9, 1.0)])
def test_arange_with_no_elements(ctx, start, stop, step):
    with raises("ARANGE"):
        mg.arange(ctx, start, stop, step)


def test_scale_and_unary_rules(ctx):
    h = T(ctx, mg.f16, 4, name="h")
    with raises("SCALE", "'h'"):
        mg.scale(h, 2.0)
    with raises("SILU", "'h'"):
        mg.silu(h)
    with raises("RMS_NORM", "'h'"):
        mg.rms_norm(h, 1e-5)
    with raises("SUM_ROWS", "'h'"):
        mg.sum_rows(h)
    a = T(ctx, mg.f32, 4, 3, name="a")
    with raises("REPEAT", "'a'"):
        mg.repeat_4d(a, 6, 3, 1, 1)
    with raises("CONT", "'a'"):
        mg.cont_2d(a, 5, 2)


# ----------------------------------------------------------------------------------------------
# tensors, devices, graphs without memory
# ----------------------------------------------------------------------------------------------
def test_set_wrong_dtype_or_shape(ctx):
    a = T(ctx, mg.f32, 4, 3, name="weights")
    i = T(ctx, mg.i32, 3, name="ids")
    mg.alloc_ctx_tensors(ctx, mg.backend("ref"))
    with raises("set", "'weights'", "float64"):
        a.set(np.ones((3, 4)))
    with raises("set", "'weights'", "(4, 3)"):
        a.set(np.ones((4, 3), np.float32))
    with raises("set", "'weights'"):
        a.set(np.ones((2, 3, 4), np.float32))
    with raises("set", "'ids'", "int64"):
        i.set(np.array([1, 2, 3]).astype(np.int64))
    with raises("set", "'ids'"):
        i.set(np.array([1.0, 2.0, 3.0], np.float32))


def test_set_without_memory(ctx):
    a = T(ctx, mg.f32, 4, name="nomem")
    with raises("'nomem'", "memory"):
        a.set(np.ones(4, np.float32))
    with raises("'nomem'", "memory"):
        a.numpy()


def test_compute_with_leaf_without_memory():
    ctx1, ctx2 = mg.Context(), mg.Context()
    a = T(ctx1, mg.f32, 4, name="has_mem")
    b = T(ctx2, mg.f32, 4, name="no_mem")
    out = mg.add(a, b)
    gf = mg.Graph().build_forward_expand(out)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx1, be)
    with raises("'no_mem'", "memory"):
        be.graph_compute(gf)
    # after giving it memory, the same graph computes
    mg.alloc_ctx_tensors(ctx2, be)
    a.set(np.full(4, 1.5, np.float32))
    b.set(np.full(4, 2.0, np.float32))
    be.graph_compute(gf)
    np.testing.assert_array_equal(out.numpy(), np.full(4, 3.5, np.float32))


@pytest.mark.parametrize("name", ["tpu:0", "nosuchdevice", "ref:1", "cpu:x", ""])
def test_unknown_device_name(name):
    # backend() raises ValueError (OpError is a ValueError subclass, either passes here)
    with pytest.raises(ValueError, match=re.escape(repr(name)) if name else None):
        mg.backend(name)


# ----------------------------------------------------------------------------------------------
# compute-time index errors: nothing is written
# ----------------------------------------------------------------------------------------------
def all_buffers(*tensors):
    bufs = {}
    for t in tensors:
        buf, _ = t.root().storage()
        bufs[buf.id] = buf
    return {k: b.mem.copy() for k, b in bufs.items()}, bufs


@pytest.mark.parametrize("bad", [-1, 6, 1000, -7])
@pytest.mark.parametrize("idx_type", [mg.i32, mg.i64])
def test_set_rows_index_out_of_range_at_compute(bad, idx_type):
    rng = np.random.default_rng(1)
    ctx = mg.Context()
    dst = T(ctx, mg.f32, 4, 6, 2, name="cache")
    b = T(ctx, mg.f32, 4, 3, 2, name="rows")
    c = T(ctx, idx_type, 3, 2, name="where")
    st = mg.set_rows(dst, b, c).set_name("store")
    gf = mg.Graph().build_forward_expand(st)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    dst.set(rand(rng, dst))
    b.set(rand(rng, b))
    good = np.array([[0, 2, 5], [1, 3, 4]], idx_type.np_dtype)
    c.set(good)
    be.graph_compute(gf)                                   # a good compute first
    badidx = good.copy()
    badidx[1, 1] = bad
    c.set(badidx)
    dst.set(rand(rng, dst))
    snap, bufs = all_buffers(dst, b, c)
    with raises("SET_ROWS", "'store'", "'where'", str(bad), "[0, 6)"):
        be.graph_compute(gf)
    for k, mem in snap.items():
        assert np.array_equal(bufs[k].mem, mem)            # every byte untouched
    c.set(good)                                            # and the graph still works
    be.graph_compute(gf)


def test_set_rows_broadcast_index_out_of_range_in_a_later_slice():
    rng = np.random.default_rng(2)
    ctx = mg.Context()
    mem = T(ctx, mg.f32, 6, 6, name="mem")                 # rows of 2 channels x 3 taps, 2 cells x 3 slots
    slots = mg.view_4d(mem, 3, 3, 2, 2, 48, 12, 24, 0).set_name("slots")
    b = T(ctx, mg.f32, 3, 2, 2, 2, name="win")
    c = T(ctx, mg.i32, 2, 2, name="order")
    st = mg.set_rows(slots, b, c).set_name("st")
    gf = mg.Graph().build_forward_expand(st)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    mem.set(rand(rng, mem))
    b.set(rand(rng, b))
    c.set(np.array([[0, 1], [2, 3]], np.int32))             # 3 >= slots.ne1 == 3
    snap, bufs = all_buffers(mem, b, c)
    with raises("SET_ROWS", "'st'", "'order'", "3", "[0, 3)"):
        be.graph_compute(gf)
    for k, m in snap.items():
        assert np.array_equal(bufs[k].mem, m)


@pytest.mark.parametrize("bad", [-1, 5])
def test_get_rows_index_out_of_range_at_compute(bad):
    rng = np.random.default_rng(3)
    ctx = mg.Context()
    a = T(ctx, mg.f32, 4, 5, name="table")
    ids = T(ctx, mg.i32, 3, name="ids")
    out = mg.get_rows(a, ids).set_name("gathered")
    gf = mg.Graph().build_forward_expand(out)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    a.set(rand(rng, a))
    ids.set(np.array([4, 0, 2], np.int32))
    be.graph_compute(gf)
    before_out = out.numpy().copy()
    ids.set(np.array([1, bad, 2], np.int32))
    snap, bufs = all_buffers(a, ids, out)
    with raises("GET_ROWS", "'gathered'", "'ids'", str(bad), "[0, 5)"):
        be.graph_compute(gf)
    for k, m in snap.items():
        assert np.array_equal(bufs[k].mem, m)
    np.testing.assert_array_equal(out.numpy(), before_out)


@pytest.mark.parametrize("bad", [-1, 4])
def test_ssm_scan_ids_out_of_range_at_compute(bad):
    rng = np.random.default_rng(4)
    ctx = mg.Context()
    t = scan_args(ctx, T_=2, rows=4)
    y = mg.ssm_scan(**t, K=2).set_name("scan")
    gf = mg.Graph().build_forward_expand(y)
    be = mg.backend("ref")
    mg.alloc_ctx_tensors(ctx, be)
    for k, v in t.items():
        if k == "ids":
            v.set(np.array([2, 1], np.int32))
        else:
            v.set(rand(rng, v))
    be.graph_compute(gf)
    t["ids"].set(np.array([bad, 1], np.int32))
    snap, bufs = all_buffers(y, *t.values())
    with raises("SSM_SCAN", "'scan'", "'ids'", str(bad), "[0, 4)"):
        be.graph_compute(gf)
    for k, m in snap.items():
        assert np.array_equal(bufs[k].mem, m)


# ----------------------------------------------------------------------------------------------
# params and sources: the registry's schema is strict, every refusal an OpError naming op and name
# ----------------------------------------------------------------------------------------------
def test_bool_param_takes_only_a_real_bool(ctx):
    a = T(ctx, mg.f32, 4, name="a")
    for bad in ("no", 1, 0, None, 1.0):
        with raises("SILU", "'inplace'", "bool"):
            mg.silu(a, inplace=bad)
    assert mg.silu(a, inplace=np.bool_(True)).view_src is a


def test_int_param_refuses_bools_and_fractions(ctx):
    a, b = T(ctx, mg.f32, 4, 2, name="a"), T(ctx, mg.f32, 4, 3, name="b")
    for bad in (True, 1.5, "1", None):
        with raises("CONCAT", "'dim'", "int"):
            mg.concat(a, b, dim=bad)
    assert mg.concat(a, b, dim=1.0).params["dim"] == 1            # a whole float is that int
    assert mg.concat(a, b, dim=np.int64(1)).ne == (4, 5, 1, 1)


def test_float_param_takes_ints_but_not_bools(ctx):
    a = T(ctx, mg.f32, 4, name="a")
    assert mg.scale(a, 2).params["s"] == 2.0 and isinstance(mg.scale(a, 2).params["s"], float)
    assert mg.rms_norm(a, np.float32(1e-6)).params["eps"] == pytest.approx(1e-6)
    with raises("SCALE", "'s'", "float"):
        mg.scale(a, True)
    with raises("RMS_NORM", "'eps'", "float"):
        mg.rms_norm(a, "1e-6")


def test_tuple_param_elements_are_ints(ctx):
    a = T(ctx, mg.f32, 4, 3, name="a")
    with raises("PERMUTE", "'axes[1]'", "int"):
        mg.permute(a, 0, 1.5, 2, 3)
    with raises("RESHAPE", "'ne'", "tuple"):
        build("RESHAPE", a=a, ne=12)


def test_missing_required_source_is_an_op_error(ctx):
    a = T(ctx, mg.f32, 4, name="a")
    with raises("ADD", "'b'", "required"):
        mg.add(a, None)
    with raises("SILU", "'a'", "required"):
        mg.silu(None)
    with raises("ADD", "'b'", "Tensor"):
        mg.add(a, 3.0)
