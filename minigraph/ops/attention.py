"""FLASH_ATTN_EXT (ggml_flash_attn_ext): softmax(scale * q k^T [softcapped] + slope * mask) v per
query row, with K/V heads shared by groups of query heads, and the result laid out as ggml's:
[D_v, n_head, n_q, n_seq] (heads before tokens, the permute(0, 2, 1, 3) of the attention output).

Numerics (the reference and every backend): each score is the dot product q.k summed in double
and rounded to f32, then s*scale, softcap*tanh(s) (tanh in double, rounded), + slope*mask in f32,
as ggml forms it; a key whose slope*mask is -inf is skipped. The softmax and the weighted sum of
V rows are done in double and rounded once; a row with every key skipped is 0 (as ggml)."""
from __future__ import annotations

import math

import numpy as np

from ..registry import GgmlCall, Out, Src, build, op, reference, require
from ..types import f16, f32
from .public import public

_F = np.float32


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ggml's ALiBi slope of each head (all 1 when max_bias is 0), f32."""
    if max_bias <= 0:
        return np.ones(n_head, _F)
    n_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = np.power(_F(2), _F(-_F(max_bias) / _F(n_log2)))
    m1 = np.power(_F(2), _F(-(_F(max_bias) / _F(2)) / _F(n_log2)))
    return np.array([np.power(m0, _F(h + 1)) if h < n_log2 else np.power(m1, _F(2 * (h - n_log2) + 1))
                     for h in range(n_head)], _F)


@op("FLASH_ATTN_EXT", srcs=("q", "k", "v", Src("mask", optional=True)),
    params={"scale": float, "max_bias": float, "logit_softcap": float}, split="flash_attn_ext",
    ggml=GgmlCall("flash_attn_ext", ("q", "k", "v", "mask", "scale", "max_bias", "logit_softcap")),
    shape="q: [D_k, n_q, n_head, n_seq] f32; k: [D_k, n_kv, n_head_kv, n_seq] f32 with n_head % n_head_kv == 0; "
          "v: [D_v, n_kv, n_head_v, n_seq] f32 with n_head % n_head_v == 0 (rows contiguous); mask (optional): "
          "[>= n_kv, >= n_q, m2, m3] f16 contiguous with n_head % m2 == 0, n_seq % m3 == 0 "
          "-> [D_v, n_head, n_q, n_seq] f32")
def _flash_attn_ext_rule(q, k, v, scale, max_bias, logit_softcap, mask=None):
    name = "FLASH_ATTN_EXT"
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        require(t.type == f32, name,
                lambda: f"{what} {t.label} must be f32, got {t.type.name} (ggml also takes f16 and "
                                     f"quantized K/V; minigraph does not yet)")
        require(t.is_contiguous_rows(), name, lambda: f"{what} {t.label} rows must be contiguous (nb0 == 4), got nb={list(t.nb)}")
    require(k.ne[0] == q.ne[0], name,
            lambda: f"k {k.label} rows have {k.ne[0]} elements, q {q.label} rows {q.ne[0]} (D_k)")
    require(k.ne[2] > 0 and q.ne[2] % k.ne[2] == 0, name,
            lambda: f"q {q.label} has {q.ne[2]} heads, not a multiple of k {k.label}'s {k.ne[2]}")
    require(v.ne[2] > 0 and q.ne[2] % v.ne[2] == 0, name,
            lambda: f"q {q.label} has {q.ne[2]} heads, not a multiple of v {v.label}'s {v.ne[2]}")
    require(q.ne[3] == k.ne[3] == v.ne[3], name,
            lambda: f"q, k and v must have the same ne3 (sequences), got {q.ne[3]}, {k.ne[3]}, {v.ne[3]}")
    require(v.ne[1] == k.ne[1], name, lambda: f"v {v.label} has {v.ne[1]} rows, k {k.label} {k.ne[1]} (n_kv)")
    if mask is not None:
        require(mask.type == f16 and mask.is_contiguous(), name, lambda: f"mask {mask.label} must be contiguous f16, "
                                                                 f"got {mask.type.name} nb={list(mask.nb)}")
        require(mask.ne[0] >= k.ne[1] and mask.ne[1] >= q.ne[1], name,
                lambda: f"mask {mask.label} ne={list(mask.ne)} must cover n_kv={k.ne[1]} columns and n_q={q.ne[1]} rows")
        require(mask.ne[2] > 0 and mask.ne[3] > 0 and q.ne[2] % mask.ne[2] == 0 and q.ne[3] % mask.ne[3] == 0, name,
                lambda: f"mask {mask.label} ne={list(mask.ne)} must broadcast over q's heads {q.ne[2]} and sequences {q.ne[3]}")
    require(max_bias >= 0, name, lambda: f"max_bias must be >= 0, got {max_bias}")
    require(max_bias == 0 or mask is not None, name, lambda: f"max_bias={max_bias} needs a mask (ggml asserts it)")
    return Out(f32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]))


