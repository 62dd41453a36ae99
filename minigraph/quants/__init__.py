"""ggml's block codecs in NumPy: quantize float32 values into ggml's raw blocks and back.

This package imports only NumPy and sits below the core (the type definitions in
minigraph.types name the same layouts). Every function works on whole arrays at once: the
arithmetic runs on all blocks together, and the only Python loops walk the positions inside
one block (or the search steps of the K-quant scale fits), never the blocks.

The arithmetic is ggml's reference code's, operation by operation in float32 (its build of
these functions uses plain SSE float math, no fused multiply-add), so the bytes agree with
ggml_quantize_chunk without an importance matrix, and the values with the type's to_float, for
finite inputs. (A NaN, or an inf in a q6_k block, gives whatever C's float-to-int conversion
gives there; those bytes are not reproduced.)
Rounding helpers:
  * ``_nearest``: ggml's nearest_int, which adds 1.5 * 2^23 in float32, i.e. round half to even;
  * ``_round_away``: C's roundf (half away from zero), used by q8_0;
  * half-precision scales are rounded to nearest even (NumPy's float32 -> float16).

Layouts (little-endian, bytes per block):
  q8_0 (34): d f16, 32 x int8
  q4_0 (18): d f16, 16 bytes: value j in the low nibble of byte j, value j+16 in its high nibble
  q4_k (144): d f16, dmin f16, 12 bytes of 6-bit scales and mins for 8 groups of 32, then 128
              bytes: groups 2i and 2i+1 share 32 bytes (low nibbles, high nibbles)
  q6_k (210): 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales (groups of 16), d f16
  q8_k (292): d f32, 256 x int8, 16 int16 sums of 16 consecutive values
"""
from __future__ import annotations

import numpy as np

from .kquants import dequantize_q4_k, dequantize_q6_k, quantize_q4_k, quantize_q6_k
from .simple import (bf16_bits_to_f32, dequantize_q4_0, dequantize_q8_0, dequantize_q8_k,
                     f32_to_bf16_bits, quantize_q4_0, quantize_q8_0, quantize_q8_0_activations,
                     quantize_q8_k)

# name -> (values per block, bytes per block)
LAYOUTS = {"f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
           "q4_k": (256, 144), "q6_k": (256, 210), "q8_k": (256, 292)}

_QUANTIZE = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "q4_k": quantize_q4_k,
             "q6_k": quantize_q6_k, "q8_k": quantize_q8_k}
_DEQUANTIZE = {"q8_0": dequantize_q8_0, "q4_0": dequantize_q4_0, "q4_k": dequantize_q4_k,
               "q6_k": dequantize_q6_k, "q8_k": dequantize_q8_k}


def quantize_values(x: np.ndarray, name: str) -> np.ndarray:
    """float32 values (any shape, last axis whole blocks) -> raw bytes, shape[:-1] + (row bytes,)."""
    blck, size = LAYOUTS[name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    lead = x.shape[:-1]
    if name == "f16":
        with np.errstate(over="ignore"):          # beyond 65504 is inf, as in ggml
            return x.astype(np.float16).view(np.uint8).reshape(lead + (-1,))
    if name == "bf16":
        return f32_to_bf16_bits(x).view(np.uint8).reshape(lead + (-1,))
    blocks = x.reshape(-1, blck)
    return _QUANTIZE[name](blocks).reshape(lead + (x.shape[-1] // blck * size,))


def quantize_values_cpu(x: np.ndarray, name: str) -> np.ndarray:
    """As quantize_values, but as ggml's CPU backend converts inside a graph (cpy into a block
    tensor, mul_mat's src1): the same except q8_0, which it quantizes with its x86 SIMD routine
    (see simple.quantize_q8_0_activations)."""
    if name != "q8_0":
        return quantize_values(x, name)
    x = np.ascontiguousarray(x, dtype=np.float32)
    return quantize_q8_0_activations(x.reshape(-1, 32)).reshape(x.shape[:-1] + (x.shape[-1] // 32 * 34,))


def dequantize_values(raw: np.ndarray, name: str) -> np.ndarray:
    """Raw bytes (last axis whole blocks) -> float32 values, shape[:-1] + (values per row,)."""
    blck, size = LAYOUTS[name]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead = raw.shape[:-1]
    if name == "f16":
        return raw.view(np.float16).astype(np.float32).reshape(lead + (-1,))
    if name == "bf16":
        return bf16_bits_to_f32(raw.view(np.uint16)).reshape(lead + (-1,))
    blocks = raw.reshape(-1, size)
    return _DEQUANTIZE[name](blocks).reshape(lead + (raw.shape[-1] // size * blck,))
