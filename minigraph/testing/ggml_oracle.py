"""The oracle: run a minigraph graph (an op_cases `Built`) on real ggml (libggml-python 0.20.2)
through cffi ABI mode and read its outputs back as NumPy arrays.

Every minigraph node is translated by op name into the matching ggml constructor (one small
table entry per op). A failed GGML_ASSERT aborts the whole process, so anything ggml refuses is
checked here first and raised as `GgmlRefuses`; ops with no ggml counterpart raise
NotImplementedError. After building, each ggml tensor's type, ne, nb and view offset are compared
with minigraph's, so a shape rule that disagrees with ggml fails loudly instead of silently.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
from cffi import FFI

from minigraph.graph import Graph
from minigraph.types import ALL_TYPES, f16, f32, i32

_T = "struct ggml_tensor *"
_UNARY = ("silu", "sigmoid", "softplus", "exp", "neg", "sqrt")
_BINARY = ("add", "sub", "mul", "div")

_CDEF = f"""
struct ggml_context;
struct ggml_cgraph;
struct ggml_init_params {{ size_t mem_size; void * mem_buffer; bool no_alloc; }};
struct ggml_tensor {{
    int type; void * buffer; int64_t ne[4]; size_t nb[4]; int op; int32_t op_params[16];
    int32_t flags; struct ggml_tensor * src[10]; struct ggml_tensor * view_src; size_t view_offs;
    void * data; char name[64]; void * extra; char padding[8];
}};
struct ggml_cplan {{
    size_t work_size; uint8_t * work_data; int n_threads; void * threadpool;
    void * abort_callback; void * abort_callback_data; bool use_ref;
}};
struct ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(struct ggml_context * ctx);
size_t ggml_tensor_overhead(void);
size_t ggml_graph_overhead_custom(size_t size, bool grads);
size_t ggml_nbytes(const struct ggml_tensor * t);
struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
void ggml_build_forward_expand(struct ggml_cgraph * g, {_T} t);
void ggml_cpu_init(void);
struct ggml_cplan ggml_graph_plan(const struct ggml_cgraph * g, int n_threads, void * threadpool);
int ggml_graph_compute(struct ggml_cgraph * g, struct ggml_cplan * cplan);
{_T} ggml_new_tensor(struct ggml_context * ctx, int type, int n_dims, const int64_t * ne);
{_T} ggml_view_4d(struct ggml_context * ctx, {_T} a, int64_t ne0, int64_t ne1, int64_t ne2,
                  int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset);
{_T} ggml_reshape_4d(struct ggml_context * ctx, {_T} a, int64_t, int64_t, int64_t, int64_t);
{_T} ggml_permute(struct ggml_context * ctx, {_T} a, int, int, int, int);
{_T} ggml_transpose(struct ggml_context * ctx, {_T} a);
{_T} ggml_cpy(struct ggml_context * ctx, {_T} a, {_T} b);
{_T} ggml_cast(struct ggml_context * ctx, {_T} a, int type);
{_T} ggml_cont_4d(struct ggml_context * ctx, {_T} a, int64_t, int64_t, int64_t, int64_t);
{_T} ggml_concat(struct ggml_context * ctx, {_T} a, {_T} b, int dim);
{_T} ggml_repeat_4d(struct ggml_context * ctx, {_T} a, int64_t, int64_t, int64_t, int64_t);
{_T} ggml_get_rows(struct ggml_context * ctx, {_T} a, {_T} b);
{_T} ggml_set_rows(struct ggml_context * ctx, {_T} a, {_T} b, {_T} c);
{_T} ggml_arange(struct ggml_context * ctx, float start, float stop, float step);
{_T} ggml_scale(struct ggml_context * ctx, {_T} a, float s);
{_T} ggml_scale_inplace(struct ggml_context * ctx, {_T} a, float s);
{_T} ggml_scale_bias(struct ggml_context * ctx, {_T} a, float s, float b);
{_T} ggml_scale_bias_inplace(struct ggml_context * ctx, {_T} a, float s, float b);
{_T} ggml_rms_norm(struct ggml_context * ctx, {_T} a, float eps);
{_T} ggml_l2_norm(struct ggml_context * ctx, {_T} a, float eps);
{_T} ggml_sum_rows(struct ggml_context * ctx, {_T} a);
{_T} ggml_mul_mat(struct ggml_context * ctx, {_T} a, {_T} b);
{_T} ggml_ssm_conv(struct ggml_context * ctx, {_T} sx, {_T} c);
{_T} ggml_ssm_scan(struct ggml_context * ctx, {_T} s, {_T} x, {_T} dt, {_T} A, {_T} B, {_T} C,
                   {_T} ids, int64_t K);
{_T} ggml_gated_delta_net(struct ggml_context * ctx, {_T} q, {_T} k, {_T} v, {_T} g, {_T} beta,
                          {_T} state, int64_t K);