def scores(p: dict, q, k, mask=None) -> np.ndarray:
    """f32 scores [n_seq, n_head, n_q, n_kv] as every backend forms them (-inf: key skipped)."""
    n_head = q.shape[1]
    kk = np.repeat(k, n_head // k.shape[1], axis=1).astype(np.float64)
    s = np.einsum("shqd,shkd->shqk", q.astype(np.float64), kk).astype(_F)
    scale, cap = _F(p["scale"]), _F(p["logit_softcap"])
    if cap != 0:
        scale = scale / cap
    s = s * scale
    if cap != 0:
        s = cap * np.tanh(s.astype(np.float64)).astype(_F)
    if mask is not None:
        m = mask[:, :, : q.shape[2], : k.shape[2]].astype(_F)
        m = np.tile(m, (q.shape[0] // m.shape[0], n_head // m.shape[1], 1, 1))
        mv = alibi_slopes(n_head, p["max_bias"])[None, :, None, None] * m
        s = np.where(mv == -np.inf, _F(-np.inf), s + mv)
    return s.astype(_F)


@reference("FLASH_ATTN_EXT")
def _flash_attn_ext_ref(node, q, k, v, mask=None):
    s = scores(node.params, q, k, mask).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        mx = np.max(s, axis=-1, keepdims=True)
        w = np.where(s == -np.inf, 0.0, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)))
        den = np.sum(w, axis=-1, keepdims=True)
        vv = np.repeat(v, q.shape[1] // v.shape[1], axis=1).astype(np.float64)
        out = np.einsum("shqk,shkd->shqd", w, vv) / np.where(den == 0, 1.0, den)
    return out.astype(_F).transpose(0, 2, 1, 3)        # [n_seq, n_q, n_head, D_v]


@public("FLASH_ATTN_EXT", """
>>> q = ctx.new_tensor_3d(mg.f32, 64, 5, 8)                  # D_k, 5 query tokens, 8 heads
>>> k, v = ctx.new_tensor_3d(mg.f32, 64, 32, 2), ctx.new_tensor_3d(mg.f32, 64, 32, 2)   # 32 keys, 2 KV heads
>>> mask = ctx.new_tensor_2d(mg.f16, 32, 5)
>>> mg.flash_attn_ext(q, k, v, mask, 0.125, 0.0, 0.0).ne    # [D_v, n_head, n_q, n_seq]
(64, 8, 5, 1)
""")
def flash_attn_ext(q, k, v, mask, scale, max_bias=0.0, logit_softcap=0.0):
    """ggml_flash_attn_ext: attention of each query row over the keys of its KV head
    (q head h reads K/V head h / (n_head / n_head_kv)): softmax(scale*q.k [+ softcap] + slope*mask) v;
    the result is [D_v, n_head, n_q, n_seq], heads before tokens."""
    return build("FLASH_ATTN_EXT", q=q, k=k, v=v, mask=mask, scale=scale, max_bias=max_bias,
                 logit_softcap=logit_softcap)
