"""The meta backend's split-state rules (backends/meta/split_state.py), case by case
against hand-worked expectations, including the permuted-view rule applied to the conv-state
store's `slots` and `windows` views, and the KDA three-part row that cannot be split.
Graphs here are built but never allocated: the rules only read shapes, strides and sources."""
import pytest

import minigraph as mg
from minigraph.backends.meta.split_state import (AXIS_0, AXIS_1, AXIS_2, MIRRORED, PARTIAL, SplitState, SplitStates,
                                   device_ne_nb, device_view_offset, even_shares)
from minigraph.models.conv_state import build_slot_order

F = mg.f32


def by_name(**rules):
    """callback: name -> SplitState (or an axis, split evenly)."""
    def cb(t, n_dev):
        st = rules.get(t.name)
        if isinstance(st, int):
            return SplitState.split(st, even_shares(t.ne[st], n_dev))
        return st
    return cb


def leaf(ctx, name, *ne):
    return ctx.new_tensor(F, ne).set_name(name)


def check(states, t, axis, shares=None, rule=None):
    st = states.state(t, assume_sync=False)
    assert st.axis == axis, (t, st, states.rule(t))
    if shares is not None:
        assert st.shares() == tuple(shares), (t, st)
    if rule is not None:
        assert rule in states.rule(t), states.rule(t)
    return st


# -- leaves and source-less ops -------------------------------------------------------------------

def test_leaves_callback_input_and_default():
    ctx = mg.Context()
    w = leaf(ctx, "w", 8, 6)
    w2 = leaf(ctx, "w2", 8, 6)
    x = leaf(ctx, "x", 8, 3).set_input()
    other = leaf(ctx, "other", 4)
    s = SplitStates(2, by_name(w=1, w2=SplitState.split(0, (6, 2)), x=0))
    check(s, w, AXIS_1, (3, 3), "leaf: callback")
    check(s, w2, AXIS_0, (6, 2), "leaf: callback")
    check(s, x, MIRRORED, rule="graph input")            # inputs never ask the callback
    check(s, other, MIRRORED, rule="callback gave none")


def test_callback_state_must_cover_the_axis():
    ctx = mg.Context()
    w = leaf(ctx, "w", 8, 6)
    s = SplitStates(2, by_name(w=SplitState.split(0, (3, 3))))
    with pytest.raises(mg.OpError, match=r"'w'.*rule 'callback'.*covers 6 elements of axis 0.*has 8"):
        s.state(w)


def test_arange_chain_is_mirrored():
    """The per-layer slot order: arange -> scale_bias -> cast -> view, all MIRRORED."""
    ctx = mg.Context()
    order = build_slot_order(ctx, 4, 2)
    s = SplitStates(2)
    check(s, order, MIRRORED)
    rev = order.srcs["a"]
    ar = rev.srcs["a"].srcs["a"]
    assert ar.op == "ARANGE"
    check(s, ar, MIRRORED, rule="source-less")


def test_empty_tensor_is_mirrored():
    ctx = mg.Context()
    c = leaf(ctx, "c", 6, 4)
    s = SplitStates(2, by_name(c=0))
    z = mg.view_1d(mg.reshape_2d(c, 6, 4), 0, 0)
    check(s, z, MIRRORED, rule="empty")
    check(s, mg.scale_inplace(z, 0.0), MIRRORED, rule="empty")


# -- mul_mat ------------------------------------------------------------------------------------------

