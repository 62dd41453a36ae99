"""The K-quants q4_k and q6_k: super-blocks of 256 with per-group scales fitted by ggml's
searches (a weighted least-squares fit with a min for q4_k, a signed-scale fit for q6_k), all
blocks at once. Sums run position by position in float32, in ggml's order."""
from __future__ import annotations

import numpy as np

from .simple import F32, f16_bytes, f16_value, nearest, safe_inverse, signed_absmax

GROUP_MAX_EPS = F32(1e-15)


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return (a / b).astype(F32)


# -- q4_k -------------------------------------------------------------------------------------
def _fit_scale_min(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """For groups x (g, n) with weights w: levels L in 0..nmax, scale and min so that
    x ~ scale * L - min, searching nstep + 1 candidate inverse scales (ggml's make_qkx2_quants
    without the absolute-error option). Returns (scale, -min, L)."""
    n = x.shape[1]
    mn = np.minimum(x.min(axis=1), F32(0))
    mx = x.max(axis=1)
    sum_w, sum_x = w[:, 0].copy(), w[:, 0] * x[:, 0]
    for i in range(1, n):
        sum_w = sum_w + w[:, i]
        sum_x = sum_x + w[:, i] * x[:, i]
    flat = mx == mn
    rng = np.where(flat, F32(1), mx - mn).astype(F32)
    iscale = _div(F32(nmax), rng)
    scale = _div(F32(1), iscale)
    L = np.clip(nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best = np.zeros_like(sum_w)
    for i in range(n):
        diff = scale * L[:, i].astype(F32) + mn - x[:, i]
        best = best + w[:, i] * (diff * diff)
    for step in range(nstep + 1):
        rng = np.where(flat, F32(1), mx - mn).astype(F32)     # ggml narrows with the min found so far
        iscale = _div(F32(rmin) + F32(rdelta) * F32(step) + F32(nmax), rng)
        Laux = np.clip(nearest(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        lf = Laux.astype(F32)
        sum_l = np.zeros_like(sum_w)
        sum_l2 = np.zeros_like(sum_w)
        sum_xl = np.zeros_like(sum_w)
        for i in range(n):
            wl = w[:, i] * lf[:, i]
            sum_l = sum_l + wl
            sum_l2 = sum_l2 + wl * lf[:, i]
            sum_xl = sum_xl + wl * x[:, i]
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = _div(sum_w * sum_xl - sum_x * sum_l, D)
        this_min = _div(sum_l2 * sum_x - sum_l * sum_xl, D)
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, _div(sum_xl, sum_l2), this_scale)
        err = np.zeros_like(sum_w)
        for i in range(n):
            diff = this_scale * lf[:, i] + this_min - x[:, i]
            err = err + w[:, i] * (diff * diff)
        take = (D > 0) & (err < best) & ~flat
        L = np.where(take[:, None], Laux, L)
        best = np.where(take, err, best)
        scale = np.where(take, this_scale, scale)
        mn = np.where(take, this_min, mn)
    scale = np.where(flat, F32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(F32), (-mn).astype(F32), L


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins -> q4_k's 12 bytes (groups 4..7 split their top bits)."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _unpack_scales_k4(sc: np.ndarray):
    """q4_k's 12 bytes -> (scales, mins), each (n, 8) uint8."""
    ls = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)
    lm = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    return ls, lm


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    groups = x.reshape(nb * 8, 32)
    sum_x2 = np.zeros(nb * 8, F32)
    for i in range(32):
        sum_x2 = sum_x2 + groups[:, i] * groups[:, i]
    av_x = np.sqrt(sum_x2 / F32(32)).astype(F32)
    weights = (av_x[:, None] + np.abs(groups)).astype(F32)
    scales, mins, L = _fit_scale_min(groups, weights, 15, -1.0, 0.1, 20)
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), L.reshape(nb, 256)
    # ggml keeps the running maxima from 0, so negative fits count as 0
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, _div(F32(63), max_scale), F32(0))
    inv_min = np.where(max_min > 0, _div(F32(63), max_min), F32(0))
    ls = np.minimum(63, nearest(inv_scale[:, None] * scales) & 0xFF).astype(np.uint8)
    lm = np.minimum(63, nearest(inv_min[:, None] * mins) & 0xFF).astype(np.uint8)
    d_bytes, dmin_bytes = f16_bytes(max_scale / F32(63)), f16_bytes(max_min / F32(63))
    d = f16_value(d_bytes)[:, None] * ls.astype(F32)
    dm = f16_value(dmin_bytes)[:, None] * lm.astype(F32)
    xg = x.reshape(nb, 8, 32)
    requant = np.clip(nearest(_div(xg + dm[:, :, None], d[:, :, None])), 0, 15)
    L = np.where((d != 0)[:, :, None], requant, L.reshape(nb, 8, 32)).astype(np.uint8)
    qs = (L[:, 0::2, :] | (L[:, 1::2, :] << 4)).reshape(nb, 128)
    return np.concatenate([d_bytes, dmin_bytes, _pack_scales_k4(ls, lm), qs], axis=1)


def q4_k_parts(raw: np.ndarray):
    """q4_k blocks -> (d, dmin) float32 (nb,), (scales, mins) (nb, 8), levels 0..15 (nb, 8, 32)."""
    nb = raw.shape[0]
    d, dmin = f16_value(raw[:, 0:2]), f16_value(raw[:, 2:4])
    ls, lm = _unpack_scales_k4(raw[:, 4:16])
    qs = raw[:, 16:].reshape(nb, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(nb, 8, 32)
    return d, dmin, ls, lm, q


def dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    d, dmin, ls, lm, q = q4_k_parts(raw)
    d1 = d[:, None] * ls.astype(F32)
    m1 = dmin[:, None] * lm.astype(F32)
    return (d1[:, :, None] * q.astype(F32) - m1[:, :, None]).reshape(-1, 256)


# -- q6_k -------------------------------------------------------------------------------------
def _fit_signed_scale(x: np.ndarray, nmax: int):
    """For groups x (g, n): levels in -nmax..nmax-1 and a scale, weighted by x^2, trying 19
    inverse scales around nmax / absmax (ggml's make_qx_quants, rmse_type 1).
    Returns (scale, L + nmax)."""
    n = x.shape[1]
    mx = signed_absmax(x)
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx_safe = np.where(zero, F32(1), mx).astype(F32)
    w = x * x

    def levels(iscale):
        return np.clip(nearest(iscale[:, None] * x), -nmax, nmax - 1)

    def sums(l):
        lf = l.astype(F32)
        sumlx = np.zeros(x.shape[0], F32)
        suml2 = np.zeros(x.shape[0], F32)
        for i in range(n):
            sumlx = sumlx + w[:, i] * x[:, i] * lf[:, i]
            suml2 = suml2 + w[:, i] * lf[:, i] * lf[:, i]
        return sumlx, suml2

    l = levels(_div(F32(-nmax), mx_safe))
    sumlx, suml2 = sums(l)
    scale = np.where(suml2 != 0, _div(sumlx, suml2), F32(0)).astype(F32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        cand = levels(_div(-(F32(nmax) + F32(0.1) * F32(step)), mx_safe))
        sumlx, suml2 = sums(cand)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        l = np.where(take[:, None], cand, l)
        scale = np.where(take, _div(sumlx, suml2), scale)
        best = np.where(take, scale * sumlx, best)
    return np.where(zero, F32(0), scale).astype(F32), np.where(zero[:, None], 0, l + nmax)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    scales, L = _fit_signed_scale(x.reshape(nb * 16, 16), 32)
    scales, L = scales.reshape(nb, 16), L.reshape(nb, 16, 16)
    max_scale = signed_absmax(scales)
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = _div(F32(-128), np.where(empty, F32(1), max_scale))
    d_bytes = f16_bytes(_div(F32(1), iscale))
    sc = np.minimum(127, nearest(iscale[:, None] * scales)).astype(np.int8)
    d = f16_value(d_bytes)[:, None] * sc.astype(F32)
    requant = np.clip(nearest(_div(x.reshape(nb, 16, 16), d[:, :, None])), -32, 31) + 32
    L = np.where((d != 0)[:, :, None], requant, L).reshape(nb, 2, 4, 32).astype(np.uint8)
    ql = np.concatenate([L[:, :, 0] & 0xF | ((L[:, :, 2] & 0xF) << 4),
                         L[:, :, 1] & 0xF | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)
    out[empty] = 0
    return out


def q6_k_parts(raw: np.ndarray):
    """q6_k blocks -> d float32 (nb,), int8 scales (nb, 16), levels -32..31 (nb, 16, 16)."""
    nb = raw.shape[0]
    ql = raw[:, 0:128].reshape(nb, 2, 2, 32)
    qh = raw[:, 128:192].reshape(nb, 2, 1, 32)
    sc = raw[:, 192:208].view(np.int8).reshape(nb, 16)
    d = f16_value(raw[:, 208:210])
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)                     # (nb, 2, 4, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return d, sc, q.reshape(nb, 16, 16)                                   # value order: 16 groups of 16


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    d, sc, q = q6_k_parts(raw)
    dsc = d[:, None] * sc.astype(F32)                                     # scale per 16 values
    return (dsc[:, :, None] * q.astype(F32)).reshape(-1, 256)
