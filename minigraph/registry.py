"""The op registry: each op is defined once, with its sources, typed params, shape rule and
NumPy reference. Backends register kernels against these names; tests enumerate them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .errors import OpError
from .tensor import Tensor
from .types import DType


@dataclass
class Out:
    """What a shape rule returns: the result's type and extents, and for views (or ops that
    write through into a destination) the tensor aliased, the byte offset and the strides."""
    type: DType
    ne: tuple
    nb: tuple | None = None
    view_of: Tensor | None = None
    offs: int = 0


@dataclass
class OpDef:
    name: str                           # ggml's op name, e.g. "SET_ROWS"
    srcs: tuple[str, ...]               # ggml's argument names, in ggml's src[] order
    params: dict[str, type]             # typed op params
    rule: Callable[..., Out]            # shape rule: the only validator; raises OpError
    reference: Callable | None = None   # NumPy reference: (node, **arrays) -> array
    is_view: bool = False               # computes nothing (VIEW, RESHAPE, PERMUTE, TRANSPOSE)
    cases: list = field(default_factory=list)  # filled by tests/op_cases.py (coverage check)


OPS: dict[str, OpDef] = {}


def op(name: str, srcs=(), params: dict | None = None, *, is_view: bool = False):
    """Decorator that registers a shape rule under ``name``."""
    def deco(rule):
        if name in OPS:
            raise RuntimeError(f"op {name} registered twice")
        OPS[name] = OpDef(name, tuple(srcs), dict(params or {}), rule, is_view=is_view)
        return rule
    return deco


def reference(name: str):
    """Decorator that attaches the NumPy reference to a registered op."""
    def deco(fn):
        OPS[name].reference = fn
        return fn
    return deco


def get(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise OpError(f"unknown op {name!r}") from None


def fail(opname: str, msg: str):
    raise OpError(f"{opname}: {msg}")


def require(cond, opname: str, msg: str):
    if not cond:
        fail(opname, msg)


def build(name: str, ctx=None, /, **kwargs) -> Tensor:
    """Create the node for op ``name`` from named sources and params, after its shape rule."""
    d = get(name)
    srcs = {}
    for s in d.srcs:
        t = kwargs.pop(s, None)
        if t is None:
            continue
        if not isinstance(t, Tensor):
            fail(name, f"source '{s}' must be a Tensor, got {type(t).__name__}")
        srcs[s] = t
    params = {}
    for p, ptype in d.params.items():
        if p not in kwargs:
            fail(name, f"missing parameter '{p}'")
        v = kwargs.pop(p)
        try:
            params[p] = v if isinstance(v, ptype) else (tuple(v) if ptype is tuple else ptype(v))
        except (TypeError, ValueError):
            fail(name, f"parameter '{p}' must be {ptype.__name__}, got {v!r}")
    if kwargs:
        fail(name, f"unexpected arguments {sorted(kwargs)}")
    out = d.rule(**srcs, **params)
    # no context unless one is given: a node never joins its sources' (weights', caches') context;
    # the graphs, nodes and callers that hold it keep it alive
    return Tensor(ctx, out.type, out.ne, out.nb, op=name, srcs=srcs, params=params,
                  view_src=out.view_of, view_offs=out.offs)


def writes_through(node: Tensor) -> bool:
    """A compute node that is a view writes into memory it does not own (cpy, set_rows,
    in-place ops): it must run where that memory lives and needs no allocation."""
    if node.op == "NONE" or node.view_src is None:
        return False
    return not OPS[node.op].is_view