""" + "".join(f"{_T} ggml_{n}{sfx}(struct ggml_context * ctx, {_T} a);\n"
              for n in _UNARY for sfx in ("", "_inplace")) \
    + "".join(f"{_T} ggml_{n}{sfx}(struct ggml_context * ctx, {_T} a, {_T} b);\n"
              for n in _BINARY for sfx in ("", "_inplace"))


def _load():
    spec = importlib.util.find_spec("libggml")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("libggml-python is not installed (pip install libggml-python==0.20.2.post1)")
    libdir = os.path.join(list(spec.submodule_search_locations)[0], "lib64")
    ffi = FFI()
    ffi.cdef(_CDEF)
    base = ffi.dlopen(os.path.join(libdir, "libggml-base.so"), ffi.RTLD_NOW | ffi.RTLD_GLOBAL)
    cpu = ffi.dlopen(os.path.join(libdir, "libggml-cpu.so"))
    return ffi, base, cpu


ffi, _base, _cpu = _load()


class _Lib:
    """Resolve a symbol in libggml-cpu first, then libggml-base."""

    def __getattr__(self, name):
        for lib in (_cpu, _base):
            try:
                fn = getattr(lib, name)
            except AttributeError:
                continue
            setattr(self, name, fn)
            return fn
        raise AttributeError(name)


lib = _Lib()
if lib.ggml_tensor_overhead() != 32 + ffi.sizeof("struct ggml_tensor"):
    raise ImportError(f"struct ggml_tensor layout mismatch: ggml_tensor_overhead() = "
                      f"{lib.ggml_tensor_overhead()}, 32 + sizeof = {32 + ffi.sizeof('struct ggml_tensor')}")
lib.ggml_cpu_init()

_NP = {t.ggml_id: t.np_dtype for t in ALL_TYPES}


class GgmlRefuses(ValueError):
    """The graph breaks a rule that ggml enforces by aborting the process: it was not run."""


def _refuse(cond, node, why):
    if cond:
        raise GgmlRefuses(f"{node.op} {node.label}: {why}")


# -- checks for what ggml would abort on (or silently misread) and minigraph accepts -----------
# ggml's CPU dup: I32->F16 aborts "not implemented"; F16->I32 goes through the quantize path,
# which gets no work buffer from ggml_graph_plan (crash).
_CPU_CONVERSIONS = {(f32, f16), (f32, i32), (f16, f32), (i32, f32)}


def _indices_in_range(node, built, idx_name, limit):
    leaf = node.srcs[idx_name]
    if leaf in built.data:   # computed indices (e.g. the slot-order chain) cannot be checked here
        idx = built.data[leaf]
        _refuse(idx.size and (idx.min() < 0 or idx.max() >= limit), node,
                f"index out of [0, {limit}) (ggml aborts, or reads out of bounds)")


_CHECKS = {
    "CPY": lambda n, b: _refuse(n.srcs["a"].type != n.type and (n.srcs["a"].type, n.type) not in _CPU_CONVERSIONS,
                                n, f"ggml's CPU backend has no {n.srcs['a'].type.name}->{n.type.name} copy"),
    "SCALE": lambda n, b: _refuse(not n.srcs["a"].is_contiguous(), n,
                                  "ggml_scale asserts ggml_is_padded_1d(a) and the CPU kernel "
                                  "ggml_is_contiguous(src0); the source is not contiguous"),
    "REPEAT": lambda n, b: _refuse(n.srcs["a"].nb[0] != n.srcs["a"].type.size, n,
                                   "the CPU repeat kernel asserts nb00 == type size"),
    "ARANGE": lambda n, b: _refuse(not n.params["stop"] > n.params["start"], n, "ggml_arange asserts stop > start"),
    "GET_ROWS": lambda n, b: (_refuse(n.srcs["a"].nb[0] != n.srcs["a"].type.size, n,
                                      "the CPU get_rows kernel assumes contiguous rows (nb00 == type size)"),
                              _indices_in_range(n, b, "b", n.srcs["a"].ne[1])),
    "SET_ROWS": lambda n, b: _indices_in_range(n, b, "c", n.srcs["a"].ne[1]),
    "SSM_SCAN": lambda n, b: _indices_in_range(n, b, "ids", n.srcs["s"].ne[3]),
}


# -- translation, one entry per op: (ggml ctx, node, src) -> ggml tensor ------------------------
def _view(ctx, node, src):
    a = src("a")
    ne, nb, offset = node.ne, node.nb, node.params["offset"]
    root_offs = (a.view_offs if a.view_src != ffi.NULL else 0) + offset
    root = a.view_src if a.view_src != ffi.NULL else a
    contiguous_size = ne[0] * node.type.size * ne[1] * ne[2] * ne[3]
    if nb[0] == node.type.size and (contiguous_size == 0 or contiguous_size + root_offs <= lib.ggml_nbytes(root)):
        return lib.ggml_view_4d(ctx, a, *ne, *nb[1:], offset)
    # ggml's view check uses the contiguous size, so an overlapping view (windows) would abort:
    # create it one element wide, then widen it to the real extents and strides
    t = lib.ggml_view_4d(ctx, a, 1, 1, 1, 1, nb[1], nb[2], nb[3], offset)
    t.ne[0:4], t.nb[0:4] = list(ne), list(nb)
    return t


def _scale(ctx, node, src):
    p, sfx = node.params, "_inplace" if node.params["inplace"] else ""
    if p["b"] == 0.0:
        return getattr(lib, f"ggml_scale{sfx}")(ctx, src("a"), p["s"])
    return getattr(lib, f"ggml_scale_bias{sfx}")(ctx, src("a"), p["s"], p["b"])


def _fn(name, node):
    return getattr(lib, f"ggml_{name}{'_inplace' if node.params.get('inplace') else ''}")


_TRANSLATE = {
    "VIEW": _view,
    "RESHAPE": lambda ctx, n, s: lib.ggml_reshape_4d(ctx, s("a"), *n.ne),
    "PERMUTE": lambda ctx, n, s: lib.ggml_permute(ctx, s("a"), *n.params["axes"]),
    "TRANSPOSE": lambda ctx, n, s: lib.ggml_transpose(ctx, s("a")),
    "CPY": lambda ctx, n, s: (lib.ggml_cpy(ctx, s("a"), s("b")) if "b" in n.srcs
                              else lib.ggml_cast(ctx, s("a"), n.type.ggml_id)),
    "CONT": lambda ctx, n, s: lib.ggml_cont_4d(ctx, s("a"), *n.ne),
    "CONCAT": lambda ctx, n, s: lib.ggml_concat(ctx, s("a"), s("b"), n.params["dim"]),
    "REPEAT": lambda ctx, n, s: lib.ggml_repeat_4d(ctx, s("a"), *n.ne),
    "GET_ROWS": lambda ctx, n, s: lib.ggml_get_rows(ctx, s("a"), s("b")),
    "SET_ROWS": lambda ctx, n, s: lib.ggml_set_rows(ctx, s("a"), s("b"), s("c")),   # a = dst
    "ARANGE": lambda ctx, n, s: lib.ggml_arange(ctx, n.params["start"], n.params["stop"], n.params["step"]),
    "SCALE": _scale,
    "RMS_NORM": lambda ctx, n, s: lib.ggml_rms_norm(ctx, s("a"), n.params["eps"]),
    "L2_NORM": lambda ctx, n, s: lib.ggml_l2_norm(ctx, s("a"), n.params["eps"]),
    "SUM_ROWS": lambda ctx, n, s: lib.ggml_sum_rows(ctx, s("a")),
    "MUL_MAT": lambda ctx, n, s: lib.ggml_mul_mat(ctx, s("a"), s("b")),
    "SSM_CONV": lambda ctx, n, s: lib.ggml_ssm_conv(ctx, s("sx"), s("c")),
    "SSM_SCAN": lambda ctx, n, s: lib.ggml_ssm_scan(ctx, *map(s, ("s", "x", "dt", "A", "B", "C", "ids")), n.params["K"]),
    "GATED_DELTA_NET": lambda ctx, n, s: lib.ggml_gated_delta_net(
        ctx, *map(s, ("q", "k", "v", "g", "beta", "state")), n.params["K"]),
}
for _name in _UNARY:
    _TRANSLATE[_name.upper()] = lambda ctx, n, s, _name=_name: _fn(_name, n)(ctx, s("a"))
for _name in _BINARY:
    _TRANSLATE[_name.upper()] = lambda ctx, n, s, _name=_name: _fn(_name, n)(ctx, s("a"), s("b"))


# -- driving ------------------------------------------------------------------------------------
def _check_same_layout(t, g):
    """The ggml tensor must have minigraph's type, extents, strides and view offset."""
    got = (g.type, tuple(g.ne), tuple(g.nb), g.view_offs if g.view_src != ffi.NULL else 0)
    want = (t.type.ggml_id, t.ne, t.nb, t.view_offs)
    if got != want:
        raise AssertionError(f"{t.op} {t.label}: ggml made (type, ne, nb, view_offs) = {got}, "
                             f"minigraph {want}")