def test_mul_mat_rules():
    ctx = mg.Context()
    a1 = leaf(ctx, "a1", 8, 6)      # split on axis 1 (output rows)
    a0 = leaf(ctx, "a0", 8, 6)      # split on axis 0 (the contraction)
    m = leaf(ctx, "m", 8, 6)
    b_m = leaf(ctx, "bm", 8, 4)
    b_0 = leaf(ctx, "b0", 8, 4)
    b_1 = leaf(ctx, "b1", 8, 4)
    s = SplitStates(2, by_name(a1=SplitState.split(1, (4, 2)), a0=0, b0=0, b1=1))
    check(s, mg.mul_mat(m, b_m), MIRRORED)
    check(s, mg.mul_mat(a1, b_m), AXIS_0, (4, 2), "mul_mat (1, MIRRORED)")
    check(s, mg.mul_mat(m, b_1), AXIS_1, (2, 2))
    p = mg.mul_mat(a0, b_0)
    check(s, p, PARTIAL, rule="mul_mat (0, 0)")
    assert s.state(p).axis == MIRRORED             # as a source: after the all-reduce
    # a consumer of the partial result sees it whole
    check(s, mg.add(p, mg.mul_mat(m, b_m)), MIRRORED)
    with pytest.raises(mg.OpError, match=r"MUL_MAT.*rule 'mul_mat \(0, MIRRORED\)' failed.*no mul_mat rule"):
        s.state(mg.mul_mat(a0, b_m))


# -- elementwise, per-row, concat ---------------------------------------------------------------------

def test_binary_broadcast_and_generic():
    ctx = mg.Context()
    x = leaf(ctx, "x", 8, 6)
    y = leaf(ctx, "y", 8, 6)
    col = leaf(ctx, "col", 8, 1)
    row = leaf(ctx, "row", 8)
    h = leaf(ctx, "h", 8, 6)
    s = SplitStates(2, by_name(x=1, y=1, row=0))
    check(s, mg.mul(x, col), AXIS_1, (3, 3), "binary broadcast")     # col.ne[1] == 1 and MIRRORED
    check(s, mg.add(x, y), AXIS_1, (3, 3))
    check(s, mg.silu(x), AXIS_1, (3, 3), "generic")
    check(s, mg.scale_bias(x, 2.0, 1.0), AXIS_1)
    with pytest.raises(mg.OpError, match=r"ADD.*'binary broadcast' failed: sources disagree: 'h'=MIRRORED, 'x'=AXIS_1"):
        s.state(mg.add(h, x))
    with pytest.raises(mg.OpError, match="sources disagree"):
        s.state(mg.mul(x, row))      # row is split on axis 0, x on axis 1


def test_per_row_ops():
    ctx = mg.Context()
    x1 = leaf(ctx, "x1", 8, 6)
    x0 = leaf(ctx, "x0", 8, 6)
    s = SplitStates(2, by_name(x1=1, x0=0))
    check(s, mg.rms_norm(x1, 1e-5), AXIS_1, (3, 3), "per-row")
    check(s, mg.sum_rows(x1), AXIS_1, (3, 3))
    with pytest.raises(mg.OpError, match=r"RMS_NORM.*per-row.*cannot take 'x0' split on axis 0"):
        s.state(mg.rms_norm(x0, 1e-5))


def test_soft_max_mask_must_follow_the_split_where_not_broadcast():
    ctx = mg.Context()
    x = leaf(ctx, "x", 8, 6, 4)            # rows of 8, 6 tokens, 4 heads
    head_mask = leaf(ctx, "hm", 8, 6, 4)   # one mask per head
    shared_mask = leaf(ctx, "sm", 8, 6)    # broadcast over heads
    s = SplitStates(2, by_name(x=2, hm=2))
    check(s, mg.soft_max_ext(x, shared_mask, 0.5, 0.0), AXIS_2, (2, 2), "soft_max")
    check(s, mg.soft_max_ext(x, head_mask, 0.5, 0.0), AXIS_2, (2, 2))
    s2 = SplitStates(2, by_name(x=2))      # a whole per-head mask would give each device heads 0..1
    with pytest.raises(mg.OpError, match=r"SOFT_MAX.*mask 'hm'.*must be split like 'x'"):
        s2.state(mg.soft_max_ext(x, head_mask, 0.5, 0.0))


