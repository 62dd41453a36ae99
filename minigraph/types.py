"""Element types with ggml's names, sizes and type ids."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    size: int            # bytes per element (all types here have block size 1)
    np_dtype: np.dtype
    ggml_id: int         # enum ggml_type, used by the oracle tests
    is_float: bool

    def __repr__(self) -> str:
        return f"mg.{self.name}"


f32 = DType("f32", 4, np.dtype(np.float32), 0, True)
f16 = DType("f16", 2, np.dtype(np.float16), 1, True)
i32 = DType("i32", 4, np.dtype(np.int32), 26, False)
i64 = DType("i64", 8, np.dtype(np.int64), 27, False)

ALL_TYPES = (f32, f16, i32, i64)
_BY_NP = {t.np_dtype: t for t in ALL_TYPES}


def from_numpy_dtype(dtype) -> DType:
    try:
        return _BY_NP[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no minigraph type for NumPy dtype {np.dtype(dtype)}") from None
