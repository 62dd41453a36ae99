"""The op registry: each op is declared once, and everything else reads that declaration.

An `OpDef` carries, for one op:
  * its sources in ggml's src[] order, with their roles (`Src`: required or optional; the
    destination the node writes through into; the one an `inplace` variant writes into),
  * a typed param schema that `build` enforces strictly (`check_param`), and from which the
    C backends derive their param slots (`c_float_params`, `c_int_params`),
  * the shape rule (the only validator) and the NumPy reference, and the rule in words (`shape`,
    ne order), which the public functions' docstrings and the README's op table show,
  * the meta backend's split-state rule, by name (`split`; the rule functions live in
    minigraph.backends.meta.split_state, the core imports no backend),
  * how real ggml builds it (`GgmlCall`, or `NotInGgml` with the reason), read by the oracle,
  * its generic test cases (`CaseGen`, expanded by minigraph.testing.op_cases).
Backends register kernels against these names; the coverage test enumerates them."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

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


@dataclass(frozen=True)
class Src:
    """One source of an op, in ggml's src[] order."""
    name: str
    optional: bool = False   # may be absent (e.g. SOFT_MAX's mask, CPY's b for a cast)
    dest: bool = False       # when present, the result IS this source's memory (CPY's b, SET_ROWS's a)
    inplace: bool = False    # the result is this source's memory when the op's `inplace` param is True


@dataclass(frozen=True)
class GgmlCall:
    """How ggml builds the op: `ggml_<fn>(ctx, *args)`. Each arg names a source (an absent
    optional one is passed as NULL), a param (a tuple param passes its 4 elements), or the
    node's extents "@ne" (4 x int64_t). C types follow the param schema (float -> float,
    int -> int, bool -> bool, tuple -> int each) unless `ctypes` says otherwise. An op with an
    `inplace` param calls `ggml_<fn>_inplace` when it is True. Ops that no single call fits
    give `override(g, node, src) -> ggml tensor` (g: the oracle's builder, see
    minigraph.testing.ggml_oracle) and the C declarations it calls in `cdef`."""
    fn: str = ""
    args: tuple = ()
    ctypes: dict = field(default_factory=dict)
    override: Callable | None = None
    cdef: str = ""


@dataclass(frozen=True)
class NotInGgml:
    """The op has no ggml counterpart; the reason says why (shown by the coverage test)."""
    reason: str


@dataclass(frozen=True)
class CaseGen:
    """Test cases for the op from a generic builder of minigraph.testing.op_cases
    (`builder` names it, `options` configure it). Ops whose cases need a hand-written graph
    declare none here and have `@case` functions in op_cases instead."""
    builder: str
    options: dict = field(default_factory=dict)


def cases(builder: str, **options) -> CaseGen:
    return CaseGen(builder, options)


PARAM_TYPES = (bool, int, float, tuple, DType)


@dataclass
class OpDef:
    name: str                           # ggml's op name, e.g. "SET_ROWS"
    srcs: tuple[str, ...]               # source names in ggml's src[] order
    params: dict[str, type]             # typed op params, in declaration order
    rule: Callable[..., Out]            # shape rule: the only validator; raises OpError
    reference: Callable | None = None   # NumPy reference: (node, **arrays) -> array
    state_slots: Callable | None = None  # a scan's packed states: (node) -> (byte offset, D, n_seqs, K)
    is_view: bool = False               # computes nothing (VIEW, RESHAPE, PERMUTE, TRANSPOSE)
    sources: tuple[Src, ...] = ()       # the roles of srcs (same order)
    split: str | None = None            # the meta backend's split rule, by name
    ggml: GgmlCall | NotInGgml | None = None
    case_gens: tuple[CaseGen, ...] = ()
    shape: str = ""                     # the shape rule in words, ne order: "a: [K, M, ..] -> [M, ..]"
    wide_types: bool = False            # its rule accepts bf16 and block types (others refuse them)

    def source(self, name: str) -> Src:
        return next(s for s in self.sources if s.name == name)

    def write_target(self, node) -> str | None:
        """The source whose memory the node writes through into, or None (fresh result)."""
        for s in self.sources:
            if s.dest and s.name in node.srcs:
                return s.name
        if node.params.get("inplace"):
            return next((s.name for s in self.sources if s.inplace), None)
        return None

    @property
    def dest_sources(self) -> tuple[str, ...]:
        """Sources that are written, never read (CPY's b, SET_ROWS's a)."""
        return tuple(s.name for s in self.sources if s.dest)

    @property
    def inplace_sources(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources if s.inplace)

    # -- how C kernels receive params: floats fill fp[] and ints/bools ip[], in declaration order
    @property
    def c_float_params(self) -> tuple[str, ...]:
        return tuple(p for p, t in self.params.items() if t is float)

    @property
    def c_int_params(self) -> tuple[str, ...]:
        return tuple(p for p, t in self.params.items() if t in (int, bool))


