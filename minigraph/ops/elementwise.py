"""Elementwise ops: unary math, binary ops with ggml broadcasting, scale / scale_bias.
All f32 (as ggml's CPU backend computes them); `inplace` variants return a view of `a`
and write through into it."""
from __future__ import annotations

import numpy as np

from ..registry import Out, build, op, reference, require
from ..types import f32


def _same_or_view(a, inplace: bool) -> Out:
    if inplace:
        return Out(a.type, a.ne, a.nb, view_of=a, offs=0)
    return Out(a.type, a.ne)


def _softplus(x):
    with np.errstate(over="ignore"):
        return np.where(x > np.float32(20.0), x, np.log(np.float32(1) + np.exp(x))).astype(np.float32)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


def _silu(x):
    with np.errstate(over="ignore"):
        return (x / (np.float32(1) + np.exp(-x))).astype(np.float32)


# ggml name -> NumPy function (float32 in, float32 out)
UNARY = {
    "SILU": _silu,
    "SIGMOID": _sigmoid,
    "SOFTPLUS": _softplus,
    "EXP": np.exp,
    "NEG": np.negative,
    "SQRT": np.sqrt,
}


def _register_unary(name, fn):
    @op(name, srcs=("a",), params={"inplace": bool})
    def rule(a, inplace):
        require(a.type == f32, name, f"{a.label} must be f32, got {a.type.name}")
        require(a.is_contiguous_rows(), name, f"{a.label} rows must be contiguous (nb0 == 4)")
        return _same_or_view(a, inplace)

    @reference(name)
    def ref(node, a):
        with np.errstate(invalid="ignore", over="ignore"):
            return fn(a).astype(np.float32)


for _n, _f in UNARY.items():
    _register_unary(_n, _f)


def silu(a, inplace=False):
    return build("SILU", a=a, inplace=inplace)


def sigmoid(a, inplace=False):
    return build("SIGMOID", a=a, inplace=inplace)


def softplus(a, inplace=False):
    return build("SOFTPLUS", a=a, inplace=inplace)


def exp(a, inplace=False):
    return build("EXP", a=a, inplace=inplace)


def neg(a, inplace=False):
    return build("NEG", a=a, inplace=inplace)


def sqrt(a, inplace=False):
    return build("SQRT", a=a, inplace=inplace)


BINARY = {"ADD": np.add, "SUB": np.subtract, "MUL": np.multiply, "DIV": np.divide}


def can_repeat(t, to) -> bool:
    """ggml_can_repeat: every extent of `to` is a multiple of t's."""
    return t.nelements() > 0 and all(n % m == 0 for n, m in zip(to.ne, t.ne))


def tile_to(b: np.ndarray, shape) -> np.ndarray:
    return np.tile(b, tuple(n // m for n, m in zip(shape, b.shape)))


def _register_binary(name, fn):
    @op(name, srcs=("a", "b"), params={"inplace": bool})
    def rule(a, b, inplace):
        require(a.type == f32 and b.type == f32, name, f"{a.label} and {b.label} must be f32, got {a.type.name}, {b.type.name}")
        require(can_repeat(b, a), name,
                f"{b.label} ne={list(b.ne)} does not broadcast to {a.label} ne={list(a.ne)} (each extent of a must be a multiple of b's)")
        require(a.is_contiguous_rows() and b.is_contiguous_rows(), name, f"{a.label} and {b.label} rows must be contiguous (nb0 == 4)")
        return _same_or_view(a, inplace)

    @reference(name)
    def ref(node, a, b):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(a, tile_to(b, a.shape)).astype(np.float32)


for _n, _f in BINARY.items():
    _register_binary(_n, _f)


def add(a, b, inplace=False):
    return build("ADD", a=a, b=b, inplace=inplace)


def sub(a, b, inplace=False):
    return build("SUB", a=a, b=b, inplace=inplace)


def mul(a, b, inplace=False):
    return build("MUL", a=a, b=b, inplace=inplace)


def div(a, b, inplace=False):
    return build("DIV", a=a, b=b, inplace=inplace)


@op("SCALE", srcs=("a",), params={"s": float, "b": float, "inplace": bool})
def _scale_rule(a, s, b, inplace):
    require(a.type == f32, "SCALE", f"{a.label} must be f32, got {a.type.name}")
    require(a.is_contiguous(), "SCALE", f"{a.label} must be contiguous, got nb={list(a.nb)}")
    return _same_or_view(a, inplace)


@reference("SCALE")
def _scale_ref(node, a):
    s, b = np.float32(node.params["s"]), np.float32(node.params["b"])
    with np.errstate(over="ignore", invalid="ignore"):
        return (a * s if b == 0 else a * s + b).astype(np.float32)


def scale(a, s, inplace=False):
    return build("SCALE", a=a, s=s, b=0.0, inplace=inplace)


def scale_inplace(a, s):
    return build("SCALE", a=a, s=s, b=0.0, inplace=True)


def scale_bias(a, s, b, inplace=False):
    return build("SCALE", a=a, s=s, b=b, inplace=inplace)
