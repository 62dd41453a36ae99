"""Copies and layout changes that move data: cpy, cast, cont, concat, repeat."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, Src, build, op, reference, require
from ..tensor import Tensor
from ..types import DType, f16, f32, i32

# type pairs every backend converts (ggml's CPU cpy implements these; f16<->i32 aborts there)
CONVERSIONS = {(f32, f16), (f16, f32), (f32, i32), (i32, f32)}


def convert(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Element conversion as ggml's C does it: float->int truncates toward zero."""
    if x.dtype == dtype.np_dtype:
        return x
    if not dtype.is_float and x.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            return np.trunc(x.astype(np.float64)).astype(dtype.np_dtype)
    return x.astype(dtype.np_dtype)


def _check_convert(opname, a: Tensor, t: DType):
    require(a.type == t or (a.type, t) in CONVERSIONS, opname,
            f"cannot convert {a.label} from {a.type.name} to {t.name} (supported: same type, "
            f"f32<->f16, f32<->i32)")


def _ggml_cpy(g, node, src):
    """ggml_cpy into a destination b, or ggml_cast to a new tensor of another type."""
    if "b" in node.srcs:
        return g.call("cpy", src("a"), src("b"))
    return g.call("cast", src("a"), node.type.ggml_id)


_T = "struct ggml_tensor *"


@op("CPY", srcs=("a", Src("b", optional=True, dest=True)), params={"type": DType}, split="cpy",
    ggml=GgmlCall(override=_ggml_cpy, cdef=f"{_T} ggml_cpy(struct ggml_context * ctx, {_T} a, {_T} b);\n"
                                           f"{_T} ggml_cast(struct ggml_context * ctx, {_T} a, int type);\n"))
def _cpy_rule(a, type, b=None):
    _check_convert("CPY", a, type)
    if b is None:  # ggml_cast: a new contiguous tensor of the new type
        return Out(type, a.ne)
    require(a.nelements() == b.nelements(), "CPY",
            f"{a.label} has {a.nelements()} elements, destination {b.label} has {b.nelements()}")
    return Out(b.type, b.ne, b.nb, view_of=b, offs=0)


@reference("CPY")
def _cpy_ref(node, a, b=None):
    flat = a.reshape(-1)  # NumPy order of a 4-D [ne3,ne2,ne1,ne0] array == ggml's logical order
    return convert(flat, node.type).reshape(tuple(reversed(node.ne)))


def cpy(a, b):
    """Copy a into b's memory in flattened logical order; returns a view of b."""
    return build("CPY", a=a, b=b, type=b.type)


def cast(a, type: DType):
    return build("CPY", a=a, type=type)


@op("CONT", srcs=("a",), params={"ne": tuple}, split="reshape", ggml=GgmlCall("cont_4d", ("a", "@ne")))
def _cont_rule(a, ne):
    require(int(np.prod(ne)) == a.nelements(), "CONT",
            f"{a.label} has {a.nelements()} elements, ne={list(ne)} has {int(np.prod(ne))}")
    return Out(a.type, ne)


@reference("CONT")
def _cont_ref(node, a):
    return np.ascontiguousarray(a).reshape(tuple(reversed(node.ne)))


def cont(a):
    return build("CONT", a=a, ne=a.ne)


def cont_2d(a, ne0, ne1):
    return build("CONT", a=a, ne=(ne0, ne1, 1, 1))


def cont_3d(a, ne0, ne1, ne2):
    return build("CONT", a=a, ne=(ne0, ne1, ne2, 1))


def cont_4d(a, ne0, ne1, ne2, ne3):
    return build("CONT", a=a, ne=(ne0, ne1, ne2, ne3))


@op("CONCAT", srcs=("a", "b"), params={"dim": int}, split="concat", ggml=GgmlCall("concat", ("a", "b", "dim")))
def _concat_rule(a, b, dim):
    require(0 <= dim < 4, "CONCAT", f"dim {dim} must be in [0, 4)")
    require(a.type == b.type, "CONCAT", f"{a.label} is {a.type.name} but {b.label} is {b.type.name}")
    ne = list(a.ne)
    for d in range(4):
        if d == dim:
            ne[d] = a.ne[d] + b.ne[d]
        else:
            require(a.ne[d] == b.ne[d], "CONCAT",
                    f"{a.label} ne={list(a.ne)} and {b.label} ne={list(b.ne)} differ in dim {d} (concat dim {dim})")
    return Out(a.type, tuple(ne))


@reference("CONCAT")
def _concat_ref(node, a, b):
    return np.concatenate([a, b], axis=3 - node.params["dim"])


def concat(a, b, dim=0):
    return build("CONCAT", a=a, b=b, dim=dim)


@op("REPEAT", srcs=("a",), params={"ne": tuple}, split="generic", ggml=GgmlCall("repeat_4d", ("a", "@ne")))
def _repeat_rule(a, ne):
    ne = tuple(int(x) for x in ne) + (1,) * (4 - len(ne))
    require(a.is_contiguous_rows(), "REPEAT", f"{a.label} rows must be contiguous (nb0 == {a.type.size})")
    require(a.nelements() > 0 and all(n % m == 0 for n, m in zip(ne, a.ne)), "REPEAT",
            f"{a.label} ne={list(a.ne)} cannot be tiled to ne={list(ne)} (each extent must divide)")
    return Out(a.type, ne)


@reference("REPEAT")
def _repeat_ref(node, a):
    reps = tuple(n // m for n, m in zip(reversed(node.ne), a.shape))
    return np.tile(a, reps)


def repeat(a, b):
    """Tile a to b's shape."""
    return build("REPEAT", a=a, ne=b.ne)


def repeat_4d(a, ne0, ne1, ne2, ne3):
    return build("REPEAT", a=a, ne=(ne0, ne1, ne2, ne3))
