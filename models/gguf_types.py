"""Which type each weight gets when a model is written as F16, BF16, Q8_0, Q4_0 or Q4_K_M, after
llama.cpp's quantizer (llama-quant.cpp), in its simple, no-importance-matrix form:

  * kept as they are (f32): tensors of fewer than 2 dims (norm weights, biases, ssm_a, ssm_d,
    ssm_dt ...), names not ending in "weight", norm weights ("_norm.weight") and the small
    convolution kernels ("ssm_conv1d", "shortconv.conv.weight");
  * every other weight takes the file type, except for the quantized types:
      - output.weight (or token_embd.weight when the file has no output.weight: they are tied)
        takes Q6_K when its rows are whole 256-blocks, else Q8_0 (a Q8_0 file keeps Q8_0);
      - Q4_K_M: the attention V projections ("attn_v.weight", "attn_qkv.weight", counted in file
        order) and the FFN down projections (counted by layer, out of n_layer) take Q6_K when
        llama.cpp's use_more_bits(i, n) holds: i < n/8, or i >= 7n/8, or (i - n/8) % 3 == 2;
        everything else Q4_K;
  * a weight whose rows are not whole blocks of the chosen type falls back as llama.cpp does:
    Q6_K -> Q8_0; Q4_K -> Q5_0 in llama.cpp, which minigraph does not have, so Q8_0 here; a
    32-block type whose rows are not whole blocks -> F16.
"""
from __future__ import annotations

import minigraph as mg
from minigraph import types as T

# file types: name -> (default weight type, llama.cpp's general.file_type value)
FILE_TYPES = {
    "f32": (T.f32, 0), "f16": (T.f16, 1), "bf16": (T.bf16, 32), "q8_0": (T.q8_0, 7),
    "q4_0": (T.q4_0, 2), "q4_k_m": (T.q4_k, 15),
}
_KEEP = ("_norm.weight", "ssm_conv1d", "shortconv.conv.weight")


def file_type(name: str):
    key = str(name).strip().lower()
    if key not in FILE_TYPES:
        raise ValueError(f"file type {name!r}: valid are {', '.join(FILE_TYPES)}")
    return key


def _quantizable(name: str, ne) -> bool:
    n_dims = max([i + 1 for i, n in enumerate(ne) if n > 1] + [1])
    return n_dims >= 2 and name.endswith("weight") and not any(k in name for k in _KEEP)


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(t, ne0: int):
    if ne0 % t.blck_size == 0:
        return t
    if t.blck_size == 256:
        t = T.q8_0
    return t if ne0 % t.blck_size == 0 else T.f16


def weight_types(tensors: dict, ftype: str, n_layer: int) -> dict:
    """{GGUF name: type} for ``tensors`` ({name: ne in ggml order}, file order) in file type
    ``ftype`` (a FILE_TYPES key)."""
    ftype = file_type(ftype)
    base = FILE_TYPES[ftype][0]
    tied = "output.weight" not in tensors
    n_attn_v = sum(1 for n in tensors if "attn_v.weight" in n or "attn_qkv.weight" in n)
    i_attn_v = 0
    out = {}
    for name, ne in tensors.items():
        if not _quantizable(name, ne) or base == T.f32:
            out[name] = T.f32
            continue
        t = base
        if base.is_quantized:
            if name == "output.weight" or (tied and name == "token_embd.weight"):
                t = base if base == T.q8_0 else (T.q6_k if ne[0] % 256 == 0 else T.q8_0)
            elif ftype == "q4_k_m" and ("attn_v.weight" in name or "attn_qkv.weight" in name):
                t = T.q6_k if _use_more_bits(i_attn_v, n_attn_v) else base
                i_attn_v += 1
            elif ftype == "q4_k_m" and "ffn_down" in name and name.startswith("blk."):
                t = T.q6_k if _use_more_bits(int(name.split(".")[1]), n_layer) else base
            t = _fallback(t, ne[0])
        out[name] = t
    return out


def convert_values(values, t) -> "np.ndarray":  # noqa: F821  (numpy in the caller's hands)
    """f32 values (NumPy order) -> what a tensor of type t holds: the values for f32/f16, bf16's
    bits, or raw block rows."""
    import numpy as np
    x = np.ascontiguousarray(values, dtype=np.float32)
    if t == T.f32:
        return x
    if t == T.f16:
        return x.astype(np.float16)
    raw = mg.quantize(x, t)
    return raw.view(np.uint16) if t == T.bf16 else raw
