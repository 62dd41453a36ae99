"""Index ops: get_rows, set_rows (write-through into a destination), arange."""
from __future__ import annotations

import math

import numpy as np

from ..errors import OpError
from ..registry import GgmlCall, Out, Src, build, op, reference, require
from ..quants import dequantize_values
from ..types import bf16, f16, f32, i32, i64, q4_0, q4_k, q6_k, q8_0
from .copy import convert
from .public import public


def check_indices(opname: str, node, idx_name: str, idx: np.ndarray, limit: int):
    """Raise before anything is written when an index is negative or >= limit."""
    if idx.size and (idx.min() < 0 or idx.max() >= limit):
        bad = int(idx[(idx < 0) | (idx >= limit)].flat[0])
        raise OpError(f"{opname} {node.label}: index {bad} in {node.srcs[idx_name].label} "
                      f"is out of range [0, {limit})")


ROW_TYPES = (f32, f16, bf16, q8_0, q4_0, q4_k, q6_k, i32)   # bf16 and blocks through to_float


@op("GET_ROWS", srcs=("a", "b"), split="get_rows", wide_types=True, ggml=GgmlCall("get_rows", ("a", "b")),
    shape="a: [n0, R, n2, n3] (f32, f16, bf16, q8_0, q4_0, q4_k, q6_k or i32), b: [n, n2, n3] i32 row "
          "indices < R -> [n0, n, n2, n3] (f32; i32 for i32 rows)")
def _get_rows_rule(a, b):
    require(b.type == i32, "GET_ROWS", lambda: f"indices {b.label} must be i32, got {b.type.name}")
    require(a.type in ROW_TYPES, "GET_ROWS", lambda: f"rows {a.label} must be one of "
                                             f"{', '.join(t.name for t in ROW_TYPES)}, got {a.type.name}")
    require(a.ne[2] == b.ne[1] and a.ne[3] == b.ne[2], "GET_ROWS",
            lambda: f"{a.label} ne={list(a.ne)} and indices {b.label} ne={list(b.ne)}: need a.ne2 == b.ne1 and a.ne3 == b.ne2")
    require(b.ne[3] == 1, "GET_ROWS", lambda: f"indices {b.label} must have ne3 == 1, got ne={list(b.ne)}")
    require(a.is_contiguous_rows(), "GET_ROWS", lambda: f"rows {a.label} must be contiguous (nb0 == {a.type.size})")
    out_type = i32 if a.type == i32 else f32
    return Out(out_type, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]))


@reference("GET_ROWS")
def _get_rows_ref(node, a, b):
    idx = b[0]                                    # [ne2(b), ne1(b), ne0(b)] = [k, j, i]
    check_indices("GET_ROWS", node, "b", idx, a.shape[2])
    k = np.arange(idx.shape[0])[:, None, None]
    j = np.arange(idx.shape[1])[None, :, None]
    rows = a[k, j, idx]                           # out[k, j, i, :] = a[k, j, idx[k,j,i], :]
    kind = node.srcs["a"].type
    if kind.is_quantized or kind == bf16:          # raw rows -> ggml's to_float
        return dequantize_values(rows.view(np.uint8), kind.name)
    return convert(rows, node.type)


@public("GET_ROWS", """
>>> embd, ids = ctx.new_tensor_2d(mg.f32, 8, 100), ctx.new_tensor_1d(mg.i32, 5)   # 100 rows of 8
>>> mg.get_rows(embd, ids).ne
(8, 5, 1, 1)
""")
def get_rows(a, b):
    """ggml_get_rows: result row i (of each matrix) is row b[i] of a."""
    return build("GET_ROWS", a=a, b=b)


@op("SET_ROWS", srcs=("b", "c", Src("a", dest=True)), split="set_rows",
    ggml=GgmlCall("set_rows", ("a", "b", "c")),   # ggml_set_rows(ctx, a = dst, b, c)
    shape="a (destination): [n0, R, n2, n3] f32/f16, b: [n0, n, n2, n3] f32/f16, c: [n, c2, c3] i32/i64 "
          "indices < R with n2 % c2 == 0, n3 % c3 == 0 -> [n0, R, n2, n3] (a view of a)")
