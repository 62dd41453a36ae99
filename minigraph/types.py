"""Element types with ggml's names, type ids, block sizes and byte layouts.

ggml stores some types in blocks: a block of ``blck_size`` consecutive values of dim 0 takes
``type_size`` bytes (q8_0: 32 values in 34 bytes, a half-precision scale then 32 int8). A row
of ``ne0`` values then takes ``type_size * ne0 / blck_size`` bytes (``row_size``), ne0 must be a
multiple of the block size, and nb[0] of such a tensor is ``type_size`` (one block), as in ggml.
Types with ``blck_size == 1`` are plain element types (f32, f16, bf16, i32, i64).

``np_dtype`` is how the bytes are held in NumPy: the value type for f32/f16/i32/i64, the raw
16-bit pattern (uint16) for bf16, which NumPy has no type for, and raw bytes (uint8) for block
types. ``vec_dot_type`` is the type ggml's CPU mul_mat converts the rows of src1 to before the
dot products with a row of this type (q4_0 -> q8_0, q4_K -> q8_K, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    size: int            # bytes per block (ggml_type_size); per element when blck_size == 1
    np_dtype: np.dtype   # storage dtype in NumPy (see the module docstring)
    ggml_id: int         # enum ggml_type: the id in GGUF files and in the oracle tests
    is_float: bool       # holds real numbers (f32, f16, bf16 and the block types)
    blck_size: int = 1   # values per block in dim 0 (ggml_blck_size)
    vec_dot: str = ""    # name of the vec_dot_type; "" means the type itself

    def __repr__(self) -> str:
        return f"mg.{self.name}"

    @property
    def type_size(self) -> int:
        """Bytes per block, ggml_type_size (the same number as ``size``)."""
        return self.size

    @property
    def is_quantized(self) -> bool:
        """A block type (q8_0, q4_0, q4_k, q6_k, q8_k): values are not addressable one by one."""
        return self.blck_size > 1

    @property
    def numpy_native(self) -> bool:
        """The NumPy dtype holds the values themselves (not bf16 bits or raw blocks)."""
        return self.blck_size == 1 and self.name != "bf16"

    @property
    def vec_dot_type(self) -> "DType":
        return _BY_NAME[self.vec_dot or self.name]

    def row_size(self, ne0: int) -> int:
        """Bytes of a row of ``ne0`` values (ggml_row_size); ne0 must be whole blocks."""
        return row_size(self, ne0)


f32 = DType("f32", 4, np.dtype(np.float32), 0, True)
f16 = DType("f16", 2, np.dtype(np.float16), 1, True)
bf16 = DType("bf16", 2, np.dtype(np.uint16), 30, True)
i32 = DType("i32", 4, np.dtype(np.int32), 26, False)
i64 = DType("i64", 8, np.dtype(np.int64), 27, False)
# block types: (scale d as f16, 32 x int8); (d as f16, 16 bytes of 32 4-bit values, offset 8)
q8_0 = DType("q8_0", 34, np.dtype(np.uint8), 8, True, 32, "q8_0")
q4_0 = DType("q4_0", 18, np.dtype(np.uint8), 2, True, 32, "q8_0")
# K-quants, super-blocks of 256: q4_K = d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes
# of 4-bit values; q6_K = 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d (f16);
# q8_K = d (f32), 256 int8, 16 int16 sums of 16 values (only a vec_dot type in ggml's CPU code)
q4_k = DType("q4_k", 144, np.dtype(np.uint8), 12, True, 256, "q8_k")
q6_k = DType("q6_k", 210, np.dtype(np.uint8), 14, True, 256, "q8_k")
q8_k = DType("q8_k", 292, np.dtype(np.uint8), 15, True, 256, "q8_k")

ALL_TYPES = (f32, f16, i32, i64, bf16, q8_0, q4_0, q4_k, q6_k, q8_k)
BLOCK_TYPES = tuple(t for t in ALL_TYPES if t.is_quantized)
_BY_NAME = {t.name: t for t in ALL_TYPES}
_BY_ID = {t.ggml_id: t for t in ALL_TYPES}
_BY_NP = {t.np_dtype: t for t in ALL_TYPES if t.numpy_native}


def row_size(type: DType, ne0: int) -> int:
    """Bytes of ``ne0`` values of ``type`` (ggml_row_size); refuses a partial block."""
    if ne0 % type.blck_size:
        raise ValueError(f"a row of {ne0} values of {type.name} is not whole blocks of {type.blck_size}")
    return type.size * (ne0 // type.blck_size)


def from_ggml_id(ggml_id: int) -> DType:
    try:
        return _BY_ID[int(ggml_id)]
    except KeyError:
        raise TypeError(f"ggml type id {ggml_id} is not supported by minigraph "
                        f"(supported: {', '.join(f'{t.name}={t.ggml_id}' for t in ALL_TYPES)})") from None


def from_numpy_dtype(dtype) -> DType:
    try:
        return _BY_NP[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no minigraph type for NumPy dtype {np.dtype(dtype)}") from None
