"""Rotary position embedding: ROPE as ggml_rope_ext (NORMAL and NEOX pairing, YaRN scaling,
optional frequency factors) and ggml_rope_multi (multi-section M-RoPE and interleaved IMROPE).

The angle of rotation pair k (k < n_dims/2) at position p is built the way ggml's CPU builds it,
in f32: theta_k = p * theta_scale^k with theta_scale = freq_base^(-2/n_dims), the power taken
by repeated multiplication (theta *= theta_scale, one rounding per pair); divided by the pair's
frequency factor; then YaRN mixes the interpolated angle (freq_scale * theta) with the
extrapolated one through a ramp over the correction dims and scales cos/sin by mscale. Each
a*b + c*d is rounded as fmaf(a, b, c*d), as ggml's CPU library (built with FMA contraction)
computes it: NEOX, MROPE and IMROPE are bit-identical to ggml on the cpu backend; NORMAL differs
by an ulp or so on an odd last rotation pair, which ggml's vectorised build leaves unfused."""
from __future__ import annotations

import math

import numpy as np

from ..registry import GgmlCall, Out, Src, build, op, reference, require
from ..types import f32, i32
from .public import public

# ggml's GGML_ROPE_TYPE_* values
ROPE_NORMAL, ROPE_NEOX, ROPE_MROPE, ROPE_VISION, ROPE_IMROPE = 0, 2, 8, 24, 40
MULTI_MODES = (ROPE_MROPE, ROPE_IMROPE)
SECTIONS = ("sec_t", "sec_h", "sec_w", "sec_e")   # ggml_rope_multi's sections[4], in order

_F = np.float32


def _fma(a, b, c):
    """f32 a*b + c rounded once, as the fmaf that ggml's contracted build uses (through float64:
    the product is exact there; the sum may round twice, off by one ulp in rare ties)."""
    return (np.float64(1) * a * b + c).astype(_F)


def _c_max(x, y):   # C's MAX/MIN macros, as ggml uses them: a NaN operand is not dropped
    return x if x > y else y


def _c_min(x, y):
    return x if x < y else y


def _logf(x) -> np.float32:
    """logf as ggml calls it: the f32 nearest to the exact log (glibc's logf is correctly rounded
    in practice). Not np.log on an f32: NumPy's SIMD float32 log (AVX-512 builds) can be an ulp
    or more away, which moves YaRN's constants and every angle with them."""
    x = float(x)
    if x < 0 or math.isnan(x):
        return _F(math.nan)
    return _F(-math.inf) if x == 0 else _F(math.log(x))


def _powf(x, y) -> np.float32:
    """powf, nearest f32 to the exact power (see _logf)."""
    return _F(math.pow(float(x), float(y)))


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float):
    """The first and last rotation dim YaRN ramps between (ggml_rope_yarn_corr_dims, in f32)."""
    def corr_dim(n_rot):
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = _F(n_ctx_orig) / (_F(n_rot) * _F(2) * _F(math.pi))
            return _F(n_dims) * _logf(ratio) / (_F(2) * _logf(_F(freq_base)))
    start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return _c_max(_F(0), start), _c_min(_F(n_dims - 1), end)


def _ggml_rope_multi(g, node, src):
    """rope_multi takes sections as an int[4] array, which no generic GgmlCall passes."""
    p = node.params
    c = src("c") if "c" in node.srcs else g.ffi.NULL
    floats = (p["freq_base"], p["freq_scale"], p["ext_factor"], p["attn_factor"], p["beta_fast"], p["beta_slow"])
    if p["mode"] in MULTI_MODES:
        sections = g.ffi.new("int[4]", [p[s] for s in SECTIONS])
        return g.lib.ggml_rope_multi(g.ctx, src("a"), src("b"), c, p["n_dims"], sections, p["mode"],
                                     p["n_ctx_orig"], *floats)
    return g.lib.ggml_rope_ext(g.ctx, src("a"), src("b"), c, p["n_dims"], p["mode"], p["n_ctx_orig"], *floats)