def test_concat_rules():
    ctx = mg.Context()
    a = leaf(ctx, "a", 3, 8, 2)          # split on axis 1
    b = leaf(ctx, "b", 5, 8, 2)          # split on axis 1
    m = leaf(ctx, "m", 5, 8, 2)
    c0 = leaf(ctx, "c0", 3, 8, 2)        # split on axis 0
    s = SplitStates(2, by_name(a=SplitState.split(1, (6, 2)), b=SplitState.split(1, (6, 2)), c0=0))
    check(s, mg.concat(a, b, 0), AXIS_1, (6, 2), "concat")
    check(s, mg.concat(a, m, 0), AXIS_1, (6, 2))
    check(s, mg.concat(m, a, 0), AXIS_1, (6, 2))
    with pytest.raises(mg.OpError, match="split along the concat dim 0"):
        s.state(mg.concat(c0, m, 0))
    with pytest.raises(mg.OpError, match="cannot run split"):
        s.state(mg.concat(c0, c0, 0))


# -- reshape, permute, transpose, cpy -------------------------------------------------------------

def test_reshape_maps_the_flattened_split():
    ctx = mg.Context()
    # a conv history [n_cols*ch, S] split on axis 0 by channel (3 columns per channel)
    conv = leaf(ctx, "conv", 3 * 8, 2)
    s = SplitStates(2, by_name(conv=SplitState.split(0, (15, 9))))
    r = mg.reshape_3d(conv, 3, 8, 2)
    check(s, r, AXIS_1, (5, 3), "reshape")
    # one sequence: [24, 1] has one dim, so the split lands on the last dim of the result
    conv1 = leaf(ctx, "conv", 3 * 8, 1)
    check(s, mg.reshape_3d(conv1, 3, 8, 1), AXIS_1, (5, 3))
    # splitting the last axis of a 2-D tensor flattens to axis 0 of 1-D
    x = leaf(ctx, "x", 4, 6)
    s2 = SplitStates(2, by_name(x=1))
    check(s2, mg.reshape_1d(x, 24), AXIS_0, (12, 12))
    # axis 0 of [4, 6] flattened to 1-D: two elements per device, 6 repeats
    y = leaf(ctx, "y", 4, 6)
    s3 = SplitStates(2, by_name(y=0))
    st = check(s3, mg.reshape_1d(y, 24), AXIS_0, (12, 12))
    assert st.nr == (6,) and st.ne == ((2, 2),)


def test_reshape_that_would_scramble_the_slices_is_refused():
    """[4, 6] split on axis 0 -> [6, 4]: ggml's rule picks axis 0 with 3+3 elements, but device 0
    holds columns 0-1 of every row, not the first 3 of every 6: refused instead of garbage."""
    ctx = mg.Context()
    y = leaf(ctx, "y", 4, 6)
    s = SplitStates(2, by_name(y=0))
    with pytest.raises(mg.OpError, match="element chunks would differ"):
        s.state(mg.reshape_2d(y, 6, 4))


def test_permute_transpose_and_cont():
    ctx = mg.Context()
    x = leaf(ctx, "x", 8, 6, 2)
    s = SplitStates(2, by_name(x=SplitState.split(1, (4, 2))))
    check(s, mg.transpose(x), AXIS_0, (4, 2), "transpose")
    check(s, mg.permute(x, 0, 2, 1, 3), AXIS_2, (4, 2), "permute")
    check(s, mg.cont(mg.transpose(x)), AXIS_0, (4, 2), "reshape")
    check(s, mg.cast(x, mg.f16), AXIS_1, (4, 2), "cpy")


def test_cpy_into_a_destination_with_another_state_is_refused():
    ctx = mg.Context()
    src = leaf(ctx, "src", 12, 2)
    dst_ok = leaf(ctx, "dst_ok", 12, 2)
    dst_m = leaf(ctx, "dst_m", 12, 2)
    s = SplitStates(2, by_name(src=0, dst_ok=0))
    check(s, mg.cpy(src, dst_ok), AXIS_0, (6, 6))
    with pytest.raises(mg.OpError, match=r"writes into 'dst_m' \(MIRRORED\)"):
        s.state(mg.cpy(src, dst_m))


# -- views: the six steps ------------------------------------------------------------------------------

def test_view_rule_1_contiguous():
    ctx = mg.Context()
    cache = leaf(ctx, "cache", 24, 8)                           # rows of 3 cols x 8 channels
    s = SplitStates(2, by_name(cache=SplitState.split(0, (12, 12))))
    rows = mg.view_2d(cache, 24, 2, cache.nb[1], 3 * cache.nb[1])
    check(s, rows, AXIS_0, (12, 12), "view 1")


