"""The lazy graph: nodes in dependency order (ggml's build_forward_expand), leafs, a text dump
and a networkx view.

A graph owns its nodes: they are in no context, so once the graph and the caller's references
are dropped, the nodes and the compute memory planned for them are freed."""
from __future__ import annotations

from .registry import OPS, writes_through
from .tensor import Tensor


class Graph:
    def __init__(self):
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()
        # bumped whenever build_forward_expand adds something: a schedule made for another
        # version no longer covers every node (the scheduler then schedules again)
        self.version = 0
        # per-backend state kept by backends computing this graph on one device (memory plan)
        self.cache: dict = {}

    def build_forward_expand(self, tensor: Tensor) -> "Graph":
        """Append tensor and everything it depends on that is not in the graph yet, sources
        first in src order (iteratively, so deep chains do not hit the recursion limit)."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"build_forward_expand: tensor must be a minigraph Tensor, got "
                            f"{type(tensor).__module__}.{type(tensor).__qualname__}")
        n_before = len(self.nodes) + len(self.leafs)
        stack = [(tensor, False)]
        while stack:
            t, expanded = stack.pop()
            if t.id in self._seen:
                continue
            if expanded:
                self._seen.add(t.id)
                (self.leafs if t.op == "NONE" else self.nodes).append(t)
                continue
            stack.append((t, True))
            deps = list(t.srcs.values())
            if t.view_src is not None and t.view_src not in deps:
                deps.append(t.view_src)
            for s in reversed(deps):
                if s.id not in self._seen:
                    stack.append((s, False))
        if len(self.nodes) + len(self.leafs) != n_before:
            self.version += 1
            self.cache.clear()
        return self

    def __len__(self):
        return len(self.nodes)

    def dump(self) -> str:
        lines = [f"graph: {len(self.nodes)} nodes, {len(self.leafs)} leafs"]
        for i, n in enumerate(self.nodes):
            srcs = ", ".join(f"{k}={v.label}" for k, v in n.srcs.items())
            kind = " (view)" if OPS[n.op].is_view else (" (writes through)" if writes_through(n) else "")
            lines.append(f"  node {i:3d} {n.op:16s} {n.label} {n.type.name} ne={list(n.ne)} "
                         f"nb={list(n.nb)}{kind} <- {srcs}{'  ' + str(n.params) if n.params else ''}")
        for i, l in enumerate(self.leafs):
            lines.append(f"  leaf {i:3d} {l.label} {l.type.name} ne={list(l.ne)} flags={sorted(l.flags)}")
        return "\n".join(lines)

    __str__ = dump

    def to_networkx(self, sched=None):
        """A DiGraph with one vertex per tensor (keyed by tensor id) and edges source -> node.

        ``sched`` (a ScheduledGraph or a Scheduler) adds each tensor's device and cause and
        marks the cross-device copies; by default the newest schedule of this graph that is
        still alive and current is used."""
        import networkx as nx
        from .sched import schedule_of
        sched = schedule_of(self, sched)
        g = nx.DiGraph()
        for t in self.leafs + self.nodes:
            attrs = node_attrs(t)
            if sched is not None:
                be = sched.backend_of(t)
                attrs["device"] = be.name if be is not None else None
                attrs["cause"] = sched.cause.get(t.id, "")
            g.add_node(t.id, **attrs)
        for n in self.nodes:
            read = sched.srcs_of(n) if sched is not None else n.srcs
            for role, s in n.srcs.items():
                c = read[role]
                if c is s:
                    g.add_edge(s.id, n.id, role=role)
                else:   # a cross-device copy: drawn as its own edge kind
                    g.add_edge(s.id, n.id, role=role, copy=c.name,
                               src_device=sched.backend_of(s).name, dst_device=sched.backend_of(n).name,
                               nbytes=s.nbytes())
            if n.view_src is not None and not g.has_edge(n.view_src.id, n.id):
                g.add_edge(n.view_src.id, n.id, role="view_src")
        return g


def node_attrs(t: Tensor) -> dict:
    return {
        "name": t.name, "label": t.label, "op": t.op, "type": t.type.name,
        "ne": list(t.ne), "nb": list(t.nb),
        "is_view": t.view_src is not None,
        "view_src": t.view_src.id if t.view_src is not None else None,
        "view_offs": t.view_offs, "params": {k: (v.name if hasattr(v, "np_dtype") else v) for k, v in t.params.items()},
        "flags": sorted(t.flags),
    }
