"""Copies and layout changes that move data: cpy, cast, cont, concat, repeat."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, Src, build, op, reference, require
from ..tensor import Tensor
from ..quants import quantize_values_cpu
from ..quants.simple import bf16_bits_to_f32, f32_to_bf16_bits
from ..types import DType, bf16, f16, f32, i32, q4_0, q8_0
from .public import public

# type pairs every backend converts (ggml's CPU cpy implements these; f16<->i32 aborts there);
# f32 -> q8_0/q4_0 quantizes whole rows of the source with the reference quantizer
CONVERSIONS = {(f32, f16), (f16, f32), (f32, i32), (i32, f32), (f32, bf16), (bf16, f32),
               (f32, q8_0), (f32, q4_0)}


def convert(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Element conversion as ggml's C does it: float->int truncates toward zero; bf16 (held
    as uint16 bit patterns) rounds to nearest even. Block types take rows of whole blocks
    (the last axis) and give their bytes."""
    if x.dtype == np.uint16 and dtype != bf16:      # bf16 bits: only bf16 is held as uint16
        x = bf16_bits_to_f32(x)
    if x.dtype == dtype.np_dtype:
        return x
    if dtype == bf16:
        return f32_to_bf16_bits(x.astype(np.float32))
    if dtype.is_quantized:
        return quantize_values_cpu(x.astype(np.float32), dtype.name)     # as ggml's CPU cpy does
    if not dtype.is_float and x.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            return np.trunc(x.astype(np.float64)).astype(dtype.np_dtype)
    return x.astype(dtype.np_dtype)


def _check_convert(opname, a: Tensor, t: DType):
    require(a.type == t or (a.type, t) in CONVERSIONS, opname,
            lambda: f"cannot convert {a.label} from {a.type.name} to {t.name} (supported: same type, "
            f"f32<->f16, f32<->bf16, f32<->i32, f32->q8_0, f32->q4_0)")
    if t.is_quantized:
        require(a.type != t, opname, lambda: f"{a.label}: copying {t.name} blocks to {t.name} is not supported")
        require(a.ne[0] % t.blck_size == 0 and a.is_contiguous_rows(), opname,
                lambda: f"{a.label}: quantizing to {t.name} takes contiguous rows of whole blocks "
                f"(ne0={a.ne[0]} must be a multiple of {t.blck_size})")


def _ggml_cpy(g, node, src):
    """ggml_cpy into a destination b, or ggml_cast to a new tensor of another type."""
    if "b" in node.srcs:
        return g.call("cpy", src("a"), src("b"))
    return g.call("cast", src("a"), node.type.ggml_id)


_T = "struct ggml_tensor *"


@op("CPY", srcs=("a", Src("b", optional=True, dest=True)), params={"type": DType}, split="cpy", wide_types=True,
    shape="a: [n0, n1, n2, n3], b: any shape with n0*n1*n2*n3 elements -> b's ne (a view of b); "
          "without b (a cast): [n0, n1, n2, n3] of the new type",
    ggml=GgmlCall(override=_ggml_cpy, cdef=f"{_T} ggml_cpy(struct ggml_context * ctx, {_T} a, {_T} b);\n"
                                           f"{_T} ggml_cast(struct ggml_context * ctx, {_T} a, int type);\n"))
def _cpy_rule(a, type, b=None):
    _check_convert("CPY", a, type)
    if b is None:  # ggml_cast: a new contiguous tensor of the new type
        return Out(type, a.ne)
    require(a.nelements() == b.nelements(), "CPY",
            lambda: f"{a.label} has {a.nelements()} elements, destination {b.label} has {b.nelements()}")
    require(not b.type.is_quantized or b.is_contiguous(), "CPY",
            lambda: f"destination {b.label} of {b.type.name} must be contiguous")
    return Out(b.type, b.ne, b.nb, view_of=b, offs=0)


@reference("CPY")
def _cpy_ref(node, a, b=None):
    flat = a.reshape(-1)  # NumPy order of a 4-D [ne3,ne2,ne1,ne0] array == ggml's logical order
    if node.type.is_quantized:     # blocks of consecutive values, in the destination's rows
        return convert(flat.reshape(-1, node.ne[0]), node.type)
    return convert(flat, node.type).reshape(tuple(reversed(node.ne)))


@public("CPY", """
>>> a, b = ctx.new_tensor_2d(mg.f32, 4, 3), ctx.new_tensor_1d(mg.f16, 12)
>>> mg.cpy(a, b).ne                          # converted to f16 on the way
(12, 1, 1, 1)
""", shape="a: [n0, n1, n2, n3], b: any shape with n0*n1*n2*n3 elements -> b's ne and type (a view of b)")
def cpy(a, b):
    """ggml_cpy: copy a into b's memory in flattened logical order; returns a view of b."""
    return build("CPY", a=a, b=b, type=b.type)


@public("CPY", """
>>> t = mg.cast(ctx.new_tensor_2d(mg.f32, 4, 3), mg.i32)
>>> t.ne, t.type
((4, 3, 1, 1), mg.i32)
""", shape="a: [n0, n1, n2, n3] -> [n0, n1, n2, n3] of the new type (f32<->f16, f32<->bf16, f32<->i32, "
           "f32->q8_0, f32->q4_0)")
def cast(a, type: DType):
    """ggml_cast: a converted to another type (float -> int truncates toward zero)."""
    return build("CPY", a=a, type=type)


@op("CONT", srcs=("a",), params={"ne": tuple}, split="reshape", ggml=GgmlCall("cont_4d", ("a", "@ne")),
    shape="a: any strides, [n0, n1, n2, n3] -> [ne0, ne1, ne2, ne3] contiguous, as many elements")