_T = "struct ggml_tensor *"
_FL = "float freq_base, float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow"
_ROPE_CDEF = (f"{_T} ggml_rope_ext(struct ggml_context * ctx, {_T} a, {_T} b, {_T} c, int n_dims, int mode, "
              f"int n_ctx_orig, {_FL});\n"
              f"{_T} ggml_rope_multi(struct ggml_context * ctx, {_T} a, {_T} b, {_T} c, int n_dims, int * sections, "
              f"int mode, int n_ctx_orig, {_FL});\n")


@op("ROPE", srcs=("a", "b", Src("c", optional=True)),
    params={"n_dims": int, "mode": int, "n_ctx_orig": int, "freq_base": float, "freq_scale": float,
            "ext_factor": float, "attn_factor": float, "beta_fast": float, "beta_slow": float,
            "sec_t": int, "sec_h": int, "sec_w": int, "sec_e": int},
    split="rope", ggml=GgmlCall(override=_ggml_rope_multi, cdef=_ROPE_CDEF),
    shape="a: [n0, n_head, n_tok, n3] f32, rows contiguous; b: [n_tok] i32 positions ([4*n_tok] for "
          "MROPE/IMROPE: t, h, w, e blocks); c (optional): [>= n_dims/2] f32 frequency factors "
          "-> [n0, n_head, n_tok, n3] (dims >= n_dims copied)")