def test_view_rule_2_same_strides():
    ctx = mg.Context()
    x = leaf(ctx, "x", 8, 6)
    s = SplitStates(2, by_name(x=1))
    v = mg.view_2d(x, 4, 6, x.nb[1], 0)        # the first 4 columns of every row: same strides
    check(s, v, AXIS_1, (3, 3), "view 2")


def test_view_rule_3_windows_of_conv_x():
    """`windows` (nb = [elt, elt, x.nb1, x.nb2], not permuted) of conv_x split on
    axis 1 gets axis 2 through rule 3 (view.nb[3] == conv_x.nb[2])."""
    ctx = mg.Context()
    n_cols, n, ch, S, Kw = 3, 5, 8, 2, 3
    conv_x = leaf(ctx, "conv_x", n_cols + n, ch, S)
    s = SplitStates(2, by_name(conv_x=SplitState.split(1, (6, 2))))
    e = 4
    windows = mg.view_4d(conv_x, n_cols, Kw, ch, S, e, conv_x.nb[1], conv_x.nb[2], (n - (Kw - 1)) * e)
    assert not windows.is_permuted()
    check(s, windows, AXIS_2, (6, 2), "view 3")
    # device 1's layout: channels 6-7, the offset stays inside one row (not scaled)
    ne, nb = device_ne_nb(windows, s.state(windows), 1)
    assert ne == (n_cols, Kw, 2, S) and nb == (4, 4, conv_x.nb[1], (n_cols + n) * 2 * 4)
    assert device_view_offset(conv_x, s.state(conv_x), windows.view_offs, 1) == (n - (Kw - 1)) * e


def test_view_rule_3_without_a_matching_stride_fails():
    ctx = mg.Context()
    x = leaf(ctx, "x", 8, 6, 2)
    s = SplitStates(2, by_name(x=1))
    v = mg.view_2d(x, 4, 3, 3 * x.nb[1], 0)        # every third row: nb = [4, 96, 288, 288]
    with pytest.raises(mg.OpError, match=r"rule 'view 3.*' failed: no view dim d has nb\[d\+1\] == 192"):
        s.state(v)


def slots_view(s_cache, n_cols, K, ch, S, mem_size, head, offs=0):
    row = s_cache.nb[1]
    return mg.view_4d(s_cache, n_cols, K, ch, S, mem_size * row, n_cols * 4, row, head * row + offs)


def test_view_rule_4_slots_from_a_cache_split_on_axis_0():
    """r_l [n_embd_r, rows] split on axis 0 (by channel) -> nb_axis = elt,
    nb_next = row_size. `slots` (nb = [elt, mem_size*row, n_cols*elt, row], permuted) is split on
    axis 2: dim 2 spans a row exactly, dim 0 lies inside one channel, dims 1 and 3 are multiples of
    the row size."""
    ctx = mg.Context()
    n_cols, ch, S, K, mem = 3, 8, 2, 4, 4
    r = leaf(ctx, "cache_r_l0", n_cols * ch, mem * K)
    s = SplitStates(2, by_name(cache_r_l0=SplitState.split(0, (15, 9))))     # 5 + 3 channels
    slots = slots_view(r, n_cols, K, ch, S, mem, head=1)
    assert slots.is_permuted()
    check(s, slots, AXIS_2, (5, 3), "view 4: permuted view")
    # device 1: 3 channels; strides above the split dim scale with the share, the cell offset too
    row1 = 9 * 4
    ne, nb = device_ne_nb(slots, s.state(slots), 1)
    assert ne == (n_cols, K, 3, S) and nb == (4, mem * row1, n_cols * 4, row1)
    assert device_view_offset(r, s.state(r), slots.view_offs, 1) == 1 * row1


