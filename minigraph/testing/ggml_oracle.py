"""The oracle: run a minigraph graph (an op_cases `Built`) on real ggml (libggml-python 0.20.2)
through cffi ABI mode and read its outputs back as NumPy arrays.

Every minigraph node is translated into the matching ggml constructor from its op's declaration
(`OpDef.ggml`), by the lowering the ggml backend uses too (minigraph.backends.ggml.lowering),
which also derives the cffi declarations of those constructors from the same data. A failed
GGML_ASSERT aborts the whole process, so anything ggml refuses is checked here first and raised as `GgmlRefuses`; ops with no ggml counterpart raise
NotImplementedError. After building, each ggml tensor's type, ne, nb and view offset are compared
with minigraph's, so a shape rule that disagrees with ggml fails loudly instead of silently.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
from cffi import FFI

from minigraph.graph import Graph
from minigraph.backends.ggml.lib import resolve_symbol
from minigraph.backends.ggml.lowering import (CDEF_TENSOR, GgmlBuilder, cdef_for_ops, layout_mismatch,
                                               translate, translation_problem)
from minigraph.registry import OPS
from minigraph.types import ALL_TYPES, bf16, f16, f32, from_ggml_id, i32, q4_0, q8_0

# the runtime the driver itself calls on top of the lowering's declarations
_CDEF_CORE = """
struct ggml_cplan {
    size_t work_size; uint8_t * work_data; int n_threads; void * threadpool;
    void * abort_callback; void * abort_callback_data; bool use_ref;
};
void ggml_cpu_init(void);
struct ggml_cplan ggml_graph_plan(const struct ggml_cgraph * g, int n_threads, void * threadpool);
int ggml_graph_compute(struct ggml_cgraph * g, struct ggml_cplan * cplan);
size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start, int64_t nrows,
                           int64_t n_per_row, const float * imatrix);
void ggml_quantize_init(int type);
struct ggml_type_traits {
    const char * type_name; int64_t blck_size; int64_t blck_size_interleave; size_t type_size;
    bool is_quantized; void (*to_float)(const void * x, float * y, int64_t k);
    void (*from_float_ref)(const float * x, void * y, int64_t k);
};
const struct ggml_type_traits * ggml_get_type_traits(int type);
void quantize_row_q8_K_ref(const float * x, void * y, int64_t k);
void dequantize_row_q8_K(const void * x, float * y, int64_t k);
"""


def _load():
    spec = importlib.util.find_spec("libggml")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("libggml-python is not installed (pip install libggml-python==0.20.2.post1)")
    libdir = os.path.join(list(spec.submodule_search_locations)[0], "lib64")
    ffi = FFI()
    ffi.cdef(CDEF_TENSOR + _CDEF_CORE + cdef_for_ops(OPS), override=True)
    base = ffi.dlopen(os.path.join(libdir, "libggml-base.so"), ffi.RTLD_NOW | ffi.RTLD_GLOBAL)
    cpu = ffi.dlopen(os.path.join(libdir, "libggml-cpu.so"))
    return ffi, base, cpu


ffi, _base, _cpu = _load()


class _Lib:
    """Resolve a symbol in libggml-cpu first, then libggml-base."""

    def __getattr__(self, name):
        return resolve_symbol(self, (_cpu, _base), name)


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
_CPU_CONVERSIONS = {(f32, f16), (f32, i32), (f16, f32), (i32, f32), (f32, bf16), (bf16, f32),
                    (f32, q8_0), (f32, q4_0)}


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


# -- driving ------------------------------------------------------------------------------------
def _check_same_layout(t, g):
    """The ggml tensor must have minigraph's type, extents, strides and view offset."""
    problem = layout_mismatch(t, g, ffi)
    if problem is not None:
        raise AssertionError(problem)


def _read(g, shape) -> np.ndarray:
    dtype = _NP[g.type]
    ne, nb = tuple(g.ne), tuple(g.nb)
    if 0 in ne:
        return np.zeros(shape, dtype)
    t = from_ggml_id(g.type)
    if t.is_quantized:            # rows of raw blocks
        full, strides = (ne[3], ne[2], ne[1], t.row_size(ne[0])), (nb[3], nb[2], nb[1], 1)
    else:
        full, strides = tuple(reversed(ne)), tuple(reversed(nb))
    extent = sum((n - 1) * s for n, s in zip(full, strides)) + dtype.itemsize
    buf = ffi.buffer(ffi.cast("char *", g.data), extent)
    arr = np.ndarray(full, dtype, buffer=buf, strides=strides)
    return arr.copy().reshape(shape)


def run_in_ggml(built, n_threads: int = 1) -> list[np.ndarray]:
    """Recreate built's graph in ggml, compute it on the CPU and return every out in NumPy order
    (shape == tensor.shape), as `run_built` returns minigraph's."""
    gf = Graph()
    for o in built.outs:
        gf.build_forward_expand(o)
    for node in gf.nodes:   # everything ggml would abort on is refused before ggml sees it
        why = translation_problem(node.op)
        if why is not None:
            raise NotImplementedError(why)
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
            want = leaf.nbytes() if leaf.type.is_quantized else leaf.nelements()   # raw bytes for block types
            if data.size != want:
                raise ValueError(f"leaf {leaf.label!r}: {data.size} values given for {want}")
            ffi.memmove(t.data, data.tobytes(), data.nbytes)
        builder = GgmlBuilder(ctx, lib, ffi)
        for node in gf.nodes:
            src = lambda name, node=node: g[node.srcs[name]]  # noqa: E731
            t = g[node] = translate(builder, node, src)
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
        return [_read(g[o], o.storage_shape) for o in built.outs]
    finally:
        lib.ggml_free(ctx)


# -- codecs: ggml's own quantize and to_float, the reference for minigraph.quants ---------------
def ggml_quantize(x: np.ndarray, type) -> np.ndarray:
    """Rows of float32 values -> ggml's bytes for ``type`` (a minigraph DType), shape
    (rows, row bytes): ggml_quantize_chunk without an importance matrix, or the type's
    reference row quantizer where quantize_chunk does not take the type (q8_k)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.reshape(-1, x.shape[-1]).shape
    traits = lib.ggml_get_type_traits(type.ggml_id)
    if traits.type_size != type.size or traits.blck_size != type.blck_size:
        raise ValueError(f"{type.name}: ggml has {traits.blck_size} values in {traits.type_size} bytes, "
                         f"minigraph {type.blck_size} in {type.size}")
    out = np.zeros((rows, type.size * n // type.blck_size), np.uint8)
    src = ffi.cast("const float *", ffi.from_buffer(x))
    dst = ffi.cast("void *", ffi.from_buffer(out))
    if type.name == "q8_k":
        lib.quantize_row_q8_K_ref(src, dst, rows * n)
    else:
        lib.ggml_quantize_init(type.ggml_id)
        lib.ggml_quantize_chunk(type.ggml_id, src, dst, 0, rows, n, ffi.NULL)
    return out


def ggml_dequantize(raw: np.ndarray, type) -> np.ndarray:
    """Rows of ggml's bytes for ``type`` -> float32 values through the type's to_float."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.reshape(-1, raw.shape[-1]).shape[0]
    n = raw.shape[-1] // type.size * type.blck_size
    out = np.zeros((rows, n), np.float32)
    # q8_k has no to_float in the type traits; its row function is exported
    fn = lib.dequantize_row_q8_K if type.name == "q8_k" else lib.ggml_get_type_traits(type.ggml_id).to_float
    fn(ffi.cast("const void *", ffi.from_buffer(raw)), ffi.cast("float *", ffi.from_buffer(out)), rows * n)
    return out