def _read(g, shape) -> np.ndarray:
    dtype = _NP[g.type]
    ne, nb = tuple(g.ne), tuple(g.nb)
    if 0 in ne:
        return np.zeros(shape, dtype)
    extent = dtype.itemsize + sum((n - 1) * b for n, b in zip(ne, nb))
    buf = ffi.buffer(ffi.cast("char *", g.data), extent)
    arr = np.ndarray(tuple(reversed(ne)), dtype, buffer=buf, strides=tuple(reversed(nb)))
    return arr.copy().reshape(shape)


def run_in_ggml(built, n_threads: int = 1) -> list[np.ndarray]:
    """Recreate built's graph in ggml, compute it on the CPU and return every out in NumPy order
    (shape == tensor.shape), as `run_built` returns minigraph's."""
    gf = Graph()
    for o in built.outs:
        gf.build_forward_expand(o)
    for node in gf.nodes:   # everything ggml would abort on is refused before ggml sees it
        if node.op not in _TRANSLATE:
            raise NotImplementedError(f"op {node.op} has no ggml counterpart in the oracle")
        if node.op in _CHECKS:
            _CHECKS[node.op](node, built)
    for leaf in gf.leafs:
        if leaf not in built.data:
            raise ValueError(f"leaf {leaf.label} has no data in the Built")

    tensors = gf.leafs + gf.nodes
    graph_size = max(64, 2 * len(tensors))
    mem = (lib.ggml_graph_overhead_custom(graph_size, False) + (1 << 20)
           + sum(lib.ggml_tensor_overhead() + t.nelements() * t.type.size + 64 for t in tensors))
    ctx = lib.ggml_init({"mem_size": mem, "mem_buffer": ffi.NULL, "no_alloc": False})
    if ctx == ffi.NULL:
        raise MemoryError("ggml_init failed")
    try:
        g: dict = {}
        for leaf in gf.leafs:
            t = g[leaf] = lib.ggml_new_tensor(ctx, leaf.type.ggml_id, 4, leaf.ne)
            data = np.ascontiguousarray(built.data[leaf], dtype=leaf.type.np_dtype)
            if data.size != leaf.nelements():
                raise ValueError(f"leaf {leaf.label!r}: {data.size} values given for {leaf.nelements()} elements")
            ffi.memmove(t.data, data.tobytes(), data.nbytes)
        for node in gf.nodes:
            src = lambda name, node=node: g[node.srcs[name]]  # noqa: E731
            t = g[node] = _TRANSLATE[node.op](ctx, node, src)
            _check_same_layout(node, t)

        cgraph = lib.ggml_new_graph_custom(ctx, graph_size, False)
        for o in built.outs:
            lib.ggml_build_forward_expand(cgraph, g[o])
        plan = ffi.new("struct ggml_cplan *", lib.ggml_graph_plan(cgraph, n_threads, ffi.NULL))
        work = ffi.new("uint8_t[]", plan.work_size) if plan.work_size else ffi.NULL
        plan.work_data = work   # kept alive by `work` until the compute returns
        status = lib.ggml_graph_compute(cgraph, plan)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute returned status {status}")
        return [_read(g[o], o.shape) for o in built.outs]
    finally:
        lib.ggml_free(ctx)