def test_slots_and_windows_meet_in_set_rows():
    ctx = mg.Context()
    n_cols, n, ch, S, K, mem = 3, 5, 8, 2, 4, 4
    r = leaf(ctx, "cache_r_l0", n_cols * ch, mem * K)
    conv_x = leaf(ctx, "conv_x", n_cols + n, ch, S)
    s = SplitStates(2, by_name(cache_r_l0=SplitState.split(0, (12, 12)), conv_x=1))
    Kw = min(n, K)
    windows = mg.view_4d(conv_x, n_cols, Kw, ch, S, 4, conv_x.nb[1], conv_x.nb[2], (n - (Kw - 1)) * 4)
    slots = slots_view(r, n_cols, K, ch, S, mem, head=0)
    st = mg.set_rows(slots, windows, build_slot_order(ctx, K, Kw))
    check(s, st, AXIS_2, (4, 4), "set_rows")


def test_view_rule_4_kda_three_part_rows_cannot_be_split():
    """KDA packs three histories (q, k, v) in one r row: n_cols*d_inner*elt = row_size/3, so no
    dim of a part's `slots` spans a row; with r_l split the view has no state: a clear error."""
    ctx = mg.Context()
    n_cols, d_inner, S, K, mem = 3, 8, 2, 4, 4
    r = leaf(ctx, "cache_r_l0", 3 * n_cols * d_inner, mem * K)
    s = SplitStates(2, by_name(cache_r_l0=0))
    part_offs = n_cols * d_inner * 4          # the k part
    slots = slots_view(r, n_cols, K, d_inner, S, mem, head=0, offs=part_offs)
    with pytest.raises(mg.OpError, match=r"split state of VIEW .*rule 'view 4: permuted view' "
                                         r"failed: no dim of the view .* spans exactly one element"):
        s.state(slots)
    # the same view of an unsplit cache is fine (rule 5)
    s2 = SplitStates(2)
    check(s2, slots, MIRRORED, rule="view 5")


def test_view_rule_6_view_of_a_permuted_split_tensor():
    ctx = mg.Context()
    x = leaf(ctx, "x", 8, 6, 2)
    s = SplitStates(2, by_name(x=0))
    xt = mg.transpose(x)                                        # permuted, split on axis 1
    v = mg.view_3d(xt, 6, 4, 2, xt.nb[1], xt.nb[2], 0)
    with pytest.raises(mg.OpError, match=r"rule 'view 6' failed: view of permuted tensor not implemented"):
        s.state(v)


# -- index and recurrent ops -------------------------------------------------------------------------

def test_get_rows_rules():
    ctx = mg.Context()
    st0 = leaf(ctx, "states", 24, 16)
    st1 = leaf(ctx, "states1", 24, 16)
    ids = ctx.new_tensor_1d(mg.i32, 2).set_name("ids").set_input()
    s = SplitStates(2, by_name(states=0, states1=1))
    check(s, mg.get_rows(st0, ids), AXIS_0, (12, 12), "get_rows")
    with pytest.raises(mg.OpError, match="GET_ROWS.*rule 'get_rows' failed: sources disagree"):
        s.state(mg.get_rows(st1, ids))


def test_set_rows_rules():
    ctx = mg.Context()
    dst = leaf(ctx, "dst", 6, 10)
    dst1 = leaf(ctx, "dst1", 6, 10)
    rows = leaf(ctx, "rows", 6, 3)
    rows1 = leaf(ctx, "rows1", 6, 3)
    idx = ctx.new_tensor_1d(mg.i32, 3).set_name("idx").set_input()
    idx_split = ctx.new_tensor_1d(mg.i32, 3).set_name("idx_split")
    s = SplitStates(2, by_name(dst=0, rows=0, rows1=1, dst1=1, idx_split=0))
    check(s, mg.set_rows(dst, rows, idx), AXIS_0, (3, 3))
    with pytest.raises(mg.OpError, match="indices 'idx_split' must be MIRRORED"):
        s.state(mg.set_rows(dst, rows, idx_split))
    with pytest.raises(mg.OpError, match="split on axis 1"):
        s.state(mg.set_rows(dst1, rows1, idx))
    with pytest.raises(mg.OpError, match=r"source 'rows' \(AXIS_0.*\) and destination 'dst1'"):
        s.state(mg.set_rows(dst1, rows, idx))