def _cont_rule(a, ne):
    require(int(np.prod(ne)) == a.nelements(), "CONT",
            lambda: f"{a.label} has {a.nelements()} elements, ne={list(ne)} has {int(np.prod(ne))}")
    return Out(a.type, ne)


@reference("CONT")
def _cont_ref(node, a):
    return np.ascontiguousarray(a).reshape(tuple(reversed(node.ne)))


@public("CONT", """
>>> mg.cont(mg.transpose(ctx.new_tensor_2d(mg.f32, 4, 3))).ne
(3, 4, 1, 1)
""", shape="a: any strides, [n0, n1, n2, n3] -> [n0, n1, n2, n3] contiguous")
def cont(a):
    """ggml_cont: a contiguous copy of a (e.g. of a transposed or permuted view)."""
    return build("CONT", a=a, ne=a.ne)


@public("CONT", """
>>> mg.cont_2d(mg.transpose(ctx.new_tensor_2d(mg.f32, 4, 3)), 6, 2).ne
(6, 2, 1, 1)
""", shape="a: any strides -> [ne0, ne1] contiguous, as many elements")
def cont_2d(a, ne0, ne1):
    """ggml_cont_2d: a contiguous copy of a with new extents."""
    return build("CONT", a=a, ne=(ne0, ne1, 1, 1))


@public("CONT", """
>>> mg.cont_3d(mg.transpose(ctx.new_tensor_2d(mg.f32, 4, 3)), 3, 2, 2).ne
(3, 2, 2, 1)
""", shape="a: any strides -> [ne0, ne1, ne2] contiguous, as many elements")
def cont_3d(a, ne0, ne1, ne2):
    """ggml_cont_3d: a contiguous copy of a with new extents."""
    return build("CONT", a=a, ne=(ne0, ne1, ne2, 1))


@public("CONT", """
>>> mg.cont_4d(mg.transpose(ctx.new_tensor_2d(mg.f32, 4, 3)), 3, 1, 2, 2).ne
(3, 1, 2, 2)
""", shape="a: any strides -> [ne0, ne1, ne2, ne3] contiguous, as many elements")
def cont_4d(a, ne0, ne1, ne2, ne3):
    """ggml_cont_4d: a contiguous copy of a with new extents."""
    return build("CONT", a=a, ne=(ne0, ne1, ne2, ne3))


@op("CONCAT", srcs=("a", "b"), params={"dim": int}, split="concat", ggml=GgmlCall("concat", ("a", "b", "dim")),
    shape="a: [n0, n1, n2, n3], b: the same extents except in dim -> a's extents with ne[dim] = a.ne[dim] + b.ne[dim]")
def _concat_rule(a, b, dim):
    require(0 <= dim < 4, "CONCAT", lambda: f"dim {dim} must be in [0, 4)")
    require(a.type == b.type, "CONCAT", lambda: f"{a.label} is {a.type.name} but {b.label} is {b.type.name}")
    ne = list(a.ne)
    for d in range(4):
        if d == dim:
            ne[d] = a.ne[d] + b.ne[d]
        else:
            require(a.ne[d] == b.ne[d], "CONCAT",
                    lambda: f"{a.label} ne={list(a.ne)} and {b.label} ne={list(b.ne)} differ in dim {d} (concat dim {dim})")
    return Out(a.type, tuple(ne))


@reference("CONCAT")
def _concat_ref(node, a, b):
    return np.concatenate([a, b], axis=3 - node.params["dim"])


@public("CONCAT", """
>>> mg.concat(ctx.new_tensor_2d(mg.f32, 3, 8), ctx.new_tensor_2d(mg.f32, 4, 8), 0).ne
(7, 8, 1, 1)
""")
def concat(a, b, dim=0):
    """ggml_concat: b after a along dim (same type)."""
    return build("CONCAT", a=a, b=b, dim=dim)


@op("REPEAT", srcs=("a",), params={"ne": tuple}, split="generic", ggml=GgmlCall("repeat_4d", ("a", "@ne")),
    shape="a: [m0, m1, m2, m3] -> [ne0, ne1, ne2, ne3] with each ne_i % m_i == 0 (a tiled)")
def _repeat_rule(a, ne):
    ne = tuple(int(x) for x in ne) + (1,) * (4 - len(ne))
    require(a.is_contiguous_rows(), "REPEAT", lambda: f"{a.label} rows must be contiguous (nb0 == {a.type.size})")
    require(a.nelements() > 0 and all(n % m == 0 for n, m in zip(ne, a.ne)), "REPEAT",
            lambda: f"{a.label} ne={list(a.ne)} cannot be tiled to ne={list(ne)} (each extent must divide)")
    return Out(a.type, ne)


@reference("REPEAT")
def _repeat_ref(node, a):
    reps = tuple(n // m for n, m in zip(reversed(node.ne), a.shape))
    return np.tile(a, reps)


@public("REPEAT", """
>>> mg.repeat(ctx.new_tensor_1d(mg.f32, 4), ctx.new_tensor_2d(mg.f32, 8, 3)).ne
(8, 3, 1, 1)
""", shape="a: [m0, m1, m2, m3], b: [n0, n1, n2, n3] with each n_i % m_i == 0 -> [n0, n1, n2, n3] (a tiled)")
def repeat(a, b):
    """ggml_repeat: tile a to b's shape (b's values are not read)."""
    return build("REPEAT", a=a, ne=b.ne)


@public("REPEAT", """
>>> mg.repeat_4d(ctx.new_tensor_1d(mg.f32, 4), 8, 3, 1, 1).ne
(8, 3, 1, 1)
""")
def repeat_4d(a, ne0, ne1, ne2, ne3):
    """ggml_repeat_4d: tile a to [ne0, ne1, ne2, ne3]."""
    return build("REPEAT", a=a, ne=(ne0, ne1, ne2, ne3))
