"""The backend interface, host buffers, the device registry and leaf allocation."""
from __future__ import annotations

import itertools
import re

import numpy as np

from .alloc import allocation_error, check_host_allocation, output_ids, plan_graph
from .errors import OpError
from .registry import OPS, writes_through
from .sources import reading
from .tensor import Context, Tensor, bind_epoch, output_epoch

GUARD_BYTE = 0xA5
# f16 sources that came with the weight types (mul_mat's src0): like bf16 and the block types, a
# backend takes them only when it names "f16" in its wide_types
F16_WEIGHT_SOURCES = {("MUL_MAT", "a", "f16")}
_buffer_ids = itertools.count()


class Buffer:
    """A span of one device's memory. ``usage`` is 'weights' or 'any' (leaves: weights, state,
    inputs; kept across computes) or 'compute' (intermediates, owned by a graph's plan)."""

    def __init__(self, backend: "Backend", nbytes: int, usage: str, mem):
        self.id = next(_buffer_ids)
        self.backend = backend
        self.nbytes = nbytes
        self.usage = usage
        self.mem = mem
        self.views: dict = {}   # a host backend's kept views of graph inputs and outputs (HostBackend.view)
        # offs -> Layout: tensors whose bytes the backend keeps arranged for its own kernels
        # (Backend.pack_weight); every read and write from outside them sees the plain bytes
        self.layouts: dict = {}

    def __repr__(self):
        return f"Buffer({self.backend.name}, {self.usage}, {self.nbytes} bytes)"


class Layout:
    """A tensor's bytes [offs, offs + nbytes) of a host buffer, kept by its backend in an
    arrangement of its own kernels (the cpu backend: q4_K and q6_K weight rows in groups of 8). The
    arrangement is a permutation of the same bytes: to_plain and to_packed turn a span of them
    (a NumPy uint8 array) from one form into the other, in place."""
    name = "packed"
    nbytes = 0

    def to_plain(self, mem: np.ndarray) -> None:
        raise NotImplementedError

    def to_packed(self, mem: np.ndarray) -> None:
        raise NotImplementedError