def test_ssm_conv_rules():
    ctx = mg.Context()
    sx = leaf(ctx, "sx", 6, 8, 2)
    w = leaf(ctx, "w", 4, 8)
    wm = leaf(ctx, "wm", 4, 8)
    s = SplitStates(2, by_name(sx=1, w=1))
    check(s, mg.ssm_conv(sx, w), AXIS_0, (4, 4), "ssm_conv")
    with pytest.raises(mg.OpError, match="SSM_CONV.*sources disagree"):
        s.state(mg.ssm_conv(sx, wm))


def test_gated_delta_net_rules():
    ctx = mg.Context()
    Sv, H, T, ns = 4, 4, 2, 1
    q, k, v = (leaf(ctx, n, Sv, H, T, ns) for n in "qkv")
    g = leaf(ctx, "g", Sv, H, T, ns)
    beta = leaf(ctx, "beta", 1, H, T, ns)
    state = leaf(ctx, "state", Sv, Sv, H, ns)
    s = SplitStates(2)
    check(s, mg.gated_delta_net(q, k, v, g, beta, state, 2), MIRRORED, rule="gated_delta_net")
    heads = SplitState.split(1, (2, 2))
    s2 = SplitStates(2, by_name(q=heads, k=heads, v=heads, g=heads, beta=heads,
                                state=SplitState.split(2, (2, 2))))
    check(s2, mg.gated_delta_net(q, k, v, g, beta, state, 2), AXIS_0, (Sv * 2, Sv * 2))
    s3 = SplitStates(2, by_name(k=heads, v=heads, g=heads, beta=heads, state=SplitState.split(2, (2, 2))))
    with pytest.raises(mg.OpError, match="q 'q' must be split on axis 1"):
        s3.state(mg.gated_delta_net(q, k, v, g, beta, state, 2))


def test_ssm_scan_is_scalar_only():
    ctx = mg.Context()
    ds, hd, nh, T, ns = 4, 2, 4, 2, 1
    s_ = leaf(ctx, "s", ds, hd, nh, 4)
    x = leaf(ctx, "x", hd, nh, T, ns)
    dt = leaf(ctx, "dt", nh, T, ns)
    A = leaf(ctx, "A", 1, nh)
    B = leaf(ctx, "B", ds, 1, T, ns)
    C = leaf(ctx, "C", ds, 1, T, ns)
    ids = ctx.new_tensor_1d(mg.i32, ns).set_name("ids").set_input()
    check(SplitStates(2), mg.ssm_scan(s_, x, dt, A, B, C, ids, 2), MIRRORED)
    s = SplitStates(2, by_name(s=2, x=1, dt=0, A=1))
    with pytest.raises(mg.OpError, match="SSM_SCAN.*scalar only"):
        s.state(mg.ssm_scan(s_, x, dt, A, B, C, ids, 2))


def test_uneven_shares_over_three_devices_follow_the_ratio():
    ctx = mg.Context()
    w = leaf(ctx, "w", 6, 7)
    x = leaf(ctx, "x", 6, 2).set_input()
    s = SplitStates(3, by_name(w=1))
    check(s, w, AXIS_1, (3, 2, 2))
    y = mg.mul_mat(w, x)                      # [7, 2] split on axis 0
    check(s, y, AXIS_0, (3, 2, 2))
    check(s, mg.transpose(y), AXIS_1, (3, 2, 2))
    check(s, mg.reshape_1d(mg.cont(mg.transpose(y)), 14), AXIS_0, (6, 4, 4))


def test_every_tensor_records_its_rule():
    ctx = mg.Context()
    w = leaf(ctx, "w", 8, 6)
    x = leaf(ctx, "x", 8, 2).set_input()
    y = mg.silu(mg.mul_mat(w, x))
    s = SplitStates(2, by_name(w=1))
    gf = mg.Graph().build_forward_expand(y)
    entries = s.derive(gf.leafs + gf.nodes)
    assert len(entries) == 4 and all(e.rule for e in entries.values())
    assert [e.rule.split(" ")[0] for e in entries.values()] == ["leaf:", "leaf:", "mul_mat", "generic"]
