"""mul_mat in ggml's orientation: result[m, n] = sum_k a[k, m] * b[k, n] (ne order), with
b's dims 2/3 broadcasting a's by division."""
from __future__ import annotations

import numpy as np

from ..quants.dot import mul_mat_rows
from ..registry import GgmlCall, Out, build, op, reference, require
from ..types import bf16, f16, f32, q4_0, q4_k, q6_k, q8_0
from .public import public


# src0 types: for the others ggml converts each src1 row to the type's vec_dot_type and takes
# per-block integer (or half-precision) dot products
SRC0_TYPES = (f32, f16, bf16, q8_0, q4_0, q4_k, q6_k)


@op("MUL_MAT", srcs=("a", "b"), split="mul_mat", wide_types=True, ggml=GgmlCall("mul_mat", ("a", "b")),
    shape="a: [K, M, B2, B3] (f32, f16, bf16, q8_0, q4_0, q4_k, q6_k), b: [K, N, b2, b3] f32 with "
          "b2 % B2 == 0, b3 % B3 == 0 -> [M, N, b2, b3] f32")
def _mul_mat_rule(a, b):
    name = "MUL_MAT"
    require(a.type in SRC0_TYPES, name, lambda: f"{a.label} is {a.type.name}; src0 must be one of "
                                        f"{', '.join(t.name for t in SRC0_TYPES)}")
    require(b.type == f32, name, lambda: f"{b.label} must be f32, got {b.type.name}")
    require(a.ne[0] == b.ne[0], name, lambda: f"{a.label} ne0={a.ne[0]} must equal {b.label} ne0={b.ne[0]}")
    require(a.ne[2] > 0 and a.ne[3] > 0 and b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, name,
            lambda: f"{b.label} ne={list(b.ne)} dims 2/3 must be multiples of {a.label} ne={list(a.ne)}")
    require(not a.is_transposed(), name, lambda: f"{a.label} must not be transposed (nb0 <= nb1)")
    require(a.is_contiguous_rows() and b.is_contiguous_rows(), name,
            lambda: f"{a.label} and {b.label} rows must be contiguous")
    return Out(f32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]))


@reference("MUL_MAT")
def _mul_mat_ref(node, a, b):
    r3, r2 = b.shape[0] // a.shape[0], b.shape[1] // a.shape[1]
    kind = node.srcs["a"].type
    if kind != f32:           # ggml's vec_dot arithmetic, one matrix of a at a time
        out = np.empty(b.shape[:3] + (a.shape[2],), np.float32)
        for i3, i2 in np.ndindex(*b.shape[:2]):
            rows = np.ascontiguousarray(a[i3 // r3, i2 // r2])
            out[i3, i2] = mul_mat_rows(rows.view(np.uint8).reshape(rows.shape[0], -1), kind.name, b[i3, i2])
        return out
    ab = np.repeat(np.repeat(a, r3, axis=0), r2, axis=1).astype(np.float64)
    return np.einsum("xymk,xynk->xynm", ab, b.astype(np.float64)).astype(np.float32)


@public("MUL_MAT", """
>>> w = ctx.new_tensor_2d(mg.f32, 4, 3)     # K=4 inputs, M=3 outputs
>>> x = ctx.new_tensor_2d(mg.f32, 4, 2)     # N=2 columns
>>> mg.mul_mat(w, x).ne
(3, 2, 1, 1)
""")
def mul_mat(a, b):
    """ggml_mul_mat: result[m, n] = sum_k a[k, m] * b[k, n], a's dims 2/3 broadcast over b's.
    b is f32; a is f32, or f16/bf16/q8_0/q4_0/q4_k/q6_k, for which b's rows are first converted to
    a's vec_dot_type (f16, bf16, q8_0 or q8_k) and the products are ggml's per-block ones."""
    return build("MUL_MAT", a=a, b=b)
