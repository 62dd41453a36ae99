"""mg.quantize / mg.dequantize: float32 values to a type's raw bytes and back, byte for byte as
ggml's quantize_chunk (no importance matrix) and the type's to_float.

Raw bytes are a uint8 NumPy array whose last axis is one row's bytes (row_size(type, ne0)), the
form ``Tensor.set`` takes and ``Tensor.numpy`` gives for block types. f16 and bf16 round to
nearest even (bf16 keeps NaNs quiet, as ggml); the block types follow ggml's reference
quantizers (see minigraph.quants for the layouts)."""
from __future__ import annotations

import numpy as np

from .errors import OpError
from .quants import dequantize_values, quantize_values
from .tensor import Tensor, as_type
from .types import row_size

_CODEC_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "q8_k")


def _codec_type(type, what: str):
    t = as_type(type)
    if t.name not in _CODEC_TYPES:
        raise OpError(f"{what}: type {t.name} has no codec (types: {', '.join(_CODEC_TYPES)})")
    return t


def quantize(array, type) -> np.ndarray:
    """float values (NumPy order, last axis = ne0, a multiple of the block size) -> raw bytes
    of ``type``, shape array.shape[:-1] + (row bytes,), as uint8.

    >>> mg.quantize(np.ones((2, 32), np.float32), mg.q8_0).shape    # 2 rows of one 34-byte block
    (2, 34)
    """
    t = _codec_type(type, "quantize")
    x = np.asarray(array, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % t.blck_size:
        raise OpError(f"quantize to {t.name}: the last axis ({x.shape[-1] if x.ndim else 'none'}) "
                      f"must be a multiple of the block size {t.blck_size}")
    return quantize_values(x, t.name)


def dequantize(data, type=None, shape=None) -> np.ndarray:
    """Raw bytes of ``type`` (a uint8 array or bytes; or a Tensor of a codec type, read back)
    -> float32 values. ``shape`` (NumPy order) reshapes the result; by default the raw array's
    leading axes are kept and its last axis becomes the row's values.

    >>> raw = mg.quantize(np.arange(64, dtype=np.float32).reshape(2, 32), mg.q8_0)
    >>> mg.dequantize(raw, mg.q8_0)[1, :3]
    array([32.     , 33.03125, 33.96875], dtype=float32)
    """
    if isinstance(data, Tensor):
        t = data.type if type is None else as_type(type)
        if t is not data.type:
            raise OpError(f"dequantize {data.label}: it holds {data.type.name}, not {t.name}")
        t = _codec_type(t, f"dequantize {data.label}")
        raw = data.numpy().view(np.uint8)
        shape = data.shape if shape is None else shape
        raw = raw.reshape(raw.shape[:-1] + (-1,)) if raw.ndim else raw
    else:
        if type is None:
            raise OpError("dequantize: give the type of the raw bytes (type=mg.q8_0, ...)")
        t = _codec_type(type, "dequantize")
        raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
            else np.asarray(data)
        if raw.dtype != np.uint8:
            raw = np.ascontiguousarray(raw).view(np.uint8)
        if raw.ndim == 0:
            raise OpError(f"dequantize {t.name}: expected raw bytes, got a scalar")
        if shape is not None:
            ne0 = int(shape[-1]) if len(shape) else 1
            if ne0 % t.blck_size or raw.size % row_size(t, ne0):
                raise OpError(f"dequantize {t.name}: {raw.size} bytes do not hold rows of {ne0} values "
                              f"(shape {tuple(shape)}, blocks of {t.blck_size} in {t.size} bytes)")
            raw = raw.reshape(-1, row_size(t, ne0))
    if raw.shape[-1] % t.size:
        raise OpError(f"dequantize {t.name}: a row of {raw.shape[-1]} bytes is not whole blocks of {t.size}")
    out = dequantize_values(raw, t.name)
    return out.reshape(tuple(shape)) if shape is not None else out
