"""The one-scale codecs: bf16, q8_0, q4_0 and q8_k (ggml's reference arithmetic, in float32)."""
from __future__ import annotations

import numpy as np

F32 = np.float32


def nearest(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: float32 round half to even (it adds 1.5 * 2^23 and reads the bits).
    Non-finite inputs (a division by a zero scale, masked out by the callers) give garbage."""
    with np.errstate(invalid="ignore"):
        return np.rint(v.astype(F32)).astype(np.int32)


def round_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: half away from zero (exact in float64 for float32 inputs)."""
    v = v.astype(np.float64)
    return (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int32)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 scales -> their half-precision bytes, (n, 2)."""
    return v.astype(F32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def f16_value(raw2: np.ndarray) -> np.ndarray:
    """(n, 2) half-precision bytes -> float32 (n,)."""
    return np.ascontiguousarray(raw2).view(np.float16).reshape(-1).astype(F32)


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per row, the value of largest magnitude; the first one on ties (ggml's strict '<' scan)."""
    return np.take_along_axis(x, np.argmax(np.abs(x), axis=-1)[..., None], axis=-1)[..., 0]


def safe_inverse(d: np.ndarray) -> np.ndarray:
    """1/d in float32, 0 where d is 0 (ggml's ``d ? 1.0f/d : 0.0f``)."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


# -- bf16 -------------------------------------------------------------------------------------
def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even on the top 16 bits; a NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(x, dtype=F32).view(np.uint32)
    rounded = ((u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(F32)


# -- q8_0: d = absmax / 127, values roundf(x / d) ------------------------------------------------
def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    amax = np.abs(x).max(axis=1)
    d = (amax / F32(127)).astype(F32)
    q = round_away(x * safe_inverse(d)[:, None]).astype(np.int8)
    return np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=1)


def quantize_q8_0_activations(x: np.ndarray) -> np.ndarray:
    """q8_0 as ggml's CPU backend converts mul_mat's src1 rows on x86 (its AVX quantizer): the
    same scale d, but the values are x * (127 / absmax) rounded half to even, where the reference
    quantizer above takes x * (1 / d) rounded half away from zero; the two differ near ties."""
    amax = np.abs(x).max(axis=1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / np.where(amax != 0, amax, F32(1)), F32(0)).astype(F32)
    q = nearest(x * inv[:, None]).astype(np.int8)
    return np.concatenate([f16_bytes(d), q.view(np.uint8)], axis=1)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    d = f16_value(raw[:, :2])
    return raw[:, 2:].view(np.int8).astype(F32) * d[:, None]


# -- q4_0: d = (signed absmax) / -8, values min(15, trunc(x / d + 8.5)) -------------------------
def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    d = (signed_absmax(x) / F32(-8)).astype(F32)
    scaled = x * safe_inverse(d)[:, None]
    q = np.minimum(15, np.trunc(scaled + F32(8.5)).astype(np.int32)).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([f16_bytes(d), packed], axis=1)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    d = f16_value(raw[:, :2])
    qs = raw[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32) - 8
    return q.astype(F32) * d[:, None]


# -- q8_k: the K-quants' vec_dot partner: d = 1 / (-127 / signed absmax), f32, with sums -------
def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    mx = signed_absmax(x)
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, F32(0), F32(-127) / np.where(zero, F32(1), mx)).astype(F32)
    q = np.minimum(127, nearest(x * iscale[:, None]))
    q = np.where(zero[:, None], 0, q).astype(np.int8)
    bsums = q.astype(np.int16).reshape(-1, 16, 16).sum(axis=2, dtype=np.int16)
    with np.errstate(divide="ignore"):
        d = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), iscale)).astype(F32)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), q.view(np.uint8),
                           bsums.view(np.uint8)], axis=1)


def dequantize_q8_k(raw: np.ndarray) -> np.ndarray:
    d = np.ascontiguousarray(raw[:, :4]).view(F32).reshape(-1)
    return raw[:, 4:260].view(np.int8).astype(F32) * d[:, None]
