"""Elementwise ops: unary math, binary ops with ggml broadcasting, scale / scale_bias.
All f32 (as ggml's CPU backend computes them); `inplace` variants return a view of `a`
and write through into it.

A unary op is one `unary(...)` line below: the registry entry (shape rule, reference, ggml
call, meta split rule, test cases) and the public function `mg.<name>` come from it."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, Src, build, cases, op, reference, require
from ..types import f32
from .public import public

__all__ = ["add", "sub", "mul", "div", "scale", "scale_inplace", "scale_bias"]   # + every unary()


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


UNARY: dict = {}   # op name -> NumPy function (float32 in, float32 out)


def unary(name: str, fn, *, exact: bool = False, data=None):
    """Register the f32 unary op ``name`` computing ``fn`` (ggml's ggml_<name>, with an
    _inplace variant) and return its public function ``<name>(a, inplace=False)``.
    ``exact``: backends must match the reference bit for bit; ``data``: a transform of the
    random test data into the op's domain (e.g. np.abs for sqrt)."""
    UNARY[name] = fn

    @op(name, srcs=(Src("a", inplace=True),), params={"inplace": bool}, split="generic",
        ggml=GgmlCall(name.lower(), ("a",)), cases=cases("unary", exact=exact, data=data),
        shape="a: [n0, n1, n2, n3] f32, rows contiguous -> [n0, n1, n2, n3] f32")
    def rule(a, inplace):
        require(a.type == f32, name, lambda: f"{a.label} must be f32, got {a.type.name}")
        require(a.is_contiguous_rows(), name, lambda: f"{a.label} rows must be contiguous (nb0 == 4)")
        return _same_or_view(a, inplace)

    @reference(name)
    def ref(node, a):
        with np.errstate(invalid="ignore", over="ignore"):
            return fn(a).astype(np.float32)

    def api(a, inplace=False):
        return build(name, a=a, inplace=inplace)
    api.__name__ = api.__qualname__ = name.lower()
    api.__doc__ = f"ggml_{name.lower()}: {name.lower()}(x) for every element of a."
    public(name, f">>> mg.{api.__name__}(ctx.new_tensor_2d(mg.f32, 4, 3)).ne\n(4, 3, 1, 1)")(api)
    __all__.append(api.__name__)
    return api


def _times30(x):
    return x * np.float32(30)   # crosses softplus's x > 20 branch


def _gelu(x):
    """ggml's CPU GELU on f32 (the tanh approximation through its f16 table): 0 for x <= -10,
    x for x >= 10, else gelu_tanh of x rounded to f16, the result rounded to f16. The inner
    1 + 0.044715*x*x is one fused multiply-add, as ggml's build contracts it."""
    h = x.astype(np.float16).astype(np.float32)
    inner = ((np.float32(0.044715) * h).astype(np.float64) * h + 1.0).astype(np.float32)
    t = np.tanh((np.float32(0.7978845608028654) * h * inner).astype(np.float64)).astype(np.float32)
    g = (np.float32(0.5) * h * (np.float32(1) + t)).astype(np.float16).astype(np.float32)
    return np.where(x <= np.float32(-10), np.float32(0), np.where(x >= np.float32(10), x, g)).astype(np.float32)


silu = unary("SILU", _silu)
sigmoid = unary("SIGMOID", _sigmoid)
softplus = unary("SOFTPLUS", _softplus, data=_times30)
exp = unary("EXP", np.exp)
neg = unary("NEG", np.negative, exact=True)
sqrt = unary("SQRT", np.sqrt, data=np.abs)
gelu = unary("GELU", _gelu, data=_times30)


BINARY = {"ADD": np.add, "SUB": np.subtract, "MUL": np.multiply, "DIV": np.divide}


def can_repeat(t, to) -> bool:
    """ggml_can_repeat: every extent of `to` is a multiple of t's."""
    return t.nelements() > 0 and all(n % m == 0 for n, m in zip(to.ne, t.ne))


