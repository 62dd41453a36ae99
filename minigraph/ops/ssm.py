"""Recurrent ops: ssm_conv (causal conv as a cross-correlation), ssm_scan and gated_delta_net
with K rollback snapshots packed after the main output (slot 0 = final state)."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, build, op, reference, require, state_slots
from ..types import f32, i32
from .elementwise import _softplus
from .index import check_indices
from .public import public


@op("SSM_CONV", srcs=("sx", "c"), split="ssm_conv", ggml=GgmlCall("ssm_conv", ("sx", "c")),
    shape="sx: [d_conv-1+n_t, d_inner, n_s], rows dense; c: [d_conv, d_inner] -> [d_inner, n_t, n_s]")
def _ssm_conv_rule(sx, c):
    name = "SSM_CONV"
    require(sx.type == f32 and c.type == f32, name, lambda: f"{sx.label} and {c.label} must be f32")
    require(sx.ne[3] == 1, name, lambda: f"{sx.label} must be 3-D [d_conv-1+n_t, d_inner, n_s], got ne={list(sx.ne)}")
    require(c.ne[2] == 1 and c.ne[3] == 1, name, lambda: f"weights {c.label} must be 2-D [d_conv, d_inner], got ne={list(c.ne)}")
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    require(sx.ne[1] == d_inner, name, lambda: f"{sx.label} has {sx.ne[1]} channels, weights {c.label} {d_inner}")
    require(n_t >= 0, name, lambda: f"{sx.label} has {sx.ne[0]} columns, fewer than d_conv-1 = {d_conv - 1}")
    require(sx.nb[0] == 4 and sx.nb[1] == sx.ne[0] * 4, name,
            lambda: f"{sx.label} rows must be dense along dim 0 (nb0 == 4, nb1 == ne0*4), got nb={list(sx.nb)}")
    require(c.nb[0] == 4, name, lambda: f"weights {c.label} rows must be contiguous (nb0 == 4)")
    return Out(f32, (d_inner, n_t, sx.ne[2]))


@reference("SSM_CONV")
def _ssm_conv_ref(node, sx, c):
    d_conv = c.shape[-1]
    n_t = node.ne[1]
    x = sx[0]                     # [n_s, d_inner, cols]
    w = c[0, 0]                   # [d_inner, d_conv]
    acc = np.zeros(x.shape[:2] + (n_t,), np.float32)
    for k in range(d_conv):       # f32 accumulation from 0, taps ascending (ggml's order)
        acc = acc + x[:, :, k:k + n_t] * w[:, k:k + 1]
    return acc.transpose(0, 2, 1)[None]   # [1, n_s, n_t, d_inner]


@public("SSM_CONV", """
>>> sx = ctx.new_tensor_3d(mg.f32, 3 + 5, 16, 2)    # 3 history columns + 5 tokens, 16 channels, 2 seqs
>>> mg.ssm_conv(sx, ctx.new_tensor_2d(mg.f32, 4, 16)).ne
(16, 5, 2, 1)
""")
def ssm_conv(sx, c):
    """ggml_ssm_conv: per channel, the causal convolution (a cross-correlation) of the columns of
    sx with the d_conv taps of c; one result column per token."""
    return build("SSM_CONV", sx=sx, c=c)


@op("SSM_SCAN", srcs=("s", "x", "dt", "A", "B", "C", "ids"), params={"K": int}, split="generic_scalar",
    ggml=GgmlCall("ssm_scan", ("s", "x", "dt", "A", "B", "C", "ids", "K"), ctypes={"K": "int64_t"}),
    shape="s: [d_state, head_dim, n_head, rows], x: [head_dim, n_head, T, n_seqs], dt: [n_head, T, n_seqs], "
          "A: [1 or d_state, n_head], B and C: [d_state, n_group, T, n_seqs] with n_head % n_group == 0, "
          "ids: [n_seqs] i32 rows of s -> [head_dim*n_head*T*n_seqs + K*d_state*head_dim*n_head*n_seqs] "
          "(y, then K state snapshots)")
def _ssm_scan_rule(s, x, dt, A, B, C, ids, K):
    name = "SSM_SCAN"
    require(K >= 1, name, lambda: f"K must be >= 1, got {K}")
    for t in (s, x, dt, A, B, C):
        require(t.type == f32, name, lambda: f"{t.label} must be f32, got {t.type.name}")
    require(ids.type == i32, name, lambda: f"ids {ids.label} must be i32")
    require(s.is_contiguous() and dt.is_contiguous() and A.is_contiguous(), name,
            lambda: f"{s.label}, {dt.label} and {A.label} must be contiguous")
    for t in (x, B, C):
        require(t.nb[0] == 4 and t.nb[1] == t.ne[0] * 4, name, lambda: f"{t.label} must be dense in dims 0-1, got nb={list(t.nb)}")
    require(B.ne == C.ne, name, lambda: f"{B.label} ne={list(B.ne)} and {C.label} ne={list(C.ne)} must match")
    d_state, head_dim, n_head, T, n_seqs = s.ne[0], x.ne[0], x.ne[1], x.ne[2], x.ne[3]
    require(dt.ne[:3] == (n_head, T, n_seqs) and dt.ne[3] == 1, name,
            lambda: f"{dt.label} must be [n_head, T, n_seqs] = {[n_head, T, n_seqs]}, got ne={list(dt.ne)}")
    require(s.ne[1] == head_dim and s.ne[2] == n_head, name,
            lambda: f"state {s.label} must be [d_state, {head_dim}, {n_head}, rows], got ne={list(s.ne)}")
    require(B.ne[0] == d_state and B.ne[2] == T and B.ne[3] == n_seqs, name,
            lambda: f"{B.label} must be [{d_state}, n_group, {T}, {n_seqs}], got ne={list(B.ne)}")
    require(B.ne[1] > 0 and n_head % B.ne[1] == 0, name,
            lambda: f"n_head {n_head} must be a multiple of n_group {B.ne[1]}")
    require(ids.ne == (n_seqs, 1, 1, 1), name,
            lambda: f"ids {ids.label} must be a vector of {n_seqs}, got ne={list(ids.ne)}")
    require(A.ne[1] == n_head and A.ne[2] == 1 and A.ne[3] == 1, name,
            lambda: f"A {A.label} must be [1 or d_state, {n_head}]")
    require(A.ne[0] == 1 or (A.ne[0] == d_state and K == 1), name,
            lambda: f"A {A.label} must be [1, n_head] (Mamba-2), or [d_state, n_head] with K == 1 (Mamba-1)")
    return Out(f32, (x.nelements() + K * d_state * head_dim * n_head * n_seqs,))


@state_slots("SSM_SCAN")
def _ssm_scan_slots(node):
    s, x = node.srcs["s"], node.srcs["x"]
    return x.nelements() * 4, s.ne[0] * x.ne[0] * x.ne[1], x.ne[3], node.params["K"]


@reference("SSM_SCAN")
def _ssm_scan_ref(node, s, x, dt, A, B, C, ids):
    K = node.params["K"]
    rows, nh, hd, ds = s.shape
    ns, nt = x.shape[0], x.shape[1]
    ng = B.shape[2]
    idx = ids.reshape(-1)
    check_indices("SSM_SCAN", node, "ids", idx, rows)
    group = np.arange(nh) // (nh // ng)
    Av = A[0, 0]                                         # [nh, 1 or ds]
    y = np.zeros((ns, nt, nh, hd), np.float32)
    states = np.zeros((K, ns, nh, hd, ds), np.float32)   # unwritten slots stay 0 here
    for q in range(ns):
        st = s[idx[q]].copy()                            # [nh, hd, ds]
        for t in range(nt):
            dsp = _softplus(dt[0, q, t])                 # [nh]
            dA = np.exp(dsp[:, None] * Av)               # [nh, 1] or [nh, ds]
            xdt = x[q, t] * dsp[:, None]                 # [nh, hd]
            Bg, Cg = B[q, t][group], C[q, t][group]      # [nh, ds]
            st = st * dA[:, None, :] + Bg[:, None, :] * xdt[:, :, None]
            y[q, t] = np.sum(st * Cg[:, None, :], axis=-1)
            slot = nt - 1 - t
            if 0 <= slot < K:
                states[slot, q] = st
    return np.concatenate([y.reshape(-1), states.reshape(-1)]).reshape(1, 1, 1, -1)


@public("SSM_SCAN", """
>>> ds, hd, nh, T, ns = 16, 4, 2, 3, 1
>>> y = mg.ssm_scan(ctx.new_tensor_4d(mg.f32, ds, hd, nh, ns), ctx.new_tensor_4d(mg.f32, hd, nh, T, ns),
...                 ctx.new_tensor_3d(mg.f32, nh, T, ns), ctx.new_tensor_2d(mg.f32, 1, nh),
...                 ctx.new_tensor_4d(mg.f32, ds, 1, T, ns), ctx.new_tensor_4d(mg.f32, ds, 1, T, ns),
...                 ctx.new_tensor_1d(mg.i32, ns), K=2)
>>> y.ne[0] == hd * nh * T * ns + 2 * ds * hd * nh * ns
True
""")
def ssm_scan(s, x, dt, A, B, C, ids, K=1):
    """ggml_ssm_scan (Mamba-2's selective scan) from the states s[ids]; packs y, then the states
    after the last K tokens (slot 0 = the final state, slot j = j tokens before the end)."""
    return build("SSM_SCAN", s=s, x=x, dt=dt, A=A, B=B, C=C, ids=ids, K=K)


@op("GATED_DELTA_NET", srcs=("q", "k", "v", "g", "beta", "state"), params={"K": int}, split="gated_delta_net",
    ggml=GgmlCall("gated_delta_net", ("q", "k", "v", "g", "beta", "state", "K"), ctypes={"K": "int64_t"}),
    shape="q, k: [S, H_k, T, n_k] with H % H_k == 0, n_seqs % n_k == 0; v: [S, H, T, n_seqs]; "
          "g: [1 or S, H, T, n_seqs]; beta: [1, H, T, n_seqs]; state: [S, S, H, n_seqs] "
          "-> [S*H, T*n_seqs + K*S*n_seqs] (outputs, then K state snapshots)")
def _gdn_rule(q, k, v, g, beta, state, K):
    name = "GATED_DELTA_NET"
    for t in (q, k, v, g, beta, state):
        require(t.type == f32, name, lambda: f"{t.label} must be f32, got {t.type.name}")
    for t in (q, k, v):
        require(t.is_contiguous_rows(), name, lambda: f"{t.label} rows must be contiguous")
    for t in (g, beta, state):
        require(t.is_contiguous(), name, lambda: f"{t.label} must be contiguous")
    S_v, H, T, n_seqs = v.ne
    require(g.ne[0] in (1, S_v) and g.ne[1:] == (H, T, n_seqs), name,
            lambda: f"gate {g.label} must be [1 or {S_v}, {H}, {T}, {n_seqs}], got ne={list(g.ne)}")
    require(beta.ne == (1, H, T, n_seqs), name, lambda: f"beta {beta.label} must be [1, {H}, {T}, {n_seqs}], got ne={list(beta.ne)}")
    require(state.ne == (S_v, S_v, H, n_seqs), name,
            lambda: f"state {state.label} must be [{S_v}, {S_v}, {H}, {n_seqs}], got ne={list(state.ne)}")
    for t in (q, k):
        require(t.ne[0] == S_v and t.ne[2] == T and t.ne[1] > 0 and H % t.ne[1] == 0
                and t.ne[3] > 0 and n_seqs % t.ne[3] == 0, name,
                lambda: f"{t.label} must be [{S_v}, H_k | {H}, {T}, n | {n_seqs}], got ne={list(t.ne)}")
    require(K >= 1, name, lambda: f"K must be >= 1, got {K}")
    return Out(f32, (S_v * H, T * n_seqs + K * S_v * n_seqs))


@state_slots("GATED_DELTA_NET")
def _gdn_slots(node):
    v = node.srcs["v"]
    return v.nelements() * 4, v.ne[0] * v.ne[0] * v.ne[1], v.ne[3], node.params["K"]


@reference("GATED_DELTA_NET")
def _gdn_ref(node, q, k, v, g, beta, state):
    K = node.params["K"]
    ns, T, H, S = v.shape
    hq = np.arange(H) % q.shape[2]
    hk = np.arange(H) % k.shape[2]
    scale = np.float32(1.0 / np.sqrt(np.float32(S)))
    out = np.zeros((ns, T, H, S), np.float32)
    snaps = np.zeros((K, ns, H, S, S), np.float32)       # unwritten slots stay 0 here
    for sq in range(ns):
        sqq, sqk = sq // (ns // q.shape[0]), sq // (ns // k.shape[0])
        M = state[sq].copy()                             # [H, j, i]: M[j][i] = S[i][j]
        for t in range(T):
            qt, kt, vt = q[sqq, t][hq], k[sqk, t][hk], v[sq, t]   # [H, S]
            gt = np.exp(g[sq, t])                        # [H, 1 or S]
            M = M * gt[:, None, :]
            delta = (vt - np.einsum("hji,hi->hj", M, kt)) * beta[sq, t]   # [H, S]
            M = M + delta[:, :, None] * kt[:, None, :]
            out[sq, t] = scale * np.einsum("hji,hi->hj", M, qt)
            slot = T - 1 - t
            if 0 <= slot < K:
                snaps[slot, sq] = M
    flat = np.concatenate([out.reshape(-1), snaps.reshape(-1)])
    return flat.reshape(tuple(reversed(node.ne)))


@public("GATED_DELTA_NET", """
>>> S, H, T, ns = 8, 2, 3, 1
>>> qkv = [ctx.new_tensor_4d(mg.f32, S, H, T, ns) for _ in range(3)]
>>> g, beta = ctx.new_tensor_4d(mg.f32, 1, H, T, ns), ctx.new_tensor_4d(mg.f32, 1, H, T, ns)
>>> mg.gated_delta_net(*qkv, g, beta, ctx.new_tensor_4d(mg.f32, S, S, H, ns), K=2).ne
(16, 19, 1, 1)
""")
def gated_delta_net(q, k, v, g, beta, state, K=1):
    """ggml_gated_delta_net: the gated delta rule per head, from state; packs the outputs, then
    the states after the last K tokens (slot 0 = the final state)."""
    return build("GATED_DELTA_NET", q=q, k=k, v=v, g=g, beta=beta, state=state, K=K)