def _rope_rule(a, b, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
               beta_fast, beta_slow, sec_t, sec_h, sec_w, sec_e, c=None):
    name = "ROPE"
    require(mode & 1 == 0, name, lambda: f"mode={mode}: mode & 1 is no longer supported by ggml")
    require(mode in (ROPE_NORMAL, ROPE_NEOX) + MULTI_MODES, name,
            lambda: f"mode={mode}: minigraph implements NORMAL (0), NEOX (2), MROPE (8) and IMROPE (40); not VISION (24)")
    require(a.type == f32, name, lambda: f"{a.label} must be f32, got {a.type.name} (ggml also takes f16; minigraph does not yet)")
    require(a.is_contiguous_rows(), name, lambda: f"{a.label} rows must be contiguous (nb0 == 4), got nb={list(a.nb)}")
    require(n_dims % 2 == 0 and 0 <= n_dims <= a.ne[0], name,
            lambda: f"n_dims={n_dims} must be even and in [0, ne0={a.ne[0]}] of {a.label}")
    require(b.type == i32, name, lambda: f"positions {b.label} must be i32, got {b.type.name}")
    require(b.ne[1] == b.ne[2] == b.ne[3] == 1 and b.is_contiguous(), name,
            lambda: f"positions {b.label} must be a contiguous vector, got ne={list(b.ne)} nb={list(b.nb)}")
    sections = (sec_t, sec_h, sec_w, sec_e)
    if mode in MULTI_MODES:
        require(b.ne[0] == 4 * a.ne[2], name,
                lambda: f"positions {b.label} has {b.ne[0]} entries; mode {mode} needs 4 per token, 4*ne2 = {4 * a.ne[2]}")
        require(min(sections) >= 0 and max(sec_t, sec_h, sec_w) > 0, name,
                lambda: f"sections={list(sections)} must be >= 0 with one of t, h, w > 0")
        require(sum(sections) <= a.ne[0], name,
                lambda: f"sections={list(sections)} sum past ne0={a.ne[0]} of {a.label}")
    else:
        require(b.ne[0] == a.ne[2], name, lambda: f"positions {b.label} has {b.ne[0]} entries, {a.label} ne2 = {a.ne[2]} tokens")
        require(sections == (0, 0, 0, 0), name,
                lambda: f"sections={list(sections)} are for MROPE/IMROPE only (mode {mode})")
    if c is not None:
        require(c.type == f32 and c.is_contiguous(), name,
                lambda: f"frequency factors {c.label} must be contiguous f32")
        require(c.ne[0] >= n_dims // 2, name, lambda: f"frequency factors {c.label} has {c.ne[0]} entries, fewer than n_dims/2 = {n_dims // 2}")
    require(freq_base > 0 and freq_scale > 0, name,
            lambda: f"freq_base={freq_base} and freq_scale={freq_scale} must be > 0")
    return Out(f32, a.ne)


def rope_constants(p: dict) -> dict:
    """The f32 constants of a ROPE node's angles, as ggml's CPU derives them from the params:
    theta_scale = powf(freq_base, -2.0f/n_dims), YaRN's corr dims (lo, hi), mscale."""
    n_dims = p["n_dims"]
    # -2.0f/n_dims rounds to f32 before powf
    theta_scale = _powf(_F(p["freq_base"]), _F(_F(-2.0) / _F(n_dims))) if n_dims else _F(0)
    lo, hi = yarn_corr_dims(n_dims, p["n_ctx_orig"], p["freq_base"], p["beta_fast"], p["beta_slow"])
    freq_scale, ext = _F(p["freq_scale"]), _F(p["ext_factor"])
    mscale = _F(p["attn_factor"])
    if ext != 0:
        mscale = mscale * _fma(_F(0.1), _logf(_F(1) / freq_scale), _F(1))
    return dict(theta_scale=theta_scale, lo=lo, hi=hi, freq_scale=freq_scale, ext_factor=ext, mscale=mscale)


def rope_angles(p: dict, pos: np.ndarray, n_pairs: int, ff: np.ndarray | None) -> tuple:
    """cos and sin, [n_tok, n_pairs] f32, times mscale; pos is [n_tok] or [4, n_tok] (multi)."""
    mode = p["mode"]
    k_ = rope_constants(p)
    theta_scale, low, high = k_["theta_scale"], k_["lo"], k_["hi"]
    freq_scale, ext, mscale = k_["freq_scale"], k_["ext_factor"], k_["mscale"]
    multi = mode in MULTI_MODES
    base = pos.astype(_F).reshape(4 if multi else 1, -1)     # one row per position stream
    theta = base.copy()
    sec = [p[s] for s in SECTIONS]
    sect_dims = sum(sec)
    cos = np.empty((base.shape[1], n_pairs), _F)
    sin = np.empty_like(cos)
    for k in range(n_pairs):
        if not multi:
            stream = 0
        else:
            s = k % sect_dims
            if mode == ROPE_IMROPE:   # t, h, w interleaved 0,1,2,0,1,2... while each has sections left
                stream = (1 if s % 3 == 1 and s < 3 * sec[1] else 2 if s % 3 == 2 and s < 3 * sec[2]
                          else 0 if s % 3 == 0 and s < 3 * sec[0] else 3)
            else:                     # contiguous blocks t | h | w | e
                stream = 0 if s < sec[0] else 1 if s < sec[0] + sec[1] else 2 if s < sum(sec[:3]) else 3
        extrap = theta[stream] / (_F(ff[k]) if ff is not None else _F(1))
        interp = freq_scale * extrap
        th = interp
        if ext != 0:
            y = (_F(k) - low) / _c_max(_F(0.001), high - low)
            ramp = (_F(1) - _c_min(_F(1), _c_max(_F(0), y))) * ext
            th = _fma(interp, _F(1) - ramp, extrap * ramp)
        cos[:, k] = np.cos(th.astype(np.float64)).astype(_F) * mscale
        sin[:, k] = np.sin(th.astype(np.float64)).astype(_F) * mscale
        theta = (theta * theta_scale).astype(_F)
    return cos, sin


@reference("ROPE")
def _rope_ref(node, a, b, c=None):
    p = node.params
    n_dims = p["n_dims"]
    out = a.astype(_F).copy()                       # [n3, n_tok, n_head, n0]
    if n_dims == 0:
        return out
    half = n_dims // 2
    cos, sin = rope_angles(p, b.reshape(-1), half, None if c is None else c.reshape(-1))
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    if p["mode"] == ROPE_NORMAL:                    # pairs (2k, 2k+1)
        i0, i1 = np.arange(0, n_dims, 2), np.arange(1, n_dims, 2)
    else:                                           # NEOX and multi: pairs (k, k + n_dims/2)
        i0, i1 = np.arange(half), np.arange(half, n_dims)
    x0, x1 = a[..., i0], a[..., i1]
    out[..., i0] = _fma(x0, cos, -(x1 * sin))
    out[..., i1] = _fma(x0, sin, x1 * cos)
    return out


_EXT_DEFAULTS = dict(n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0, attn_factor=1.0,
                     beta_fast=0.0, beta_slow=0.0)


@public("ROPE", """
>>> q, pos = ctx.new_tensor_3d(mg.f32, 64, 8, 5), ctx.new_tensor_1d(mg.i32, 5)   # 8 heads, 5 tokens
>>> mg.rope_ext(q, pos, None, 64, 2, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0).ne   # NEOX
(64, 8, 5, 1)
""", shape="a: [n0, n_head, n_tok, n3] f32, rows contiguous; b: [n_tok] i32 positions; c (optional): "
           "[>= n_dims/2] f32 frequency factors -> [n0, n_head, n_tok, n3]")
def rope_ext(a, b, c, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
             beta_fast, beta_slow):
    """ggml_rope_ext: rotate the first n_dims of each row of a by its token's position b[i2];
    mode 0 (NORMAL) pairs dims (2k, 2k+1), mode 2 (NEOX) pairs (k, k + n_dims/2); YaRN when
    ext_factor != 0; c divides pair k's angle by c[k]."""
    return build("ROPE", a=a, b=b, c=c, n_dims=n_dims, mode=mode, n_ctx_orig=n_ctx_orig, freq_base=freq_base,
                 freq_scale=freq_scale, ext_factor=ext_factor, attn_factor=attn_factor, beta_fast=beta_fast,
                 beta_slow=beta_slow, sec_t=0, sec_h=0, sec_w=0, sec_e=0)


@public("ROPE", """
>>> q, pos = ctx.new_tensor_3d(mg.f32, 64, 8, 5), ctx.new_tensor_1d(mg.i32, 5)
>>> mg.rope(q, pos, 64, 0).ne
(64, 8, 5, 1)
""", shape="a: [n0, n_head, n_tok, n3] f32, rows contiguous; b: [n_tok] i32 -> [n0, n_head, n_tok, n3]")
def rope(a, b, n_dims, mode):
    """ggml_rope: rope_ext with freq_base 10000, no frequency factors and no YaRN."""
    return build("ROPE", a=a, b=b, n_dims=n_dims, mode=mode, **_EXT_DEFAULTS, sec_t=0, sec_h=0, sec_w=0, sec_e=0)


@public("ROPE", """
>>> q, pos = ctx.new_tensor_3d(mg.f32, 64, 8, 5), ctx.new_tensor_1d(mg.i32, 4 * 5)   # t, h, w, e per token
>>> mg.rope_multi(q, pos, None, 64, [11, 11, 10, 0], 40, 262144, 1e7, 1.0, 0.0, 1.0, 32.0, 1.0).ne
(64, 8, 5, 1)
""", shape="a: [n0, n_head, n_tok, n3] f32, rows contiguous; b: [4*n_tok] i32 (all t, then h, w, e); "
           "c (optional): [>= n_dims/2] f32 -> [n0, n_head, n_tok, n3]")
def rope_multi(a, b, c, n_dims, sections, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor,
               beta_fast, beta_slow):
    """ggml_rope_multi: NEOX pairing where pair k takes its position from section stream
    t, h, w or e: in contiguous blocks of sections[0..3] pairs (mode 8, MROPE) or interleaved
    t, h, w, t, h, w, ... (mode 40, IMROPE); the pattern repeats every sum(sections) pairs."""
    if len(sections) != 4:
        raise TypeError(f"rope_multi: sections must have 4 entries, got {list(sections)}")
    return build("ROPE", a=a, b=b, c=c, n_dims=n_dims, mode=mode, n_ctx_orig=n_ctx_orig, freq_base=freq_base,
                 freq_scale=freq_scale, ext_factor=ext_factor, attn_factor=attn_factor, beta_fast=beta_fast,
                 beta_slow=beta_slow, **dict(zip(SECTIONS, sections)))
