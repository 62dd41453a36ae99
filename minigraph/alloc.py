"""Memory planning for a graph's intermediates on one device.

Each non-view intermediate gets an offset in one compute buffer; a tensor's memory is reused
once its last consumer (directly or through a view) has run. Views and write-through results
(cpy, set_rows, in-place ops) alias memory they do not own and get none. Tensors flagged output,
and nodes no other node consumes, are never overwritten. The plan records which intermediates
did have their memory handed to a later node: after a compute their bytes are gone, and
Tensor.numpy() refuses to read them."""
from __future__ import annotations

import os
import weakref
from bisect import bisect_right
from dataclasses import dataclass, field

from .sources import srcs_of
from .tensor import Tensor

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def available_bytes() -> tuple[int | None, str]:
    """(bytes, where the figure came from): MemAvailable + SwapFree from /proc/meminfo, else the
    free physical pages from os.sysconf; (None, why) when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            fields = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()[1:]}
        if "MemAvailable" in fields:
            return (fields["MemAvailable"] + fields.get("SwapFree", 0),
                    "available memory (MemAvailable + SwapFree in /proc/meminfo)")
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free memory (os.sysconf)"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def allocation_error(nbytes: int, device: str, tensors=(), limit: str = "") -> MemoryError:
    """The one-line MemoryError for a buffer that cannot be had: the size, the device and the
    tensor(s) it was for (the largest named first), and the limit it ran into."""
    ts = sorted(tensors, key=lambda t: -t.nbytes())
    what = ""
    if ts:
        big = ts[0]
        what = f" for tensor {big.label} ({big.type.name} {list(big.ne)}, {human_bytes(big.nbytes())}"
        what += f", the largest of {len(ts)})" if len(ts) > 1 else ")"
    return MemoryError(f"cannot allocate {human_bytes(nbytes)} ({nbytes} bytes) on {device}{what}: "
                       f"{limit or 'the allocator refused'}; nothing was allocated or written")


def check_host_allocation(nbytes: int, device: str, tensors=()) -> None:
    """Refuse, before any memory is touched, a host buffer larger than the memory the machine
    can still give: the kernel would either refuse it or grant it lazily and kill the process
    (the OOM killer) once it is written."""
    avail, source = available_bytes()
    if avail is not None and nbytes > avail:
        raise allocation_error(nbytes, device, tensors, f"more than the {source} of {human_bytes(avail)}")


def needs_memory(node: Tensor) -> bool:
    if node.op == "NONE" or node.view_src is not None:
        return False
    buf = node.buffer
    return buf is None or buf.usage == "compute"


@dataclass
class Plan:
    offsets: dict = field(default_factory=dict)   # tensor id -> byte offset
    tensors: list = field(default_factory=list)   # tensors placed, in node order
    size: int = 0                                  # peak bytes (the compute buffer's size)
    naive_size: int = 0                            # sum of every intermediate's size
    overwritten: dict = field(default_factory=dict)  # tensor id -> weakref to the node given its memory
    outputs: frozenset = frozenset()               # ids of the nodes flagged output when planned

    def __repr__(self):
        return f"Plan({len(self.tensors)} tensors, {self.size} bytes, naive {self.naive_size})"


class _FreeList:
    """Best-fit free blocks over a growing arena; adjacent blocks merge."""

    def __init__(self, guard: int):
        self.blocks: list[list[int]] = []   # [offset, size], sorted by offset
        self.top = 0
        self.guard = guard

    def alloc(self, size: int) -> int:
        size = _align(size + self.guard)
        best = None
        for b in self.blocks:
            if b[1] >= size and (best is None or b[1] < best[1]):
                best = b
        if best is not None:
            off = best[0]
            best[0] += size
            best[1] -= size
            if best[1] == 0:
                self.blocks.remove(best)
            return off
        off = self.top
        self.top += size
        return off

    def free(self, off: int, size: int):
        size = _align(size + self.guard)
        self.blocks.append([off, size])
        self.blocks.sort()
        merged = []
        for b in self.blocks:
            if merged and merged[-1][0] + merged[-1][1] == b[0]:
                merged[-1][1] += b[1]
            else:
                merged.append(b)
        if merged and merged[-1][0] + merged[-1][1] == self.top:   # give the tail back
            self.top = merged[-1][0]
            merged.pop()
        self.blocks = merged


class _Released:
    """Byte ranges of freed intermediates not yet handed on (disjoint, sorted by offset): an
    allocation that overlaps one marks that tensor overwritten."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.tensors: list[Tensor] = []

    def add(self, off: int, t: Tensor):
        if t.nbytes() == 0:
            return
        i = bisect_right(self.starts, off)
        self.starts.insert(i, off)
        self.ends.insert(i, off + t.nbytes())
        self.tensors.insert(i, t)

    def take(self, off: int, size: int, by: Tensor, overwritten: dict):
        i = bisect_right(self.ends, off)          # the first range that ends after off
        while i < len(self.starts) and self.starts[i] < off + size:
            # weak: a plan must not keep the graph's nodes alive; named only if read after (numpy)
            overwritten[self.tensors[i].id] = weakref.ref(by)
            del self.starts[i], self.ends[i], self.tensors[i]


def output_ids(nodes) -> frozenset:
    return frozenset(n.id for n in nodes if n.is_output)


def plan_graph(nodes: list[Tensor], guard: int = 0, keep=()) -> Plan:
    """Assign offsets to every node that needs memory. ``guard`` bytes follow each tensor
    (tests fill them with a pattern to catch out-of-bounds writes)."""
    last_use: dict[int, int] = {}
    consumed: set[int] = set()
    for i, n in enumerate(nodes):
        for s in list(srcs_of(n).values()) + ([n.view_src] if n.view_src is not None else []):
            r = s.root()
            last_use[r.id] = i
            consumed.add(s.id)
    keep = {n.id for n in nodes if n.is_output or n.id not in consumed} | {t.id for t in keep}
    # a view or write-through result that must stay readable keeps its root alive
    keep |= {n.root().id for n in nodes if n.id in keep}

    plan = Plan(outputs=output_ids(nodes))
    free = _FreeList(guard)
    released = _Released()
    frees_at: dict[int, list[Tensor]] = {}
    # whole-graph tensors (Tensor.set_whole_graph) take their bytes before any node runs
    early = {n.id: free.alloc(n.nbytes()) for n in nodes if "whole_graph" in n.flags and needs_memory(n)}
    for i, n in enumerate(nodes):
        if needs_memory(n):
            size = n.nbytes()
            plan.naive_size += _align(size + guard)
            off = plan.offsets[n.id] = early[n.id] if n.id in early else free.alloc(size)
            released.take(off, size, n, plan.overwritten)
            plan.tensors.append(n)
            if n.id not in keep:
                frees_at.setdefault(last_use.get(n.id, i), []).append(n)
        for t in frees_at.pop(i, []):
            free.free(plan.offsets[t.id], t.nbytes())
            released.add(plan.offsets[t.id], t)
        plan.size = max(plan.size, free.top)
    return plan