def _set_rows_rule(a, b, c):
    name = "SET_ROWS"
    require(a.ne[0] == b.ne[0], name, lambda: f"destination {a.label} rows have {a.ne[0]} elements, source {b.label} rows {b.ne[0]}")
    require(a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], name,
            lambda: f"destination {a.label} ne={list(a.ne)} and source {b.label} ne={list(b.ne)} differ in dims 2/3")
    require(b.ne[1] == c.ne[0], name,
            lambda: f"source {b.label} has {b.ne[1]} rows but indices {c.label} have {c.ne[0]}")
    require(c.ne[1] > 0 and c.ne[2] > 0 and b.ne[2] % c.ne[1] == 0 and b.ne[3] % c.ne[2] == 0, name,
            lambda: f"indices {c.label} ne={list(c.ne)} must broadcast over source {b.label} ne={list(b.ne)} (b.ne2 % c.ne1 == 0, b.ne3 % c.ne2 == 0)")
    require(c.ne[3] == 1, name, lambda: f"indices {c.label} must have ne3 == 1")
    require(b.type in (f32, f16), name, lambda: f"source {b.label} must be f32 or f16, got {b.type.name}")
    require(c.type in (i32, i64), name, lambda: f"indices {c.label} must be i32 or i64, got {c.type.name}")
    require(a.type in (f32, f16), name, lambda: f"destination {a.label} must be f32 or f16, got {a.type.name}")
    require(a.is_contiguous_rows(), name,
            lambda: f"destination {a.label} rows must be contiguous (nb0 == {a.type.size})")
    require(b.is_contiguous_rows(), name, lambda: f"source {b.label} rows must be contiguous (nb0 == {b.type.size})")
    return Out(a.type, a.ne, a.nb, view_of=a, offs=0)


@reference("SET_ROWS")
def _set_rows_ref(node, a, b, c):
    n3, n2, n1 = b.shape[0], b.shape[1], b.shape[2]
    idx = np.tile(c[0], (n3 // c.shape[1], n2 // c.shape[2], 1))   # modulo broadcast over dims 3, 2
    check_indices("SET_ROWS", node, "c", idx, a.shape[2])
    out = a.copy()
    i3 = np.arange(n3)[:, None, None]
    i2 = np.arange(n2)[None, :, None]
    out[i3, i2, idx] = convert(b, node.type)
    return out


@public("SET_ROWS", """
>>> cache = ctx.new_tensor_2d(mg.f32, 8, 10)      # 10 rows of 8
>>> rows, at = ctx.new_tensor_2d(mg.f32, 8, 3), ctx.new_tensor_1d(mg.i32, 3)
>>> mg.set_rows(cache, rows, at).ne
(8, 10, 1, 1)
""")
def set_rows(a, b, c):
    """ggml_set_rows: write row i of b into row c[i] of a; returns a view of a."""
    return build("SET_ROWS", a=a, b=b, c=c)


@op("ARANGE", params={"start": float, "stop": float, "step": float}, split="mirrored",
    ggml=GgmlCall("arange", ("start", "stop", "step")),
    shape="no sources -> [ceil((stop - start) / step)] f32: start, start + step, ...")
def _arange_rule(start, stop, step):
    require(stop > start and step > 0, "ARANGE",
            lambda: f"start={start}, stop={stop}, step={step}: ggml needs stop > start and step > 0")
    n = math.ceil(float((np.float32(stop) - np.float32(start)) / np.float32(step)))  # ceilf in f32
    require(n > 0, "ARANGE", lambda: f"start={start}, stop={stop}, step={step} gives no elements in f32")
    return Out(f32, (n,))


@reference("ARANGE")
def _arange_ref(node):
    p = node.params
    i = np.arange(node.ne[0], dtype=np.float32)
    return (np.float32(p["start"]) + np.float32(p["step"]) * i).reshape(1, 1, 1, -1)


@public("ARANGE", """
>>> mg.arange(ctx, 0.0, 4.0, 1.0).ne
(4, 1, 1, 1)
""")
def arange(ctx, start, stop, step=1.0):
    """ggml_arange: the f32 values start, start+step, ... below stop; ctx holds the new node."""
    return build("ARANGE", ctx, start=start, stop=stop, step=step)
