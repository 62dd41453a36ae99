"""A minigraph node list as a ggml graph on one ggml device, built once and run many times.

Every tensor keeps the memory minigraph gave it: each root (a leaf, a planned intermediate, a
scheduler's copy) becomes a ggml tensor placed at the same byte of the same buffer
(ggml_backend_tensor_alloc); a compute node is built by its op's ggml translation (the lowering
shared with the op oracle), and its ggml result must have minigraph's type, ne, nb and view
offset; a view node (which computes nothing) is placed directly at its own bytes, so a view of a
tensor that the scheduler replaced by a copy still means minigraph's memory. The graph is cached
like the CPU backend's plans: rebuilt only when the node list or the memory bound to it changes."""
from __future__ import annotations

import weakref

from minigraph.backend import is_compute_node
from minigraph.errors import OpError
from minigraph.sources import srcs_of
from minigraph.tensor import bind_epoch

from .lowering import GgmlBuilder, layout_mismatch, translate, translation_problem


class GgmlGraph:
    """One built ggml graph: its context (tensor metadata), the cgraph, and the memory
    signature it was built against."""

    def __init__(self, backend, nodes):
        lib, ffi = backend.lib, backend.lib.ffi
        self.nodes = nodes
        self.backend = backend
        compute = [n for n in nodes if is_compute_node(n)]
        n_tensors = 4 * len(nodes) + 16
        mem = lib.ggml_graph_overhead_custom(n_tensors, False) + n_tensors * lib.ggml_tensor_overhead()
        self.ctx = lib.ggml_init({"mem_size": mem, "mem_buffer": ffi.NULL, "no_alloc": True})
        if self.ctx == ffi.NULL:
            raise MemoryError("ggml_init failed")
        weakref.finalize(self, lib.ggml_free, self.ctx)
        self.by_id: dict = {}
        self.roots: dict = {}
        self.builder = GgmlBuilder(self.ctx, lib, ffi)
        self.cgraph = lib.ggml_new_graph_custom(self.ctx, n_tensors, False)
        for node in nodes:
            if is_compute_node(node):
                self._lower(node)
        for node in compute:
            lib.ggml_build_forward_expand(self.cgraph, self.by_id[node.id])
        self.empty = not compute          # only views: nothing to run (ggml's RPC client asserts on it)
        self.sig = self.signature()
        self.epoch = bind_epoch()

    # -- tensors --------------------------------------------------------------------------
    def _placed(self, t):
        """A ggml tensor with t's type, ne and nb at t's bytes (a leaf of the ggml graph)."""
        lib, ffi = self.backend.lib, self.backend.lib.ffi
        buf, offs = t.storage()
        if buf.backend is not self.backend:
            raise OpError(f"{t.label} lives on {buf.backend.name}, not {self.backend.name}: "
                          f"use a Scheduler to compute across devices")
        g = lib.ggml_new_tensor(self.ctx, t.type.ggml_id, 4, ffi.new("int64_t[4]", list(t.ne)))
        for i in range(4):
            g.nb[i] = t.nb[i]
        status = lib.ggml_backend_tensor_alloc(buf.mem.buffer, g, ffi.cast("char *", buf.mem.base) + offs)
        if status != 0:
            raise OpError(f"{t.label}: ggml could not place it at byte {offs} of its buffer (status {status})")
        root = t.root()
        self.roots[root.id] = root
        return g

    def tensor(self, t):
        g = self.by_id.get(t.id)
        if g is None:
            g = self.by_id[t.id] = self._placed(t)
        return g

    def _lower(self, node):
        lib, ffi = self.backend.lib, self.backend.lib.ffi
        why = translation_problem(node.op)
        if why is not None:
            raise OpError(f"{node.op} {node.label}: cannot run on device {self.backend.name}: {why}")
        srcs = srcs_of(node)
        g = translate(self.builder, node, lambda name: self.tensor(srcs[name]))
        # offsets are checked as addresses below: a view node is a leaf here, so a result written
        # through into it has view offset 0 in ggml where minigraph counts from the root
        problem = layout_mismatch(node, g, ffi, offsets=False)
        if problem is not None:
            raise OpError(f"device {self.backend.name}: {problem}")
        buf, offs = node.storage()
        want = ffi.cast("char *", buf.mem.base) + offs
        if g.view_src == ffi.NULL:          # a fresh result: minigraph planned its bytes
            status = lib.ggml_backend_tensor_alloc(buf.mem.buffer, g, want)
            self.roots[node.id] = node
        else:                               # writes through into a source's memory
            status = lib.ggml_backend_view_init(g)
            self.roots[node.root().id] = node.root()
        if status != 0:
            raise OpError(f"{node.op} {node.label}: ggml could not place its result (status {status})")
        if ffi.cast("char *", g.data) != want:
            raise OpError(f"device {self.backend.name}: {node.op} {node.label}: ggml's result is at another "
                          f"byte than minigraph's (a write-through into the wrong memory)")
        if not lib.ggml_backend_supports_op(self.backend.handle, g):
            raise OpError(f"{node.op} {node.label}: device {self.backend.name} does not support this op "
                          f"with these types and strides")
        self.by_id[node.id] = g

    # -- reuse ----------------------------------------------------------------------------
    def signature(self) -> tuple:
        return tuple((r.buffer.id if r.buffer is not None else -1, r.offs) for r in self.roots.values())

    def still_valid(self, nodes) -> bool:
        if self.nodes is not nodes:
            return False
        if self.epoch == bind_epoch() or self.sig == self.signature():
            self.epoch = bind_epoch()
            return True
        return False

    def compute(self):
        if self.empty:
            return
        status = self.backend.lib.ggml_backend_graph_compute(self.backend.handle, self.cgraph)
        if status != 0:
            raise OpError(f"device {self.backend.name}: ggml_backend_graph_compute failed (status {status})")


def cached_graph(backend, nodes, cache: dict | None) -> GgmlGraph:
    """The built graph of ``nodes`` from the owner's per-graph cache (or the backend's own small
    one), built again when the node list or its memory changed."""
    store = cache if cache is not None else backend.own_graphs
    key = ("ggml_graph", backend.name, id(nodes), len(nodes))
    g = store.get(key)
    if g is None or not g.still_valid(nodes):
        g = store[key] = GgmlGraph(backend, nodes)
        backend.graphs_built += 1
        if cache is None and len(store) > 32:
            store.pop(next(iter(store)))
    return g


__all__ = ["GgmlGraph", "cached_graph"]
