"""The scheduler: ggml's backend-scheduler passes (ggml_backend_sched: five passes, then splits and copies) over minigraph devices.

Backends are in priority order, index 0 highest, the last one the host. Every device has its own
memory kind, so a device accepts only its own buffers (supports_buft) and every crossing is a
real byte copy. Every assignment records ggml's cause code (usr, 1.dst, 1.inp, 1.wgtN, 2.sup,
3.best, 3.upg, 4.vsrc, 4.cur)."""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

from . import env
from .backend import Backend
from .errors import OpError
from .registry import OPS
from .report import PlacementReport
from .sources import reading, stand
from .tensor import Tensor

log = logging.getLogger("minigraph.sched")


def is_view_op(t: Tensor) -> bool:
    return t.op != "NONE" and OPS[t.op].is_view


@dataclass
class Split:
    backend: int
    i_start: int
    i_end: int = -1
    inputs: list = field(default_factory=list)     # original tensors copied in for this split
    nodes: list = field(default_factory=list)      # compute order (views included)


class ScheduledGraph:
    """One schedule of one version of a graph: where every tensor runs and why, the splits, the
    copies between devices, and which sources each node reads instead (a copy on its own
    device). The graph itself is never changed: nodes keep their srcs. Backends see the
    replacements through minigraph.sources.srcs_of while this schedule plans or computes, and,
    while it is the graph's newest schedule, when a result is read back outside a compute."""

    def __init__(self, gf, backends: list, assign: dict, cause: dict):
        self.gf = gf
        self.version = gf.version
        self.backends = backends
        self.assign = assign                  # tensor id -> backend index
        self.cause = cause                    # tensor id -> ggml's cause code
        self.splits: list[Split] = []
        self.copies: dict[tuple[int, int], Tensor] = {}   # (tensor id, backend) -> copy
        self.copy_src: dict[int, Tensor] = {}             # copy id -> original
        self.copy_users: dict[int, list[int]] = {}        # copy id -> split indices that read it
        self.replaced: dict[int, dict] = {}               # node id -> its srcs, copies in place
        self.replacing: list[Tensor] = []                 # the nodes listed in replaced
        self.cache: dict = {}                 # the backends' memory plans for these splits
        self.allocated = False

    @property
    def is_current(self) -> bool:
        """False once nodes were added to the graph after it was scheduled."""
        return self.gf.version == self.version

    def backend_of(self, t: Tensor) -> Backend | None:
        i = self.assign.get(t.id, -1)
        return self.backends[i] if i >= 0 else None

    def srcs_of(self, node: Tensor) -> dict:
        """The sources ``node`` reads under this schedule."""
        return self.replaced.get(node.id, node.srcs)

    def reading(self):
        """A block in which backends see this schedule's copies as the nodes' sources."""
        return reading(self.replaced)

    def placement_report(self) -> PlacementReport:
        return PlacementReport.from_schedule(self)

    def copy_stats(self) -> tuple[int, int]:
        """(copies, bytes copied) per compute: the placement report's n_copies and copy_bytes,
        without naming every node (a report costs ~3 ms on a 700-node graph)."""
        return len(self.copies), sum(self.copy_src[c.id].nbytes() for c in self.copies.values())


# the newest schedule of each graph, so that drawings and reports of a graph find it; weak both
# ways: neither the graph nor the schedule is kept alive by this table
_latest: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def schedule_of(gf, sched=None) -> ScheduledGraph | None:
    """The schedule to describe gf with: ``sched`` (a ScheduledGraph or a Scheduler) if given,
    else gf's newest schedule that is still alive and current."""
    if sched is not None:
        if isinstance(sched, Scheduler):
            sched = sched.scheduled
        if not isinstance(sched, ScheduledGraph) or sched.gf is not gf:
            raise ValueError("sched must be a Scheduler or ScheduledGraph that scheduled this graph")
        return sched
    ref = _latest.get(gf)
    found = ref() if ref is not None else None
    return found if found is not None and found.is_current else None


