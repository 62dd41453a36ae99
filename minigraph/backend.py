"""The backend interface, host buffers, the device registry and leaf allocation."""
from __future__ import annotations

import itertools
import re

import numpy as np

from .alloc import plan_graph
from .errors import OpError
from .registry import OPS, writes_through
from .tensor import Context, Tensor, bind_epoch

GUARD_BYTE = 0xA5
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

    def __repr__(self):
        return f"Buffer({self.backend.name}, {self.usage}, {self.nbytes} bytes)"


def host_view(mem: np.ndarray, offs: int, t: Tensor) -> np.ndarray:
    """A NumPy-order strided view ([ne3, ne2, ne1, ne0]) of a tensor in host memory; reads of
    overlapping windows are fine, and bounds were checked when the view was made."""
    shape = tuple(reversed(t.ne))
    if t.nelements() == 0:
        return np.zeros(shape, t.type.np_dtype)
    return np.ndarray(shape, t.type.np_dtype, buffer=mem, offset=offs, strides=tuple(reversed(t.nb)))


class Backend:
    """One device. Subclasses provide memory and kernels; this class drives a graph compute."""

    name = "?"
    guard = 0   # bytes of guard pattern after each planned intermediate (tests set it)

    # -- memory ---------------------------------------------------------------------------
    def alloc_buffer(self, nbytes: int, usage: str) -> Buffer:
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

    # -- compute --------------------------------------------------------------------------
    def supports_op(self, node: Tensor) -> bool:
        raise NotImplementedError

    def compute_nodes(self, nodes: list[Tensor]):
        raise NotImplementedError

    def prepare(self, gf, nodes: list[Tensor], keep=()):
        """Plan and bind memory for the intermediates of ``nodes`` (once per graph); tensors in
        ``keep`` (read later by another device) are never reused."""
        key = ("alloc", self.name)
        entry = gf.cache.get(key)
        if entry is None:
            plan = plan_graph(nodes, guard=self.guard, keep=keep)
            buf = self.alloc_buffer(plan.size, "compute")
            if self.guard:
                self.fill_guards(buf, plan)
            entry = gf.cache[key] = [plan, buf, -1]
        plan, buf, bound_at = entry
        if bound_at != bind_epoch():          # some other graph re-bound memory since: bind again
            for t in plan.tensors:
                t.buffer, t.offs = buf, plan.offsets[t.id]
            entry[2] = bind_epoch()
        return plan

    def fill_guards(self, buf: Buffer, plan):
        raise NotImplementedError

    def graph_compute(self, gf) -> int:
        """Allocate intermediates (once per graph) and run every node; returns the compute
        buffer's size in bytes."""
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
            gf.cache[checked] = True
        plan = self.prepare(gf, gf.nodes)
        self.compute_nodes(gf.nodes)
        self.last_compute_buffer_size = plan.size
        return plan.size

    def __repr__(self):
        return f"<backend {self.name}>"


class HostBackend(Backend):
    """A backend whose memory is host RAM (ref, cpu:N): NumPy arrays of bytes."""

    def alloc_buffer(self, nbytes: int, usage: str) -> Buffer:
        # 64-byte aligned like ggml's buffers: the planner's 64-byte offsets then land on cache
        # lines, which the CPU kernels' aligned and streaming stores rely on for speed
        raw = np.zeros(max(nbytes, 1) + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        return Buffer(self, nbytes, usage, raw[start:start + max(nbytes, 1)])

    def view(self, t: Tensor) -> np.ndarray:
        buf, offs = t.storage()
        return host_view(buf.mem, offs, t)

    def write_tensor(self, t: Tensor, array: np.ndarray):
        np.copyto(self.view(t), array)

    def read_tensor(self, t: Tensor) -> np.ndarray:
        return self.view(t).copy()

    def get_bytes(self, buf: Buffer, offs: int, n: int) -> np.ndarray:
        return buf.mem[offs:offs + n].copy()

    def set_bytes(self, buf: Buffer, offs: int, data: np.ndarray):
        buf.mem[offs:offs + data.size] = data

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
_FACTORIES: dict = {}
_INSTANCES: dict = {}


def register_backend(kind: str, factory):
    """factory(index: int) -> Backend, for device names 'kind' or 'kind:N'."""
    _FACTORIES[kind] = factory


def backend(name: str) -> Backend:
    """The device called ``name``: 'ref', 'cpu' (= 'cpu:0'), 'cpu:N', 'cuda:N', or a meta device
    over several of them, 'meta(cpu:0,cpu:1)' (backends/meta)."""
    if name.strip().startswith("meta("):
        from backends.meta import make_meta, parse_meta_name
        names = parse_meta_name(name)
        if names is None:
            raise ValueError(f"bad device name {name!r}: expected meta(dev,dev,...), e.g. meta(cpu:0,cpu:1)")
        inner = [backend(n).name for n in names]
        canonical = "meta(" + ",".join(inner) + ")"
        if canonical not in _INSTANCES:
            _INSTANCES[canonical] = make_meta(inner)
        return _INSTANCES[canonical]
    m = re.fullmatch(r"([a-z]+)(?::(\d+))?", name.strip())
    if not m:
        raise ValueError(f"bad device name {name!r}: expected 'ref', 'cpu', 'cpu:N' or 'cuda:N'")
    kind, idx = m.group(1), int(m.group(2) or 0)
    if kind == "ref" and m.group(2) is not None:
        raise ValueError(f"bad device name {name!r}: the reference backend is just 'ref'")
    canonical = "ref" if kind == "ref" else f"{kind}:{idx}"
    if canonical not in _INSTANCES:
        if kind not in _FACTORIES:
            _load_backend_module(kind)
        if kind not in _FACTORIES:
            raise ValueError(f"unknown device {name!r}: known kinds are {sorted(_FACTORIES)}")
        _INSTANCES[canonical] = _FACTORIES[kind](idx)
    return _INSTANCES[canonical]


def _load_backend_module(kind: str):
    import importlib
    try:
        importlib.import_module(f"backends.{kind}")
    except ModuleNotFoundError as e:
        if e.name not in (f"backends.{kind}", "backends"):
            raise


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
    buf = be.alloc_buffer(total, usage)
    for t, o in zip(leaves, offs):
        t.buffer, t.offs = buf, o
    bind = getattr(be, "bind_tensors", None)   # the meta device slices weights/caches per device
    if bind is not None:
        bind(buf, leaves)
    return buf


def is_compute_node(n: Tensor) -> bool:
    """Nodes that run a kernel: everything but view ops (write-through ops do run)."""
    return n.op != "NONE" and not OPS[n.op].is_view and n.nelements() > 0


__all__ = ["Buffer", "Backend", "HostBackend", "backend", "register_backend", "alloc_ctx_tensors",
           "host_view", "is_compute_node", "writes_through"]
