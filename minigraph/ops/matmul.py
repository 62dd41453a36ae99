"""mul_mat in ggml's orientation: result[m, n] = sum_k a[k, m] * b[k, n] (ne order), with
b's dims 2/3 broadcasting a's by division."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, build, op, reference, require
from ..types import f32
from .public import public


@op("MUL_MAT", srcs=("a", "b"), split="mul_mat", wide_types=True, ggml=GgmlCall("mul_mat", ("a", "b")),
    shape="a: [K, M, B2, B3], b: [K, N, b2, b3] with b2 % B2 == 0, b3 % B3 == 0 -> [M, N, b2, b3]")
def _mul_mat_rule(a, b):
    name = "MUL_MAT"
    require(a.type == f32 and b.type == f32, name, f"{a.label} and {b.label} must be f32")
    require(a.ne[0] == b.ne[0], name, f"{a.label} ne0={a.ne[0]} must equal {b.label} ne0={b.ne[0]}")
    require(a.ne[2] > 0 and a.ne[3] > 0 and b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, name,
            f"{b.label} ne={list(b.ne)} dims 2/3 must be multiples of {a.label} ne={list(a.ne)}")
    require(not a.is_transposed(), name, f"{a.label} must not be transposed (nb0 <= nb1)")
    require(a.is_contiguous_rows() and b.is_contiguous_rows(), name, f"{a.label} and {b.label} rows must be contiguous")
    return Out(f32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]))


@reference("MUL_MAT")
def _mul_mat_ref(node, a, b):
    r3, r2 = b.shape[0] // a.shape[0], b.shape[1] // a.shape[1]
    ab = np.repeat(np.repeat(a, r3, axis=0), r2, axis=1).astype(np.float64)
    return np.einsum("xymk,xynk->xynm", ab, b.astype(np.float64)).astype(np.float32)


@public("MUL_MAT", """
>>> w = ctx.new_tensor_2d(mg.f32, 4, 3)     # K=4 inputs, M=3 outputs
>>> x = ctx.new_tensor_2d(mg.f32, 4, 2)     # N=2 columns
>>> mg.mul_mat(w, x).ne
(3, 2, 1, 1)
""")
def mul_mat(a, b):
    """ggml_mul_mat: result[m, n] = sum_k a[k, m] * b[k, n], a's dims 2/3 broadcast over b's (f32)."""
    return build("MUL_MAT", a=a, b=b)