OPS: dict[str, OpDef] = {}


def op(name: str, srcs=(), params: dict | None = None, *, is_view: bool = False,
       split: str | None = None, ggml: GgmlCall | NotInGgml | None = None, cases=(), shape: str = "",
       wide_types: bool = False):
    """Decorator that registers a shape rule under ``name`` with the op's declaration.
    ``srcs`` entries are source names or `Src` (for roles); ``cases`` one `CaseGen` or several;
    ``shape`` the rule in words, in ne order (shown by docstrings and the README)."""
    sources = tuple(s if isinstance(s, Src) else Src(s) for s in srcs)
    params = dict(params or {})
    for p, t in params.items():
        if t not in PARAM_TYPES:
            raise TypeError(f"op {name}: param '{p}' has type {t!r}; params are one of {PARAM_TYPES}")
    if any(s.inplace for s in sources) and params.get("inplace") is not bool:
        raise TypeError(f"op {name}: an in-place source needs a bool param 'inplace'")
    gens = (cases,) if isinstance(cases, CaseGen) else tuple(cases)

    def deco(rule):
        if name in OPS:
            raise RuntimeError(f"op {name} registered twice")
        OPS[name] = OpDef(name, tuple(s.name for s in sources), params, rule, is_view=is_view,
                          sources=sources, split=split, ggml=ggml, case_gens=gens, shape=shape,
                          wide_types=wide_types)
        return rule
    return deco


def reference(name: str):
    """Decorator that attaches the NumPy reference to a registered op."""
    def deco(fn):
        OPS[name].reference = fn
        return fn
    return deco


def state_slots(name: str):
    """Decorator that declares where a scan packs its K state snapshots: (node) -> (byte offset
    of the first, D floats per sequence and slot, n_seqs, K), laid out [D, n_seqs, K] after the
    main output. A backend that writes them elsewhere (the cpu backend's fused stores) reads it
    here, not from its own copy of the shape rule."""
    def deco(fn):
        OPS[name].state_slots = fn
        return fn
    return deco


def get(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise OpError(f"unknown op {name!r}") from None


def fail(opname: str, msg: str):
    raise OpError(f"{opname}: {msg}")


def require(cond, opname: str, msg):
    """OpError ``opname: msg`` unless cond. ``msg`` may be a callable that makes the message: the
    shape rules pass lambdas, so that the labels they quote (about a microsecond each) are made
    only for a rule that fails, not for the thousands that pass while a model's graph is built."""
    if not cond:
        fail(opname, msg() if callable(msg) else msg)


def _is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_))


def check_param(opname: str, name: str, ptype: type, v):
    """v as ``ptype``, or OpError naming the op and the param. Strict on purpose: a bool takes
    only a real bool (``inplace="no"`` is refused, not truthy); an int refuses bools and floats
    with a fractional part; a float takes any real number but a bool; a tuple takes a list or
    tuple of ints."""
    if ptype is bool:
        if _is_bool(v):
            return bool(v)
    elif ptype is int:
        if isinstance(v, numbers.Integral) and not _is_bool(v):
            return int(v)
        if isinstance(v, numbers.Real) and not _is_bool(v) and float(v).is_integer():
            return int(v)
    elif ptype is float:
        if isinstance(v, numbers.Real) and not _is_bool(v):
            return float(v)
    elif ptype is tuple:
        if isinstance(v, (tuple, list)):
            return tuple(check_param(opname, f"{name}[{i}]", int, x) for i, x in enumerate(v))
    elif isinstance(v, ptype):
        return v
    fail(opname, f"parameter '{name}' must be {ptype.__name__}, got {v!r} ({type(v).__name__})")


def build(name: str, ctx=None, /, **kwargs) -> Tensor:
    """Create the node for op ``name`` from named sources and params, after its shape rule."""
    d = get(name)
    srcs = {}
    for s in d.sources:
        t = kwargs.pop(s.name, None)
        if t is None:
            if not s.optional:
                fail(name, f"source '{s.name}' is required, got None")
            continue
        if not isinstance(t, Tensor):
            fail(name, f"source '{s.name}' must be a Tensor, got {type(t).__name__}")
        srcs[s.name] = t
    params = {}
    for p, ptype in d.params.items():
        if p not in kwargs:
            fail(name, f"missing parameter '{p}'")
        params[p] = check_param(name, p, ptype, kwargs.pop(p))
    if kwargs:
        fail(name, f"unexpected arguments {sorted(kwargs)}")
    if not d.wide_types:
        for s, t in srcs.items():
            if not t.type.numpy_native:
                fail(name, f"source '{s}' {t.label} is {t.type.name}: {name} does not take {t.type.name} "
                           f"(bf16 and block types go to get_rows, mul_mat's src0, cpy/cast and views)")
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