def byte_span(t: Tensor, offs: int) -> tuple[int, int]:
    """[first, last + 1) bytes of t's elements in its buffer, element 0 at offs (strides >= 0)."""
    if t.nelements() == 0:
        return offs, offs
    counts = (t.ne[0] // t.type.blck_size,) + tuple(t.ne[1:])
    return offs, offs + sum((n - 1) * nb for n, nb in zip(counts, t.nb)) + t.type.size


def host_view(mem: np.ndarray, offs: int, t: Tensor) -> np.ndarray:
    """A NumPy-order strided view ([ne3, ne2, ne1, ne0]) of a tensor in host memory; reads of
    overlapping windows are fine, and bounds were checked when the view was made. Block types
    give their rows' raw bytes, [ne3, ne2, ne1, row bytes] (views keep whole blocks in dim 0)."""
    if t.type.is_quantized:
        shape = (t.ne[3], t.ne[2], t.ne[1], t.row_size())
        strides = (t.nb[3], t.nb[2], t.nb[1], 1)
    else:
        shape, strides = tuple(reversed(t.ne)), tuple(reversed(t.nb))
    if t.nelements() == 0:
        return np.zeros(shape, t.type.np_dtype)
    return np.ndarray(shape, t.type.np_dtype, buffer=mem, offset=offs, strides=strides)


class Backend:
    """One device. Subclasses provide memory and kernels; this class drives a graph compute."""

    name = "?"
    guard = 0   # bytes of guard pattern after each planned intermediate (tests set it)
    # bf16 and block types (by name) whose sources this backend's kernels read; a compute node
    # with any other such source is not run here (see `runs`), whatever supports_op says
    wide_types: frozenset = frozenset()

    # -- memory ---------------------------------------------------------------------------
    def alloc_buffer(self, nbytes: int, usage: str, tensors=()) -> Buffer:
        """A buffer of nbytes; ``tensors`` (what it is for) name the culprit in the MemoryError
        raised, before anything is written, when the memory cannot be had."""
        raise NotImplementedError

    def write_tensor(self, t: Tensor, array: np.ndarray):
        raise NotImplementedError

    def read_tensor(self, t: Tensor) -> np.ndarray:
        raise NotImplementedError

    def get_bytes(self, buf: Buffer, offs: int, n: int) -> np.ndarray:
        """n raw bytes of buf from offs, as a host uint8 array."""
        raise NotImplementedError

    def set_bytes(self, buf: Buffer, offs: int, data: np.ndarray):
        raise NotImplementedError

    def pack_weight(self, t: Tensor) -> bool:
        """Rearrange weight t's bytes in place for this backend's MUL_MAT kernels, once its data is
        written (a loader's call, for weights that graphs read only as MUL_MAT's src0): True if
        it did. Reads and writes from outside the kernels still see the plain bytes; any other op
        reading t is refused with an OpError. Backends without such a layout keep t as it is."""
        return False

    # -- compute --------------------------------------------------------------------------
    def supports_op(self, node: Tensor) -> bool:
        raise NotImplementedError

    def missing_type(self, node: Tensor) -> str | None:
        """The name of a bf16 or block type among a compute node's sources that this backend's
        kernels do not take, or None (views move no data and take every type)."""
        if node.op == "NONE" or OPS[node.op].is_view:
            return None
        for k, s in node.srcs.items():
            wide = not s.type.numpy_native or (node.op, k, s.type.name) in F16_WEIGHT_SOURCES
            if wide and s.type.name not in self.wide_types:
                return s.type.name
        return None

    def runs(self, node: Tensor) -> bool:
        """This backend has a kernel for the node's op and for its sources' types."""
        return self.supports_op(node) and self.missing_type(node) is None

    def compute_nodes(self, nodes: list[Tensor], cache: dict | None = None):
        """Run ``nodes`` in order. ``cache`` is the owner's per-graph dict (a Graph's or a
        ScheduledGraph's ``.cache``): what a backend derives from the node list (plans, records)
        goes there, so it lives exactly as long as the graph. Without one, a backend may keep a
        small bounded cache of its own."""
        raise NotImplementedError

    def prepare(self, gf, nodes: list[Tensor], keep=()):
        """Plan and bind memory for the intermediates of ``nodes`` once per ``gf`` (a Graph, or
        the ScheduledGraph whose splits on this device ``nodes`` are: whatever owns ``.cache``,
        and with it the compute buffer); tensors in ``keep`` (read later by another device) are
        never reused. Flagging another node output since the plan was made plans again."""
        key = ("alloc", self.name)
        entry = gf.cache.get(key)
        if entry is not None and entry[3] != output_epoch():
            if entry[0].outputs != output_ids(nodes):
                entry = None                  # a new output must not be overwritten: plan again
            else:
                entry[3] = output_epoch()
        if entry is None:
            plan = plan_graph(nodes, guard=self.guard, keep=keep)
            buf = self.alloc_buffer(plan.size, "compute", plan.tensors)
            if self.guard:
                self.fill_guards(buf, plan)
            entry = gf.cache[key] = [plan, buf, -1, output_epoch()]
        plan, buf, bound_at = entry[:3]
        if bound_at != bind_epoch():          # some other graph re-bound memory since: bind again
            for t in plan.tensors:
                t.buffer, t.offs = buf, plan.offsets[t.id]
                t.overwritten_by = plan.overwritten.get(t.id)   # numpy() refuses these after compute
            entry[2] = bind_epoch()
        return plan

    def fill_guards(self, buf: Buffer, plan):
        raise NotImplementedError

    def rerun_of(self, gf):
        """A callable that runs gf's nodes again exactly as the compute just made did (its plan,
        memory and records), or None: graph_compute's fast path while nothing was re-bound and
        no output flagged since."""
        return None

    def graph_compute(self, gf) -> int:
        """Allocate intermediates (once per graph) and run every node; returns the compute
        buffer's size in bytes."""
        fast = gf.cache.get(("rerun", self.name))
        if fast is not None and fast[0] == bind_epoch() and fast[1] == output_epoch():
            # the same graph again with nothing re-bound and no new output: the checks, the
            # memory plan and the records below would all come out as they did (~1.5 us saved)
            fast[2]()
            self.last_compute_buffer_size = fast[3]
            return fast[3]
        checked = ("checked", self.name)
        if checked not in gf.cache:          # once per graph: leaves never lose their memory
            for leaf in gf.leafs:
                leaf.storage()   # raises a clear error for a leaf without memory
                if leaf.backend is not self:
                    raise OpError(f"leaf {leaf.label} lives on {leaf.backend.name}, not {self.name}: "
                                  f"use a Scheduler to compute across devices")
            for n in gf.nodes:
                if not self.supports_op(n):
                    raise OpError(f"{n.op} {n.label}: not supported by backend {self.name}")
                missing = self.missing_type(n)
                if missing is not None:
                    raise OpError(f"{n.op} {n.label}: backend {self.name} has no kernel for {missing} sources "
                                  f"(it takes {', '.join(sorted(self.wide_types)) or 'none'} of bf16 and the block types)")
            gf.cache[checked] = True
        with reading({}):                    # one device: every node reads its own srcs
            plan = self.prepare(gf, gf.nodes)
            self.compute_nodes(gf.nodes, gf.cache)
        rerun = self.rerun_of(gf)
        if rerun is not None:
            gf.cache[("rerun", self.name)] = (bind_epoch(), output_epoch(), rerun, plan.size)
        self.last_compute_buffer_size = plan.size
        return plan.size

    def __repr__(self):
        return f"<backend {self.name}>"


class HostBackend(Backend):
    """A backend whose memory is host RAM (ref, cpu:N): NumPy arrays of bytes."""

    # whether load_gguf lets a weight's memory be the file's mapping by default (True), or reads
    # the weights into memory of their own (a backend whose kernels stream them says why)
    maps_file_weights = True

    def alloc_buffer(self, nbytes: int, usage: str, tensors=()) -> Buffer:
        check_host_allocation(nbytes, self.name, tensors)
        # 64-byte aligned like ggml's buffers: the planner's 64-byte offsets then land on cache
        # lines, which the CPU kernels' aligned and streaming stores rely on for speed
        try:
            raw = np.zeros(max(nbytes, 1) + 64, np.uint8)
        except MemoryError:
            raise allocation_error(nbytes, self.name, tensors) from None
        start = (-raw.ctypes.data) % 64
        return Buffer(self, nbytes, usage, raw[start:start + max(nbytes, 1)])

    def view(self, t: Tensor) -> np.ndarray:
        return self._kept_view(t, flat=False)

    # -- bytes a backend keeps packed (Buffer.layouts) -------------------------------------------
    @staticmethod
    def _layouts_over(buf: Buffer, lo: int, hi: int) -> list:
        """(offs, Layout) of the packed tensors of buf that bytes [lo, hi) touch."""
        return [(o, lay) for o, lay in buf.layouts.items() if o < hi and lo < o + lay.nbytes]

    def _plain_bytes(self, buf: Buffer, lo: int, n: int) -> np.ndarray:
        """A copy of bytes [lo, lo + n) of buf as they are without packing."""
        out = buf.mem[lo:lo + n].copy()
        for o, lay in self._layouts_over(buf, lo, lo + n):
            whole = buf.mem[o:o + lay.nbytes].copy()
            lay.to_plain(whole)
            a, b = max(lo, o), min(lo + n, o + lay.nbytes)
            out[a - lo:b - lo] = whole[a - o:b - o]
        return out

    def _write_plain(self, buf: Buffer, lo: int, hi: int, write) -> None:
        """write() into bytes [lo, hi) with every packed tensor they touch unpacked around it (each
        one unpacked is packed again, whatever fails)."""
        unpacked = []
        try:
            for o, lay in self._layouts_over(buf, lo, hi):
                lay.to_plain(buf.mem[o:o + lay.nbytes])
                unpacked.append((o, lay))
            write()
        finally:
            for o, lay in unpacked:
                lay.to_packed(buf.mem[o:o + lay.nbytes])

    def _refuse_packed(self, t: Tensor, buf: Buffer, offs: int) -> None:
        over = self._layouts_over(buf, *byte_span(t, offs))
        if over:
            raise OpError(f"tensor {t.label}: its memory holds {over[0][1].name}, packed by {self.name} "
                          f"for MUL_MAT; only MUL_MAT reads it in place (numpy() and set() see the plain bytes)")

    def flat_view(self, t: Tensor) -> np.ndarray | None:
        """A writable 1-D view of a contiguous element-type graph input or output, in memory
        order; None for any other tensor. What a model's inputs are written through every step:
        one NumPy assignment each, where Tensor.set makes several calls (on the caches a decode
        step's weights have just flushed, every distinct NumPy call costs tens of microseconds)."""
        return self._kept_view(t, flat=True)

    def _kept_view(self, t: Tensor, flat: bool):
        """t's view (flat: its flat_view). A graph's inputs and outputs are written and read every
        step, so theirs are made once and kept with the buffer (making one costs more than copying
        a token's data through it); any other tensor's is made each time."""
        buf, offs = t.storage()
        if buf.layouts:
            self._refuse_packed(t, buf, offs)
        kept = "input" in t.flags or "output" in t.flags
        if not kept:
            return None if flat else host_view(buf.mem, offs, t)
        key = (t.id, offs, flat)
        if key not in buf.views:
            if not flat:
                buf.views[key] = host_view(buf.mem, offs, t)
            else:
                ok = not t.type.is_quantized and t.is_contiguous()
                buf.views[key] = self._kept_view(t, flat=False).reshape(-1) if ok else None
        return buf.views[key]

    def write_tensor(self, t: Tensor, array: np.ndarray):
        buf, offs = t.storage()
        if buf.layouts and self._layouts_over(buf, *byte_span(t, offs)):
            self._write_plain(buf, *byte_span(t, offs), lambda: np.copyto(host_view(buf.mem, offs, t), array))
        else:
            np.copyto(self.view(t), array)

    def read_tensor(self, t: Tensor) -> np.ndarray:
        buf, offs = t.storage()
        if buf.layouts:   # (only then: a step's logits are read through here)
            lo, hi = byte_span(t, offs)
            if self._layouts_over(buf, lo, hi):
                return host_view(self._plain_bytes(buf, lo, hi - lo), offs - lo, t).copy()
        return self.view(t).copy()

    def get_bytes(self, buf: Buffer, offs: int, n: int) -> np.ndarray:
        if buf.layouts:
            return self._plain_bytes(buf, offs, n)
        return buf.mem[offs:offs + n].copy()

    def set_bytes(self, buf: Buffer, offs: int, data: np.ndarray):
        def write():
            buf.mem[offs:offs + data.size] = data
        if buf.layouts:
            self._write_plain(buf, offs, offs + data.size, write)
        else:
            write()

    def save_rows(self, pairs):
        """For each (dst, rows) of pairs, copy rows (a [count, n] uint8 view of this backend's
        memory, rows dense) into dst (a dense [count, n] uint8 array) for keeping, as an undo
        journal does: a copy that is read back only if a step fails (a backend may store it past
        the caches). One call per step's spans, so a backend can run them as one batch."""
        for dst, rows in pairs:
            np.copyto(dst, rows)

    def fill_guards(self, buf: Buffer, plan):
        buf.mem[:] = GUARD_BYTE

    def guards_intact(self, gf) -> bool:
        """True when no byte between planned tensors was written (tests use guard > 0)."""
        plan, buf = gf.cache[("alloc", self.name)][:2]
        used = np.zeros(buf.mem.size, bool)
        for t in plan.tensors:
            o = plan.offsets[t.id]
            used[o:o + t.nbytes()] = True
        return bool(np.all(buf.mem[~used] == GUARD_BYTE))


# -- device registry ---------------------------------------------------------------------------
# Backends register themselves by kind; the core finds the module of a kind through the
# "minigraph.backends" entry-point group (pyproject.toml), so it never imports a backend by name.
_FACTORIES: dict = {}
_COMPOSITES: dict = {}
_NAMED: dict = {}
_INSTANCES: dict = {}
ENTRY_POINT_GROUP = "minigraph.backends"


def register_backend(kind: str, factory, *, composite: bool = False, named: bool = False):
    """Register a device kind. factory(index: int) -> Backend serves names 'kind' and 'kind:N';
    with composite=True, factory(inner_names: list[str]) -> Backend serves 'kind(dev,dev,...)';
    with named=True, factory(rest: str) -> Backend serves 'kind:REST' for any text REST (the
    factory checks it, and the Backend's name is the canonical form)."""
    (_COMPOSITES if composite else _NAMED if named else _FACTORIES)[kind] = factory


def known_kinds() -> list[str]:
    """Every device kind that is registered or installed (whether or not it can load here)."""
    from importlib.metadata import entry_points
    return sorted(set(_FACTORIES) | set(_COMPOSITES) | set(_NAMED) | {e.name for e in entry_points(group=ENTRY_POINT_GROUP)})


def _load_kind(kind: str):
    from importlib.metadata import entry_points
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == kind:
            ep.load()
            return


_NAME_HELP = "expected 'ref', 'cpu', 'cpu:N', 'cuda:N', 'ggml:DEVICE' or 'meta(dev,dev,...)'"


def backend(name: str, threads: int | None = None) -> Backend:
    """The device called ``name``: 'ref', 'cpu' (= 'cpu:0'), 'cpu:N', 'cuda:N', a named device of a
    kind registered with named=True (e.g. 'ggml:cpu', 'ggml:rpc://HOST:PORT'), or a device made of
    several others, e.g. the meta device 'meta(cpu:0,cpu:1)'. ``threads`` sets the device's
    thread count (devices are shared: it holds for every user of that device); a device without
    one refuses it."""
    be = _device(name)
    if threads is not None:
        setter = getattr(be, "set_n_threads", None)
        if setter is None:
            raise ValueError(f"device {be.name} has no thread count: threads= applies to cpu devices")
        try:
            setter(threads)
        except ValueError as e:
            raise ValueError(f"device {be.name}: threads={threads!r}: {e}") from None
    return be


def _device(name: str) -> Backend:
    if not isinstance(name, str):
        raise ValueError(f"a device name is a string such as 'cpu' or 'cuda:0', got {type(name).__name__}")
    text = name.strip()
    named = re.fullmatch(r"([a-z]+):(.*)", text)
    if named and not named.group(2).isdigit():
        kind = named.group(1)
        if kind not in _NAMED:
            _load_kind(kind)
        if kind in _NAMED:
            be = _NAMED[kind](named.group(2))
            return _INSTANCES.setdefault(be.name, be)
    m = re.fullmatch(r"([a-z]+)\((.*)\)", text) or re.fullmatch(r"([a-z]+)(?::(\d+))?", text)
    if not m:
        raise ValueError(f"bad device name {name!r}: {_NAME_HELP}")
    kind, composite = m.group(1), text.endswith(")")
    table = _COMPOSITES if composite else _FACTORIES
    if kind not in table:
        _load_kind(kind)
    if kind not in table:
        form = f"{kind}(...)" if composite else kind
        raise ValueError(f"unknown device {name!r}: no device kind {form!r}; known kinds are "
                         f"{', '.join(known_kinds())} ({_NAME_HELP})")
    if composite:
        inner_names = [s.strip() for s in m.group(2).split(",") if s.strip()]
        if not inner_names:
            raise ValueError(f"bad device name {name!r}: {kind}(...) needs at least one device inside")
        inner = [backend(n).name for n in inner_names]
        canonical = f"{kind}(" + ",".join(inner) + ")"
        if canonical not in _INSTANCES:
            _INSTANCES[canonical] = table[kind](inner)
        return _INSTANCES[canonical]
    if kind == "ref" and m.group(2) is not None:
        raise ValueError(f"bad device name {name!r}: the reference backend is just 'ref'")
    idx = int(m.group(2) or 0)
    canonical = "ref" if kind == "ref" else f"{kind}:{idx}"
    if canonical not in _INSTANCES:
        _INSTANCES[canonical] = table[kind](idx)
    return _INSTANCES[canonical]


def alloc_ctx_tensors(ctx: Context, be: Backend, usage: str = "weights") -> Buffer | None:
    """Give every leaf of ctx that has no memory yet a place in one new buffer on ``be``.

    ``usage`` is ggml's buffer usage: 'weights' (the default: model weights; an op that reads one
    is placed on its device by the scheduler) or 'any' (state, caches, inputs)."""
    if usage not in ("weights", "any"):
        raise ValueError(f"usage must be 'weights' or 'any', got {usage!r}")
    leaves = [t for t in ctx.leaves() if t.buffer is None]
    if not leaves:
        return None
    offs, total = [], 0
    for t in leaves:
        offs.append(total)
        total += (t.nbytes() + 63) // 64 * 64
    buf = be.alloc_buffer(total, usage, leaves)
    for t, o in zip(leaves, offs):
        t.buffer, t.offs = buf, o
    bind = getattr(be, "bind_tensors", None)   # the meta device slices weights/caches per device
    if bind is not None:
        bind(buf, leaves)
    return buf


def is_compute_node(n: Tensor) -> bool:
    """Nodes that run a kernel: everything but view ops (write-through ops do run)."""
    return n.op != "NONE" and not OPS[n.op].is_view and n.nelements() > 0


__all__ = ["Layout", "byte_span", "Buffer", "Backend", "HostBackend", "backend", "register_backend", "alloc_ctx_tensors",
           "host_view", "is_compute_node", "writes_through"]
