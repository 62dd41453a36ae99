"""ggml's meta device as a second opinion on minigraph's meta backend.

A graph whose leaves have data (an op_cases `Built`) runs on ggml_backend_meta_device over two
ggml CPU devices, with a split-state callback that answers, for each leaf, the state minigraph's
meta backend gave it (its callback, e.g. a model's split-by-heads recipe). ggml then derives the
state of every computed tensor by its own rules. ggml has no call that returns those states; with
GGML_META_DEBUG=1 it logs each one ("SPLIT_STATE: {srcs} -> NAME[OP, AXIS, {shares}]"), so the log
is captured and read back by tensor name (each node is named "n<id>", each leaf "l<id>").

A node ggml leaves PARTIAL (a partial sum on each device) is all-reduced before any use: those are
ggml's all-reduces, counted as the nodes the log shows PARTIAL. Each f32 out is read back through
a copy made after the all-reduce (ggml_backend_tensor_get gathers a split tensor).

The meta device asserts (aborting the process) on a state it cannot handle: run this in a worker
process."""
from __future__ import annotations

import os
import re

import numpy as np

from minigraph.errors import OpError

from .lib import load
from .lowering import GgmlBuilder, translate

CDEF_META = """
struct ggml_backend_meta_split_state { int axis; int64_t ne[256]; uint32_t nr[16]; uint32_t n_segments; };
ggml_backend_dev_t ggml_backend_meta_device(ggml_backend_dev_t * devs, size_t n_devs,
    struct ggml_backend_meta_split_state (*cb)(const struct ggml_tensor *, void *), void * ud);
typedef struct ggml_gallocr * ggml_gallocr_t;
ggml_gallocr_t ggml_gallocr_new(ggml_backend_buffer_type_t buft);
void ggml_gallocr_free(ggml_gallocr_t galloc);
bool ggml_gallocr_alloc_graph(ggml_gallocr_t galloc, struct ggml_cgraph * graph);
ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend);
ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors(struct ggml_context * ctx, ggml_backend_t backend);
void ggml_log_set(void (*cb)(int, const char *, void *), void * ud);
struct ggml_tensor * ggml_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s);
"""
_LOG_LINE = re.compile(r"SPLIT_STATE: \{.*\} -> (\w+)\[(\w+), (\w+), \{")
MIRRORED, PARTIAL = 10, 11
_AXIS = {"0": "AXIS_0", "1": "AXIS_1", "2": "AXIS_2", "3": "AXIS_3", "MIRRORED": "MIRRORED", "PARTIAL": "PARTIAL"}


class MetaRun:
    """What ggml's meta device did: the state(s) it logged per tensor (a node it all-reduces is
    logged PARTIAL, its own state, and MIRRORED, as its readers see it), its all-reduced nodes
    and the f32 outs read back."""

    def __init__(self):
        self.states: dict = {}        # tensor id -> set of axis names logged
        self.partial: list = []       # ids of the nodes ggml left PARTIAL (all-reduced)
        self.outs: dict = {}          # out tensor id -> array (NumPy order)