def tile_to(b: np.ndarray, shape) -> np.ndarray:
    return np.tile(b, tuple(n // m for n, m in zip(shape, b.shape)))


def _register_binary(name, fn):
    @op(name, srcs=(Src("a", inplace=True), "b"), params={"inplace": bool}, split="bin_bcast",
        ggml=GgmlCall(name.lower(), ("a", "b")), cases=cases("binary", exact=name != "DIV"),
        shape="a: [n0, n1, n2, n3] f32, b: [m0, m1, m2, m3] f32 with each n_i % m_i == 0 "
              "(b tiled over a) -> [n0, n1, n2, n3]")
    def rule(a, b, inplace):
        require(a.type == f32 and b.type == f32, name, lambda: f"{a.label} and {b.label} must be f32, got {a.type.name}, {b.type.name}")
        require(can_repeat(b, a), name,
                lambda: f"{b.label} ne={list(b.ne)} does not broadcast to {a.label} ne={list(a.ne)} (each extent of a must be a multiple of b's)")
        require(a.is_contiguous_rows() and b.is_contiguous_rows(), name, lambda: f"{a.label} and {b.label} rows must be contiguous (nb0 == 4)")
        return _same_or_view(a, inplace)

    @reference(name)
    def ref(node, a, b):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(a, tile_to(b, a.shape)).astype(np.float32)


for _n, _f in BINARY.items():
    _register_binary(_n, _f)


@public("ADD", """
>>> x, bias = ctx.new_tensor_2d(mg.f32, 4, 3), ctx.new_tensor_1d(mg.f32, 4)
>>> mg.add(x, bias).ne                    # bias repeats over the 3 rows
(4, 3, 1, 1)
""")
def add(a, b, inplace=False):
    """ggml_add: a + b elementwise, b broadcast over a."""
    return build("ADD", a=a, b=b, inplace=inplace)


@public("SUB", """
>>> x, bias = ctx.new_tensor_2d(mg.f32, 4, 3), ctx.new_tensor_1d(mg.f32, 4)
>>> mg.sub(x, bias).ne                    # bias repeats over the 3 rows
(4, 3, 1, 1)
""")
def sub(a, b, inplace=False):
    """ggml_sub: a - b elementwise, b broadcast over a."""
    return build("SUB", a=a, b=b, inplace=inplace)


@public("MUL", """
>>> x, bias = ctx.new_tensor_2d(mg.f32, 4, 3), ctx.new_tensor_1d(mg.f32, 4)
>>> mg.mul(x, bias).ne                    # bias repeats over the 3 rows
(4, 3, 1, 1)
""")
def mul(a, b, inplace=False):
    """ggml_mul: a * b elementwise, b broadcast over a."""
    return build("MUL", a=a, b=b, inplace=inplace)


@public("DIV", """
>>> x, bias = ctx.new_tensor_2d(mg.f32, 4, 3), ctx.new_tensor_1d(mg.f32, 4)
>>> mg.div(x, bias).ne                    # bias repeats over the 3 rows
(4, 3, 1, 1)
""")
def div(a, b, inplace=False):
    """ggml_div: a / b elementwise, b broadcast over a."""
    return build("DIV", a=a, b=b, inplace=inplace)


def _ggml_scale(g, node, src):
    """ggml_scale when b == 0 (it has no bias param), else ggml_scale_bias."""
    p = node.params
    if p["b"] == 0.0:
        return g.call("scale", src("a"), p["s"], inplace=p["inplace"])
    return g.call("scale_bias", src("a"), p["s"], p["b"], inplace=p["inplace"])


_T = "struct ggml_tensor *"
_SCALE_CDEF = "".join(f"{_T} ggml_scale{v}{sfx}(struct ggml_context * ctx, {_T} a, float s{b});\n"
                      for v, b in (("", ""), ("_bias", ", float b")) for sfx in ("", "_inplace"))


@op("SCALE", srcs=(Src("a", inplace=True),), params={"s": float, "b": float, "inplace": bool},
    split="generic", ggml=GgmlCall(override=_ggml_scale, cdef=_SCALE_CDEF),
    shape="a: [n0, n1, n2, n3] f32, contiguous -> [n0, n1, n2, n3]")
def _scale_rule(a, s, b, inplace):
    require(a.type == f32, "SCALE", lambda: f"{a.label} must be f32, got {a.type.name}")
    require(a.is_contiguous(), "SCALE", lambda: f"{a.label} must be contiguous, got nb={list(a.nb)}")
    return _same_or_view(a, inplace)


@reference("SCALE")
def _scale_ref(node, a):
    s, b = np.float32(node.params["s"]), np.float32(node.params["b"])
    with np.errstate(over="ignore", invalid="ignore"):
        return (a * s if b == 0 else a * s + b).astype(np.float32)


@public("SCALE", """
>>> mg.scale(ctx.new_tensor_2d(mg.f32, 4, 3), 0.5).ne
(4, 3, 1, 1)
""")
def scale(a, s, inplace=False):
    """ggml_scale: a * s."""
    return build("SCALE", a=a, s=s, b=0.0, inplace=inplace)


@public("SCALE", """
>>> a = ctx.new_tensor_2d(mg.f32, 4, 3)
>>> mg.scale_inplace(a, 0.0).view_src is a   # zeroes a when computed
True
""")
def scale_inplace(a, s):
    """ggml_scale_inplace: a *= s, written into a; returns a view of a."""
    return build("SCALE", a=a, s=s, b=0.0, inplace=True)


@public("SCALE", """
>>> mg.scale_bias(ctx.new_tensor_1d(mg.f32, 4), -1.0, 3.0).ne   # 3 - a
(4, 1, 1, 1)
""")
def scale_bias(a, s, b, inplace=False):
    """ggml_scale_bias: a * s + b."""
    return build("SCALE", a=a, s=s, b=b, inplace=inplace)
