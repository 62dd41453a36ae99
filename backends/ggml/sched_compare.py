"""ggml's scheduler as a second opinion on minigraph's placement.

The same graph, with every leaf (weights, caches, inputs) in the ggml buffer minigraph gave it,
is built as a ggml graph and handed to ggml_backend_sched over the same devices, in the same
priority order; after ggml_backend_sched_reserve and ggml_backend_sched_alloc_graph, each node's
backend (ggml_backend_sched_get_tensor_backend) and the split count are read back and set beside
minigraph's device, cause code, splits and copies.

ggml has no call that returns its number of cross-device copies (ggml_backend_sched_get_n_copies
is the number of pipeline-parallel graph copies: 1 without `parallel`), so the copies are counted
from ggml's own assignment the way its split pass makes them: one per (tensor, backend) pair
where a node on one backend reads a tensor ggml assigned to another, as minigraph counts them.

Only ggml devices can be compared (the leaves must be in ggml buffers: ggml places by buffer),
and ggml requires the last device to be a CPU. Two ggml CPU backends share one buffer type, so
ggml cannot tell their leaves apart (every CPU leaf goes to the first): use RPC servers for two
real devices."""
from __future__ import annotations

from dataclasses import dataclass, field

from minigraph.errors import OpError

from .lowering import GgmlBuilder, translate

GRAPH_SIZE_MIN = 2048


@dataclass
class NodeDiff:
    node: str
    op: str
    minigraph: str
    cause: str
    ggml: str


@dataclass
class Comparison:
    devices: list
    n_nodes: int
    diffs: list = field(default_factory=list)
    splits: tuple = (0, 0)             # (minigraph, ggml)
    copies: tuple = (0, 0)             # (minigraph, ggml, counted from ggml's assignment)
    ggml_pipeline_copies: int = 1      # ggml_backend_sched_get_n_copies

    @property
    def equal(self) -> bool:
        return not self.diffs and self.splits[0] == self.splits[1] and self.copies[0] == self.copies[1]

    def format(self) -> str:
        out = [f"ggml_backend_sched over {', '.join(self.devices)}: {self.n_nodes} nodes, "
               f"{len(self.diffs)} placed differently; splits minigraph {self.splits[0]} / ggml {self.splits[1]}; "
               f"copies minigraph {self.copies[0]} / ggml {self.copies[1]} "
               f"(ggml_backend_sched_get_n_copies = {self.ggml_pipeline_copies}: pipeline copies)"]
        for d in self.diffs:
            out.append(f"  {d.op:10s} {d.node:40s} minigraph {d.minigraph} ({d.cause})  ggml {d.ggml}")
        return "\n".join(out)


def _check_devices(devices):
    from . import GgmlBackend
    bad = [d.name for d in devices if not isinstance(d, GgmlBackend)]
    if bad:
        raise OpError(f"--compare-ggml: ggml's scheduler places by ggml buffer, so every device must be a ggml "
                      f"device (ggml:cpu, ggml:rpc://HOST:PORT); not {', '.join(bad)}")
    if devices[-1].device.kind != "cpu":
        raise OpError(f"--compare-ggml: ggml's scheduler needs a CPU as its last device; the list ends with "
                      f"{devices[-1].name} (end it with ggml:cpu)")


def compare(gf, sg, devices) -> Comparison:
    """ggml's placement of gf over devices beside minigraph's schedule sg of the same graph."""
    _check_devices(devices)
    lib = devices[0].lib
    ffi = lib.ffi
    size = max(GRAPH_SIZE_MIN, 4 * (len(gf.nodes) + len(gf.leafs)))
    mem = lib.ggml_graph_overhead_custom(size, False) + size * lib.ggml_tensor_overhead()
    ctx = lib.ggml_init({"mem_size": mem, "mem_buffer": ffi.NULL, "no_alloc": True})
    handles = ffi.new("ggml_backend_t[]", [d.handle for d in devices])
    sched = lib.ggml_backend_sched_new(handles, ffi.NULL, len(devices), size, False, False)
    try:
        g = _lower(lib, ctx, gf)
        cgraph = lib.ggml_new_graph_custom(ctx, size, False)
        for n in gf.nodes:
            lib.ggml_build_forward_expand(cgraph, g[n.id])
        if not lib.ggml_backend_sched_reserve(sched, cgraph) or not lib.ggml_backend_sched_alloc_graph(sched, cgraph):
            raise OpError("ggml_backend_sched could not allocate the graph")
        by_handle = {int(ffi.cast("uintptr_t", d.handle)): d.name for d in devices}

        def ggml_device(t) -> str | None:
            h = lib.ggml_backend_sched_get_tensor_backend(sched, g[t.id])
            return None if h == ffi.NULL else by_handle.get(int(ffi.cast("uintptr_t", h)), "?")

        cmp = Comparison([d.name for d in devices], len(gf.nodes))
        copies = set()
        for n in gf.nodes:
            mine = sg.backend_of(n)
            theirs = ggml_device(n)
            if (mine.name if mine else None) != theirs:
                cmp.diffs.append(NodeDiff(n.name or n.label, n.op, mine.name if mine else "-",
                                          sg.cause.get(n.id, "?"), theirs or "-"))
            for s in n.srcs.values():
                where = ggml_device(s) if s.id in g else None
                if theirs is not None and where is not None and where != theirs:
                    copies.add((s.id, theirs))
        cmp.splits = (len(sg.splits), lib.ggml_backend_sched_get_n_splits(sched))
        cmp.copies = (len(sg.copies), len(copies))
        cmp.ggml_pipeline_copies = lib.ggml_backend_sched_get_n_copies(sched)
        return cmp
    finally:
        lib.ggml_backend_sched_free(sched)
        lib.ggml_free(ctx)


def _lower(lib, ctx, gf) -> dict:
    """tensor id -> ggml tensor: leaves placed in their buffers, nodes by their translations
    (reading the graph's own sources: no copies, ggml makes its own), intermediates unallocated."""
    ffi = lib.ffi
    g: dict = {}
    for leaf in gf.leafs:
        t = g[leaf.id] = lib.ggml_new_tensor(ctx, leaf.type.ggml_id, 4, ffi.new("int64_t[4]", list(leaf.ne)))
        for i in range(4):
            t.nb[i] = leaf.nb[i]
        root = leaf.root()
        if root.buffer is not None and root.buffer.usage != "compute":   # else ggml places it itself
            buf, offs = leaf.storage()
            if lib.ggml_backend_tensor_alloc(buf.mem.buffer, t, ffi.cast("char *", buf.mem.base) + offs) != 0:
                raise OpError(f"{leaf.label}: ggml could not place it in its buffer")
        lib.ggml_set_name(t, (leaf.name or f"leaf{leaf.id}")[:63].encode())
    builder = GgmlBuilder(ctx, lib, ffi)
    for n in gf.nodes:
        t = g[n.id] = translate(builder, n, lambda name, n=n: g[n.srcs[name].id])
        lib.ggml_set_name(t, (n.name or f"node{n.id}")[:63].encode())
    return g
