"""mul_mat with a half-precision or block-type src0, as ggml's CPU does it.

ggml first converts each f32 row of src1 to the src0 type's vec_dot_type (f16 -> f16, bf16 ->
bf16, q8_0 and q4_0 -> q8_0, q4_k and q6_k -> q8_k; q8_k with the reference quantizer, q8_0 with
the CPU backend's own, see simple.quantize_q8_0_activations), then takes
per block the integer dot product of the two rows' levels and scales it by the blocks' float
scales. Here the integer sums are exact (float64 einsums of small integers) and the per-block
scale products are float32 as in ggml; only the final sum over blocks runs in float64 where ggml
sums in float32 (or in SIMD lanes), so results agree with ggml to float32 rounding and keep the
rounding of both quantizations, which a dequantize-then-multiply would not."""
from __future__ import annotations

import numpy as np

from .kquants import q4_k_parts, q6_k_parts
from .simple import F32, bf16_bits_to_f32, f16_value, f32_to_bf16_bits, quantize_q8_0_activations, quantize_q8_k

_CHUNK = 1 << 22      # values of the per-block partial sums held at once


def _q8_0_parts(raw):
    return f16_value(raw[:, :2]), raw[:, 2:].view(np.int8)


def _q8_k_parts(raw):
    d = np.ascontiguousarray(raw[:, :4]).view(F32).reshape(-1)
    bsums = np.ascontiguousarray(raw[:, 260:292]).view(np.int16)
    return d, raw[:, 4:260].view(np.int8), bsums


def _dots(qa, qb):
    """Integer dot products per group: qa (M, G, g), qb (N, G, g) -> (M, N, G), exact."""
    return np.einsum("mgk,ngk->mng", qa.astype(np.float64), qb.astype(np.float64))


def _rows(fn, a_raw, b, name):
    """Call fn(a_blocks_for_M_rows, b_chunk) over chunks of b's rows to bound memory."""
    m = a_raw.shape[0]
    step = max(1, _CHUNK // max(1, m * a_raw.shape[1]))
    return np.concatenate([fn(a_raw, b[i:i + step]) for i in range(0, b.shape[0], step)], axis=0) \
        if b.shape[0] else np.zeros((0, m), F32)


def _mm_q8_0_like(a_raw, b, name):
    M, nbk = a_raw.shape[0], b.shape[1] // 32
    ab = a_raw.reshape(M * nbk, -1)
    if name == "q8_0":
        da, qa = _q8_0_parts(ab)
    else:                                             # q4_0: nibbles minus 8
        da = f16_value(ab[:, :2])
        qs = ab[:, 2:]
        qa = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
    da, qa = da.reshape(M, nbk), qa.reshape(M, nbk, 32)

    def chunk(_, bc):
        db, qb = _q8_0_parts(quantize_q8_0_activations(bc.reshape(-1, 32)))
        db, qb = db.reshape(-1, nbk), qb.reshape(-1, nbk, 32)
        scale = (da[:, None, :] * db[None, :, :]).astype(F32)              # ggml: d_x * d_y in f32
        return (_dots(qa, qb) * scale).sum(axis=2).T
    return _rows(chunk, a_raw, b, name)


def _mm_q4_k(a_raw, b):
    M, nsb = a_raw.shape[0], b.shape[1] // 256
    d, dmin, ls, lm, q = q4_k_parts(a_raw.reshape(M * nsb, -1))
    d, dmin = d.reshape(M, nsb), dmin.reshape(M, nsb)
    ls, lm = ls.reshape(M, nsb, 8).astype(np.float64), lm.reshape(M, nsb, 8).astype(np.float64)
    qa = q.reshape(M, nsb * 8, 32)

    def chunk(_, bc):
        n = bc.shape[0]
        db, qb, bsums = _q8_k_parts(quantize_q8_k(bc.reshape(-1, 256)))
        db = db.reshape(n, nsb)
        ysum = bsums.reshape(n, nsb, 8, 2).sum(axis=3).astype(np.float64)  # per group of 32
        dots = _dots(qa, qb.reshape(n, nsb * 8, 32)).reshape(M, n, nsb, 8)
        isum = (dots * ls[:, None]).sum(axis=3)                              # (M, n, nsb)
        msum = np.einsum("mbg,nbg->mnb", lm, ysum)
        dd = (d[:, None, :] * db[None]).astype(F32)
        dm = (dmin[:, None, :] * db[None]).astype(F32)
        return (dd * isum - dm * msum).sum(axis=2).T
    return _rows(chunk, a_raw, b, "q4_k")


def _mm_q6_k(a_raw, b):
    M, nsb = a_raw.shape[0], b.shape[1] // 256
    d, sc, q = q6_k_parts(a_raw.reshape(M * nsb, -1))
    d, sc = d.reshape(M, nsb), sc.reshape(M, nsb, 16).astype(np.float64)
    qa = q.reshape(M, nsb * 16, 16)

    def chunk(_, bc):
        n = bc.shape[0]
        db, qb, _ = _q8_k_parts(quantize_q8_k(bc.reshape(-1, 256)))
        dots = _dots(qa, qb.reshape(n, nsb * 16, 16)).reshape(M, n, nsb, 16)
        isum = (dots * sc[:, None]).sum(axis=3)
        dd = (d[:, None, :] * db.reshape(n, nsb)[None]).astype(F32)
        return (dd * isum).sum(axis=2).T
    return _rows(chunk, a_raw, b, "q6_k")


def mul_mat_rows(a_raw: np.ndarray, name: str, b: np.ndarray) -> np.ndarray:
    """a_raw: M rows of raw bytes of type ``name``; b: N rows of K float32 -> (N, M) float32,
    out[n, m] = vec_dot(a row m, b row n converted to the vec_dot type)."""
    b = np.ascontiguousarray(b, dtype=F32)
    if name == "f16":
        a = np.ascontiguousarray(a_raw).view(np.float16).astype(np.float64)
        return (b.astype(np.float16).astype(np.float64) @ a.T).astype(F32)
    if name == "bf16":
        a = bf16_bits_to_f32(np.ascontiguousarray(a_raw).view(np.uint16)).astype(np.float64)
        return (bf16_bits_to_f32(f32_to_bf16_bits(b)).astype(np.float64) @ a.T).astype(F32)
    if name in ("q8_0", "q4_0"):
        return _mm_q8_0_like(a_raw, b, name).astype(F32)
    if name == "q4_k":
        return _mm_q4_k(a_raw, b).astype(F32)
    if name == "q6_k":
        return _mm_q6_k(a_raw, b).astype(F32)
    raise ValueError(f"mul_mat: no vec_dot for src0 type {name}")
