"""The lazy graph: nodes in dependency order (ggml's build_forward_expand), leafs, a text dump
and a networkx view."""
from __future__ import annotations

from .registry import OPS, writes_through
from .tensor import Tensor


class Graph:
    def __init__(self):
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()
        # per-backend state kept by backends and the scheduler (allocation, plans)
        self.cache: dict = {}

    def build_forward_expand(self, tensor: Tensor) -> "Graph":
        """Append tensor and everything it depends on that is not in the graph yet, sources
        first in src order (iteratively, so deep chains do not hit the recursion limit)."""
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

    def to_networkx(self):
        """A DiGraph with one vertex per tensor (keyed by tensor id) and edges source -> node."""
        import networkx as nx
        g = nx.DiGraph()
        sched = getattr(self, "sched", None)
        original = {id(c): s for s, c in ((sched.copy_src[c.id], c) for c in sched.copies.values())} if sched else {}
        for t in self.leafs + self.nodes:
            attrs = node_attrs(t)
            if sched is not None:
                b = sched.assign.get(t.id, -1)
                attrs["device"] = sched.backends[b].name if b >= 0 else None
                attrs["cause"] = sched.cause.get(t.id, "")
            g.add_node(t.id, **attrs)
        for n in self.nodes:
            for role, s in n.srcs.items():
                src = original.get(id(s))
                if src is None:
                    g.add_edge(s.id, n.id, role=role)
                else:   # a cross-device copy: drawn as its own edge kind
                    g.add_edge(src.id, n.id, role=role, copy=s.name,
                               src_device=sched.backend_of(src).name, dst_device=sched.backend_of(n).name,
                               nbytes=src.nbytes())
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