class Scheduler:
    def __init__(self, backends: list[Backend]):
        if not backends:
            raise ValueError("a Scheduler needs at least one backend")
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"a backend appears twice in {names}")
        self.backends = list(backends)
        self.reset()

    # -- state ------------------------------------------------------------------------------
    def reset(self):
        self.assign: dict[int, int] = {}      # tensor id -> backend index (while scheduling)
        self.cause: dict[int, str] = {}
        self.pins: dict[int, int] = {}
        self.scheduled: ScheduledGraph | None = None

    def set_tensor_backend(self, t: Tensor, be: Backend):
        """Pin t to a backend (cause 'usr'); passes 1, 2 and 4 respect it."""
        self.pins[t.id] = self._index(be)
        self.scheduled = None

    def _index(self, be: Backend) -> int:
        for i, b in enumerate(self.backends):
            if b is be:
                return i
        raise ValueError(f"{be.name} is not one of this scheduler's backends {[b.name for b in self.backends]}")

    def backend_of(self, t: Tensor) -> Backend | None:
        i = self.assign.get(t.id, -1)
        return self.backends[i] if i >= 0 else None

    # the newest schedule's parts, for callers that read them off the scheduler
    gf = property(lambda self: self.scheduled.gf if self.scheduled is not None else None)
    splits = property(lambda self: self._part("splits"))
    copies = property(lambda self: self._part("copies"))
    copy_src = property(lambda self: self._part("copy_src"))
    copy_users = property(lambda self: self._part("copy_users"))

    def _part(self, name: str):
        if self.scheduled is None:
            raise OpError(f"scheduler: no graph has been scheduled yet, so it has no {name} "
                          f"(call split_graph, alloc_graph or graph_compute)")
        return getattr(self.scheduled, name)

    @property
    def last(self) -> int:
        return len(self.backends) - 1

    # -- predicates -------------------------------------------------------------------------
    @staticmethod
    def _placed_buffer(t: Tensor):
        """The buffer where t lives, ignoring planner-owned compute memory (re-planned each time)."""
        buf = t.root().buffer
        return buf if buf is not None and buf.usage != "compute" else None

    def _buft_index(self, buf) -> int:
        for i, b in enumerate(self.backends):
            if b is buf.backend:
                return i
        raise OpError(f"a tensor lives on {buf.backend.name}, which is not one of this scheduler's "
                      f"backends {[b.name for b in self.backends]}")

    def _supports(self, b: int, node: Tensor) -> bool:
        return node.op == "NONE" or is_view_op(node) or self.backends[b].runs(node)

    def _from_buffer(self, t: Tensor, op_node: Tensor) -> int:
        buf = self._placed_buffer(t)
        if buf is None:
            return -1
        b = self._buft_index(buf)
        return b if self._supports(b, op_node) else -1

    def _buffer_supported(self, t: Tensor, b: int) -> bool:
        buf = self._placed_buffer(t)
        if buf is not None:
            return self._buft_index(buf) == b
        a = self.assign.get(t.id, -1)
        if a < 0 and t.view_src is not None:
            a = self.assign.get(t.view_src.id, -1)
        return a == b

    def _set(self, t: Tensor, b: int, cause: str):
        self.assign[t.id] = b
        self.cause[t.id] = cause

    # -- passes -----------------------------------------------------------------------------
    def _pass1(self, t: Tensor):
        if t.id in self.pins:
            self._set(t, self.pins[t.id], "usr")
            return
        b = self._from_buffer(t, t)
        if b >= 0:
            self._set(t, b, "1.dst")
            return
        if self._placed_buffer(t) is not None:
            raise OpError(f"{t.op} {t.label}: lives on {t.root().buffer.backend.name}, which cannot run it")
        if t.is_input:
            self._set(t, self.last, "1.inp")
            return
        for slot, s in enumerate(t.srcs.values()):
            if s.buffer is not None and s.view_src is None and s.buffer.usage == "weights":
                self._set(t, self._from_buffer(s, t), f"1.wgt{slot}")
                return

    def _pass2(self, nodes):
        def sweep(order, gpu_only):
            cur = -1
            for n in order:
                if is_view_op(n):
                    continue
                a = self.assign.get(n.id, -1)
                if a >= 0:
                    cur = -1 if (gpu_only and a == self.last) else a
                elif cur >= 0 and self._supports(cur, n):
                    self._set(n, cur, "2.sup")
        sweep(nodes, True)
        sweep(reversed(nodes), True)
        sweep(nodes, False)
        sweep(reversed(nodes), False)

    def _pass3(self, nodes):
        for n in nodes:
            if is_view_op(n):
                continue
            a = self.assign.get(n.id, -1)
            if a < 0:
                best, best_count = -1, -1
                for b in range(len(self.backends)):
                    if not self._supports(b, n):
                        continue
                    count = sum(1 for s in n.srcs.values()
                                if (self.assign.get(s.id, -1) >= 0 or (s.view_src is not None and self.assign.get(s.view_src.id, -1) >= 0))
                                and self._buffer_supported(s, b))
                    if count > best_count:
                        best, best_count = b, count
                if best >= 0:
                    self._set(n, best, "3.best")
            # upgrade to a higher-priority backend with the same buffer type: every device here has
            # its own memory kind, so no other backend shares a's buffer type and it never fires

    def _pass4(self, nodes):
        for n in nodes:
            if self.assign.get(n.id, -1) < 0 and n.view_src is not None:
                v = self.assign.get(n.view_src.id, -1)
                if v >= 0:
                    self._set(n, v, "4.vsrc")
            for s in n.srcs.values():
                if self.assign.get(s.id, -1) < 0:
                    if s.view_src is not None:
                        v = self.assign.get(s.view_src.id, -1)
                        if v >= 0:
                            self._set(s, v, "4.vsrc")
                    else:
                        cur = self.assign.get(n.id, -1)
                        if cur >= 0:
                            self._set(s, cur, "4.cur")
            if self.assign.get(n.id, -1) < 0:
                for b in range(len(self.backends)):
                    if self._supports(b, n):
                        self._set(n, b, "2.sup")
                        break
            if self.assign.get(n.id, -1) < 0:
                why = "; ".join(f"backend {b.name} has no kernel for {m} sources" for b in self.backends
                                if b.supports_op(n) and (m := b.missing_type(n)) is not None)
                raise OpError(f"{n.op} {n.label}: no backend of {[b.name for b in self.backends]} supports it"
                              + (f" ({why})" if why else ""))

    def _pass5(self, sg: ScheduledGraph):
        nodes = sg.gf.nodes
        first = next((i for i, n in enumerate(nodes) if not is_view_op(n)), 0)
        cur = self.assign[nodes[first].id] if nodes else self.last
        split = Split(cur, 0)
        copy_names: dict[str, int] = {}
        for i, n in enumerate(nodes):
            if is_view_op(n):
                split.nodes.append(n)
                continue
            b = self.assign[n.id]
            cut = b != cur
            if not cut and split.inputs:
                for s in n.srcs.values():
                    sb = self.assign.get(s.id, -1)
                    if (s.buffer is not None and s.view_src is None and s.buffer.usage == "weights"
                            and sb != cur and not self._buffer_supported(s, cur)):
                        cut = True
                        break
            if cut:
                split.i_end = i
                sg.splits.append(split)
                split = Split(b, i)
                cur = b
            for slot, s in n.srcs.items():
                sb = self.assign.get(s.id, -1)
                if sb < 0:
                    raise OpError(f"{n.op} {n.label}: source {s.label} was never placed")
                if sb != cur and not self._buffer_supported(s, cur):
                    key = (s.id, cur)
                    if key not in sg.copies:
                        # "device#name#k": k tells apart copies of tensors that share a name
                        # (each layer's slot_order), so every copy in a report has its own name
                        base = f"{self.backends[cur].name}#{s.name or f'{s.op.lower()}_{s.id}'}"
                        k = copy_names[base] = copy_names.get(base, -1) + 1
                        c = Tensor(None, s.type, s.ne, s.nb, name=f"{base}#{k}")
                        sg.copies[key] = c
                        sg.copy_src[c.id] = s
                        sg.cause[c.id] = "4.cpy"
                        split.inputs.append(s)
                    c = sg.copies[key]
                    users = sg.copy_users.setdefault(c.id, [])
                    if len(sg.splits) not in users:
                        users.append(len(sg.splits))
                    # the node reads the copy (ggml rewrites src[j]; here the schedule says so)
                    if n.id not in sg.replaced:
                        sg.replaced[n.id] = dict(n.srcs)
                        sg.replacing.append(n)
                    sg.replaced[n.id][slot] = c
            split.nodes.append(n)
        split.i_end = len(nodes)
        sg.splits.append(split)

    # -- public -----------------------------------------------------------------------------
    def split_graph(self, gf) -> ScheduledGraph:
        """Place every tensor and cut the graph into splits (ggml_backend_sched_split_graph).
        Returns the schedule, which this scheduler keeps as its newest; the graph is unchanged."""
        self.assign, self.cause = {}, {}
        for t in gf.leafs + gf.nodes:
            self._pass1(t)
        self._pass2(gf.nodes)
        self._pass3(gf.nodes)
        self._pass4(gf.nodes)
        for leaf in gf.leafs:
            if self.assign.get(leaf.id, -1) < 0:
                raise OpError(f"leaf {leaf.label} has no device: no node consumes it directly; mark it input")
        sg = ScheduledGraph(gf, self.backends, self.assign, self.cause)
        self._pass5(sg)
        self.scheduled = sg
        prev = _latest.get(gf)
        prev = prev() if prev is not None else None
        stand({n: sg.replaced[n.id] for n in sg.replacing}, withdraw=prev.replacing if prev is not None else ())
        _latest[gf] = weakref.ref(sg)
        self._debug_print()
        return sg

    def _schedule_for(self, gf) -> ScheduledGraph:
        """The newest schedule if it is gf's and current, else a new one: nodes added to the
        graph after it was scheduled are never skipped."""
        sg = self.scheduled
        if sg is not None and sg.gf is gf and sg.is_current:
            return sg
        if sg is not None and sg.gf is gf:
            log.debug("graph changed since it was scheduled (version %d -> %d): scheduling again",
                      sg.version, gf.version)
        return self.split_graph(gf)

    def alloc_graph(self, gf) -> ScheduledGraph:
        """Schedule (if needed) and give memory to everything: unallocated leaves (graph inputs)
        and copies in a scheduler buffer per device, intermediates through each device's planner
        (the plans belong to the schedule)."""
        sg = self._schedule_for(gf)
        if sg.allocated:
            return sg
        per_dev_leaves: dict[int, list[Tensor]] = {}
        for t in gf.leafs:
            if t.buffer is None:
                per_dev_leaves.setdefault(sg.assign[t.id], []).append(t)
        for (_, b), c in sg.copies.items():
            per_dev_leaves.setdefault(b, []).append(c)
        for b, ts in per_dev_leaves.items():
            total, offs = 0, []
            for t in ts:
                offs.append(total)
                total += (t.nbytes() + 63) // 64 * 64
            buf = self.backends[b].alloc_buffer(total, "any", ts)
            for t, o in zip(ts, offs):
                t.buffer, t.offs = buf, o
        # tensors read by another device are kept alive on their own device
        crossing = [s.root() for s in sg.copy_src.values()]
        with sg.reading():
            for b, be in enumerate(self.backends):
                nodes = [n for sp in sg.splits if sp.backend == b for n in sp.nodes]
                if nodes:
                    be.prepare(sg, nodes, keep=crossing)
        sg.allocated = True
        return sg

    def copy_inputs(self, sg: ScheduledGraph, sp: Split):
        """Copy split sp's inputs from their devices into its device's copies (the bytes of each)."""
        dst = self.backends[sp.backend]
        for s in sp.inputs:
            c = sg.copies[(s.id, sp.backend)]
            src_buf, src_offs = s.storage()
            dst_buf, dst_offs = c.storage()
            dst.set_bytes(dst_buf, dst_offs, src_buf.backend.get_bytes(src_buf, src_offs, s.nbytes()))

    def graph_compute(self, gf) -> ScheduledGraph:
        """Run the splits in order: copy each split's inputs in, then compute its nodes. A graph
        that grew since it was scheduled is scheduled (and allocated) again first."""
        sg = self.alloc_graph(gf)
        with sg.reading():
            for sp in sg.splits:
                self.copy_inputs(sg, sp)
                self.backends[sp.backend].compute_nodes(sp.nodes, sg.cache)
        return sg

    def placement_report(self) -> PlacementReport:
        if self.scheduled is None:
            raise OpError("placement_report: no graph has been scheduled yet (call graph_compute or split_graph)")
        return self.scheduled.placement_report()

    def _debug_print(self):
        level = env.get("MINIGRAPH_SCHED_DEBUG")
        if level <= 0:
            return
        import sys
        print(self.placement_report().format(nodes=level >= 2), file=sys.stderr)