def run_built_on_meta(built, gf, leaf_state, n_dev: int = 2) -> MetaRun:
    """Run gf (its leaves: built.data) on a ggml meta device over n_dev CPU devices; leaf_state(t)
    gives a leaf's SplitState (minigraph's), None for MIRRORED."""
    os.environ["GGML_META_DEBUG"] = "1"        # read when a meta buffer is made
    lib = load()
    ffi = lib.ffi
    if not hasattr(lib, "_meta_cdef"):
        ffi.cdef(CDEF_META, override=True)
        lib._meta_cdef = True
    log: list = []

    @ffi.callback("void(int, const char *, void *)")
    def on_log(level, text, ud):
        log.append(ffi.string(text).decode(errors="replace"))

    by_ptr: dict = {}

    @ffi.callback("struct ggml_backend_meta_split_state(const struct ggml_tensor *, void *)")
    def split_state(t, ud):
        ss = ffi.new("struct ggml_backend_meta_split_state *")
        ss.nr[0], ss.n_segments, ss.axis = 1, 1, MIRRORED
        st = by_ptr.get(int(ffi.cast("uintptr_t", t)))
        if st is not None and st.is_split:
            ss.axis, ss.n_segments = st.axis, st.n_segments
            for s, (seg, nr) in enumerate(zip(st.ne, st.nr)):
                ss.nr[s] = nr
                for j, n in enumerate(seg):
                    ss.ne[s * n_dev + j] = n
        elif st is not None and st.axis == PARTIAL:
            ss.axis = PARTIAL
        return ss[0]

    cpu = next(lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())
               if lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) == 0)
    devs = ffi.new("ggml_backend_dev_t[]", [cpu] * n_dev)
    meta = lib.ggml_backend_meta_device(devs, n_dev, split_state, ffi.NULL)
    be = lib.ggml_backend_dev_init(meta, ffi.NULL)
    if be == ffi.NULL:
        raise OpError("ggml's meta device over CPU devices could not be initialized")
    lib.ggml_log_set(on_log, ffi.NULL)
    size = 4 * (len(gf.nodes) + len(gf.leafs)) + 64
    ctx = lib.ggml_init({"mem_size": size * lib.ggml_tensor_overhead(), "mem_buffer": ffi.NULL, "no_alloc": True})
    cctx = lib.ggml_init({"mem_size": size * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(size, False),
                          "mem_buffer": ffi.NULL, "no_alloc": True})
    galloc = None
    try:
        g: dict = {}
        for leaf in gf.leafs:
            t = g[leaf.id] = lib.ggml_new_tensor(ctx, leaf.type.ggml_id, 4, ffi.new("int64_t[4]", list(leaf.ne)))
            lib.ggml_set_name(t, f"l{leaf.id}".encode())
            by_ptr[int(ffi.cast("uintptr_t", t))] = leaf_state(leaf)
        if lib.ggml_backend_alloc_ctx_tensors(ctx, be) == ffi.NULL:
            raise OpError("ggml's meta device could not allocate the leaves")
        for leaf in gf.leafs:
            data = np.ascontiguousarray(built.data[leaf], leaf.type.np_dtype)
            lib.ggml_backend_tensor_set(g[leaf.id], ffi.from_buffer(data), 0, data.nbytes)
        builder = GgmlBuilder(cctx, lib, ffi)
        for n in gf.nodes:
            t = g[n.id] = translate(builder, n, lambda name, n=n: g[n.srcs[name].id])
            lib.ggml_set_name(t, f"n{n.id}".encode())
        # each f32 out is read through a copy (ggml_scale by 1): ggml refuses to read a tensor
        # whose own state is PARTIAL, while the copy reads it after the all-reduce
        readable = {}
        for o in built.outs:
            if o.type.name == "f32" and o.view_src is None and o.is_contiguous():
                readable[o.id] = lib.ggml_scale(cctx, g[o.id], 1.0)
                lib.ggml_set_name(readable[o.id], f"r{o.id}".encode())
        cgraph = lib.ggml_new_graph_custom(cctx, size, False)
        for n in gf.nodes:
            lib.ggml_build_forward_expand(cgraph, g[n.id])
        for t in readable.values():
            lib.ggml_build_forward_expand(cgraph, t)
        galloc = lib.ggml_gallocr_new(lib.ggml_backend_get_default_buffer_type(be))
        if not lib.ggml_gallocr_alloc_graph(galloc, cgraph):
            raise OpError("ggml's meta device could not allocate the graph")
        status = lib.ggml_backend_graph_compute(be, cgraph)
        if status != 0:
            raise OpError(f"ggml's meta device: graph compute failed (status {status})")
        run = MetaRun()
        for line in log:
            m = _LOG_LINE.search(line)
            if m:
                kind, ident = m.group(1)[0], int(m.group(1)[1:]) if m.group(1)[1:].isdigit() else None
                if ident is not None and kind in "nl":
                    run.states.setdefault(ident, set()).add(_AXIS.get(m.group(3), m.group(3)))
        run.partial = sorted(i for i, axes in run.states.items() if "PARTIAL" in axes
                             and any(n.id == i for n in gf.nodes))
        for oid, t in readable.items():
            o = next(x for x in built.outs if x.id == oid)
            arr = np.zeros(tuple(reversed(o.ne)), o.type.np_dtype)
            lib.ggml_backend_tensor_get(t, ffi.from_buffer(arr), 0, arr.nbytes)
            run.outs[oid] = arr.reshape(o.shape)
        return run
    finally:
        lib.ggml_log_set(ffi.NULL, ffi.NULL)
        if galloc is not None:
            lib.ggml_gallocr_free(galloc)
        lib.ggml_free(cctx)
        lib.ggml_free(ctx)
