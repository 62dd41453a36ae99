"""The meta device: one logical device split over several simple ones (ggml-backend-meta.cpp,
tensor parallelism).

`mg.backend("meta(cpu:0,cpu:1)")` (or MetaBackend([dev0, dev1], split_state=fn)) is a Backend
like any other: buffers, tensors, set/numpy and graph compute, usable alone or in a Scheduler.

* Memory: a meta buffer is one buffer of the same size on every simple device. Device j's slice
  of a tensor lives at the tensor's offset in device j's buffer with device j's extents and
  strides (split_state.device_ne_nb; ggml does the same with the tensor's data offset).
* Split states: weights and caches (leaves that are neither graph inputs nor scheduler copies)
  from the split callback, everything else derived by minigraph.backends.meta.split_state's rules.
  `set_split_state(fn)` may be called after tensors exist: their data is gathered and re-sliced.
* Compute: the node list is expanded into one simple graph per device (sliced shapes, strides,
  view offsets); a node whose own state is PARTIAL ends a subgraph and is all-reduced (each
  device's partial sum is read through its backend, summed in device order in f32 and written
  back to every device), after which it is whole on every device.
* t.set()/t.numpy() scatter/gather the slices; raw byte access (get_bytes/set_bytes, used by the
  recurrent memory's snapshots and the scheduler's copies) is mapped through the tensors known
  to live in the range, every other byte being mirrored.
"""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

import numpy as np

from minigraph.backend import GUARD_BYTE, Backend, Buffer, is_compute_node, register_backend
from minigraph.errors import OpError
from minigraph.backends.meta.split_state import (MIRRORED, PARTIAL, SplitState, SplitStates, device_ne_nb,
                                   device_view_offset, even_shares, format_states, states_table)
from minigraph.sources import srcs_of
from minigraph.tensor import Tensor

__all__ = ["MetaBackend", "split_by_name", "even_shares", "recipe_for"]


@dataclass
class Subgraph:
    lists: list                       # per device: simple nodes (views included)
    reduce: Tensor | None = None      # the logical PARTIAL node that ends it
    reduce_simple: list = field(default_factory=list)
    reduce_skip: list = field(default_factory=list)   # devices whose partial sum is empty


@dataclass
class Expansion:
    nodes: list
    sig: tuple
    subgraphs: list
    simple: dict                      # logical tensor id -> [simple tensor per device]


class MetaBackend(Backend):
    def __init__(self, devices, split_state=None, name: str | None = None):
        devices = list(devices)
        if not devices:
            raise ValueError("a meta device needs at least one simple device")
        if len({id(d) for d in devices}) != len(devices):
            raise ValueError(f"a simple device appears twice in {[d.name for d in devices]}")
        if any(isinstance(d, MetaBackend) for d in devices):
            raise ValueError("a meta device cannot contain another meta device")
        self.devices = devices
        self.n_dev = len(devices)
        self.name = name or "meta(" + ",".join(d.name for d in devices) + ")"
        self.states = SplitStates(self.n_dev, split_state)
        self._static: dict[int, list] = {}        # buffer id -> weakrefs to roots bound into it
        self._kept: dict[int, list] = {}          # compute buffer id -> weakrefs to roots read later
        self._expansions: dict = {}
        self.n_allreduce = 0
        self.allreduce_bytes = 0                  # bytes the all-reduces moved, all computes together
        self.last_allreduces: list[str] = []

    def allreduce_nbytes(self, t: Tensor) -> int:
        """Bytes one all-reduce of t moves: each device's partial sum in, the total back out to
        every device (2 x n_dev x t's bytes). Counted as transfers, like the scheduler's copies."""
        return 2 * self.n_dev * t.nbytes()

    # -- the split callback ------------------------------------------------------------------
    @property
    def split_state(self):
        return self.states.callback

    def set_split_state(self, fn):
        """Use fn(tensor, n_dev) -> SplitState | axis | None for weights and caches. Tensors
        already stored are gathered under their old state and re-sliced under the new one."""
        roots = self._static_roots()
        data = [(t, self.read_tensor(t)) for t in roots]
        self.states.set_callback(fn)
        self._expansions.clear()
        for t, arr in data:
            self.write_tensor(t, arr)
        return self

    def _static_roots(self) -> list:
        out = []
        for refs in self._static.values():
            for r in refs:
                t = r()
                if t is not None and t.buffer is not None and t.buffer.backend is self:
                    out.append(t)
        return out

    # -- memory -------------------------------------------------------------------------------
    def alloc_buffer(self, nbytes: int, usage: str, tensors=()) -> Buffer:
        return Buffer(self, nbytes, usage, [d.alloc_buffer(nbytes, usage, tensors) for d in self.devices])

    def bind_tensors(self, buf: Buffer, tensors):
        """Hook called by alloc_ctx_tensors: remember the weights/caches in buf and derive their
        split states now (a bad callback state fails at allocation)."""
        refs = self._static.setdefault(buf.id, [])
        for t in tensors:
            refs.append(weakref.ref(t))
            self.states.entry(t)

    def _is_mine(self, t: Tensor) -> bool:
        buf = t.root().buffer
        return buf is not None and buf.backend is self

    def _simple(self, t: Tensor, j: int, memo: dict) -> Tensor:
        """Device j's tensor for t (memo: logical id -> list of per-device tensors)."""
        got = memo.get(t.id)
        if got is not None and got[j] is not None:
            return got[j]
        if got is None:
            got = memo[t.id] = [None] * self.n_dev
        st = self.states.state(t, assume_sync=False)
        ne, nb = device_ne_nb(t, st, j)
        srcs = {}
        if t.op != "NONE":
            for k, s in srcs_of(t).items():
                srcs[k] = self._src_for(t, st, k, s, j, memo)
        params = dict(t.params)
        if "ne" in params:
            params["ne"] = ne
        if t.op == "VIEW":
            params["nb"] = nb
        root = t.view_src
        if root is None:
            buf = t.buffer
            if buf is None:
                raise OpError(f"{t.label} has no memory yet on {self.name}")
            if buf.backend is not self:
                raise OpError(f"{t.label} lives on {buf.backend.name}, not on {self.name}")
            T = Tensor(None, t.type, ne, nb, op=t.op, srcs=srcs, params=params, name=t.name)
            T.buffer, T.offs = buf.mem[j], t.offs
        else:
            root_j = self._simple(root, j, memo)
            root_st = self.states.state(root, assume_sync=False)
            offs = device_view_offset(root, root_st, t.view_offs, j)
            if "offset" in params:
                params["offset"] = offs
            T = Tensor(None, t.type, ne, nb, op=t.op, srcs=srcs, params=params, name=t.name,
                       view_src=root_j, view_offs=offs)
            if T.nelements() and offs + T.nbytes() > root_j.nbytes():
                raise OpError(f"{t.op} {t.label}: device {j}'s view (ne={list(ne)}, nb={list(nb)}, offset "
                              f"{offs}) reaches past its slice of {root.label} ({root_j.nbytes()} bytes)")
        T.flags = set(t.flags)
        got[j] = T
        return T

    def _src_for(self, t, st, k, s, j, memo) -> Tensor:
        sj = self._simple(s, j, memo)
        if t.op == "CONCAT" and st.is_split:
            sst = self.states.state(s)
            if sst.axis == MIRRORED:
                # a whole source concatenated with a split one: each device takes its part of it
                # (ggml hands the whole tensor to a kernel that reads from index 0: see the report)
                a = st.axis
                ch = st.chunks(j)
                if len(ch) > 1:
                    raise OpError(f"CONCAT {t.label}: cannot slice MIRRORED {s.label} for {st}")
                start = ch[0][0] if ch else 0
                ne = list(sj.ne)
                ne[a] = st.share(j)
                return Tensor(None, sj.type, ne, sj.nb, op="VIEW", srcs={"a": sj},
                              params={"ne": tuple(ne), "nb": sj.nb, "offset": start * sj.nb[a]},
                              view_src=sj.root(), view_offs=sj.view_offs + start * sj.nb[a],
                              name=s.name)
        return sj

    def write_tensor(self, t: Tensor, array: np.ndarray):
        st = self.states.state(t, assume_sync=False)
        memo: dict = {}
        if st.is_split:
            ax = 3 - st.axis
            for j, dev in enumerate(self.devices):
                parts = [np.take(array, np.arange(g, g + n), axis=ax) for g, _, n in st.chunks(j)]
                sj = self._simple(t, j, memo)
                if sj.nelements():
                    dev.write_tensor(sj, np.concatenate(parts, axis=ax) if parts else array)
            return
        if st.axis == PARTIAL and t.op == "NONE":
            array = (array / np.asarray(self.n_dev, array.dtype)).astype(array.dtype)   # ggml: data / n
        for j, dev in enumerate(self.devices):
            dev.write_tensor(self._simple(t, j, memo), array)

    def read_tensor(self, t: Tensor) -> np.ndarray:
        st = self.states.state(t, assume_sync=False)
        memo: dict = {}
        if st.is_split:
            ax = 3 - st.axis
            out = np.empty(tuple(reversed(t.ne)), t.type.np_dtype)
            for j, dev in enumerate(self.devices):
                sj = self._simple(t, j, memo)
                if not sj.nelements():
                    continue
                arr = dev.read_tensor(sj)
                for g, l, n in st.chunks(j):
                    idx = [slice(None)] * 4
                    src = [slice(None)] * 4
                    idx[ax], src[ax] = slice(g, g + n), slice(l, l + n)
                    out[tuple(idx)] = arr[tuple(src)]
            return out
        if st.axis == PARTIAL and t.op == "NONE":     # a partial leaf: the sum of the parts
            parts = [dev.read_tensor(self._simple(t, j, memo)) for j, dev in enumerate(self.devices)]
            acc = parts[0].copy()
            for p in parts[1:]:
                acc += p
            return acc
        # MIRRORED, or a PARTIAL node already all-reduced: whole on every device
        return self.devices[0].read_tensor(self._simple(t, 0, memo))

    def _roots_in(self, buf: Buffer, offs: int, n: int) -> list:
        out = []
        for refs in (self._static.get(buf.id, []), self._kept.get(buf.id, [])):
            for r in refs:
                t = r()
                if t is None or t.buffer is not buf:
                    continue
                if t.offs < offs + n and offs < t.offs + t.nbytes():
                    if self.states.state(t, assume_sync=False).is_split:
                        out.append(t)
        return out

    def get_bytes(self, buf: Buffer, offs: int, n: int) -> np.ndarray:
        raw = self.devices[0].get_bytes(buf.mem[0], offs, n)
        for t in self._roots_in(buf, offs, n):
            logical = np.ascontiguousarray(self.read_tensor(t)).view(np.uint8).reshape(-1)
            lo, hi = max(offs, t.offs), min(offs + n, t.offs + t.nbytes())
            raw[lo - offs:hi - offs] = logical[lo - t.offs:hi - t.offs]
        return raw

    def set_bytes(self, buf: Buffer, offs: int, data: np.ndarray):
        data = np.ascontiguousarray(data, np.uint8).reshape(-1)
        n = data.size
        split = [(t, np.ascontiguousarray(self.read_tensor(t)).view(np.uint8).reshape(-1).copy())
                 for t in self._roots_in(buf, offs, n)]
        for j, dev in enumerate(self.devices):
            dev.set_bytes(buf.mem[j], offs, data)          # mirrored bytes
        for t, logical in split:                         # split tensors: patch and re-slice
            lo, hi = max(offs, t.offs), min(offs + n, t.offs + t.nbytes())
            logical[lo - t.offs:hi - t.offs] = data[lo - offs:hi - offs]
            self.write_tensor(t, logical.view(t.type.np_dtype).reshape(tuple(reversed(t.ne))))

    def fill_guards(self, buf: Buffer, plan):
        for j, dev in enumerate(self.devices):
            dev.set_bytes(buf.mem[j], 0, np.full(buf.mem[j].nbytes, GUARD_BYTE, np.uint8))

    # -- compute ------------------------------------------------------------------------------
    def supports_op(self, node: Tensor) -> bool:
        return all(d.supports_op(node) for d in self.devices)

    def prepare(self, gf, nodes, keep=()):
        plan = super().prepare(gf, nodes, keep)
        mine = [n for n in nodes if self._is_mine(n)]
        self.states.derive(mine)                       # a tensor without a valid state fails here
        kept = [t.root() for t in list(keep) + [n for n in mine if n.is_output]]
        bufs = {}
        for t in kept:
            if t.buffer is not None and t.buffer.backend is self and t.buffer.usage == "compute":
                bufs.setdefault(t.buffer.id, []).append(weakref.ref(t))
        for bid, refs in bufs.items():
            self._kept[bid] = refs
        # entries of dropped graphs hold only dead references: forget them so the table stays small
        for bid in [b for b, refs in self._kept.items() if all(r() is None for r in refs)]:
            del self._kept[bid]
        return plan

    @staticmethod
    def _signature(nodes) -> tuple:
        return tuple((n.id, tuple(s.id for s in srcs_of(n).values()), id(n.root().buffer), n.root().offs)
                     for n in nodes)

    def expand(self, nodes, cache: dict | None = None) -> Expansion:
        """One simple node list per device and subgraph (cut after every PARTIAL node), kept in
        the owner's cache when there is one (it then dies with the graph)."""
        store = self._expansions if cache is None else cache
        key = id(nodes) if cache is None else ("meta_expansion", self.name, id(nodes))
        sig = self._signature(nodes)
        exp = store.get(key)
        if exp is not None and exp.nodes is nodes and exp.sig == sig:
            return exp
        memo: dict = {}
        subgraphs = [Subgraph([[] for _ in self.devices])]
        for n in nodes:
            if not self._is_mine(n):
                if is_compute_node(n):
                    raise OpError(f"{n.op} {n.label}: lives on {n.root().buffer.backend.name if n.root().buffer else 'no device'}, "
                                  f"not on {self.name}")
                continue             # a view of another device's tensor: its users read a copy
            own = self.states.state(n, assume_sync=False)
            sub = subgraphs[-1]
            for j in range(self.n_dev):
                sub.lists[j].append(self._simple(n, j, memo))
            if own.axis == PARTIAL and is_compute_node(n):
                sub.reduce = n
                sub.reduce_simple = [memo[n.id][j] for j in range(self.n_dev)]
                sub.reduce_skip = [any(s.nelements() == 0 for s in memo[n.id][j].srcs.values())
                                   for j in range(self.n_dev)]
                subgraphs.append(Subgraph([[] for _ in self.devices]))
        if not any(subgraphs[-1].lists) and len(subgraphs) > 1:
            subgraphs.pop()
        exp = Expansion(nodes, sig, subgraphs, memo)
        store[key] = exp
        while cache is None and len(self._expansions) > 64:
            self._expansions.pop(next(iter(self._expansions)))
        return exp

    def compute_nodes(self, nodes, cache=None):
        exp = self.expand(nodes, cache)
        self.last_allreduces = []
        for sub in exp.subgraphs:
            for dev, lst in zip(self.devices, sub.lists):
                if lst:
                    dev.compute_nodes(lst, cache)
            if sub.reduce is not None:
                self._all_reduce(sub)

    def _all_reduce(self, sub: Subgraph):
        """Sum the devices' partial results (in device order, f32) and give every device the sum."""
        acc = None
        for j, (dev, T) in enumerate(zip(self.devices, sub.reduce_simple)):
            if sub.reduce_skip[j]:
                continue
            part = dev.read_tensor(T)
            acc = part.copy() if acc is None else acc + part
        if acc is None:
            acc = np.zeros(tuple(reversed(sub.reduce.ne)), sub.reduce.type.np_dtype)
        for dev, T in zip(self.devices, sub.reduce_simple):
            dev.write_tensor(T, acc.astype(T.type.np_dtype, copy=False))
        self.n_allreduce += 1
        self.allreduce_bytes += self.allreduce_nbytes(sub.reduce)
        self.last_allreduces.append(sub.reduce.name or sub.reduce.label)

    # -- report -------------------------------------------------------------------------------
    def split_report(self, gf, sched=None) -> dict:
        """Every tensor's split state and the rule that set it, and the all-reduces of one
        compute of gf (only the tensors the meta device holds when sched is given)."""
        ts = [t for t in gf.leafs + gf.nodes if self._is_mine(t)
              or (sched is not None and sched.backend_of(t) is self)
              or (sched is None and t.root().buffer is None)]
        rows = states_table(self.states, ts)
        reduced = [t for t, r in zip(ts, rows) if r["all_reduce"]]
        return {"device": self.name, "devices": [d.name for d in self.devices], "tensors": rows,
                "all_reduces": [r["tensor"] for r in rows if r["all_reduce"]],
                "all_reduce_bytes": sum(self.allreduce_nbytes(t) for t in reduced)}

    def format_split_report(self, gf, sched=None) -> str:
        rep = self.split_report(gf, sched)
        out = [f"split states on {rep['device']} over {', '.join(rep['devices'])}:",
               format_states(rep["tensors"]),
               f"all-reduces per step: {len(rep['all_reduces'])}"
               + (": " + ", ".join(rep["all_reduces"]) if rep["all_reduces"] else "")
               + f" ({rep['all_reduce_bytes']} bytes moved)"]
        return "\n".join(out)


# -- callbacks ------------------------------------------------------------------------------------

def split_by_name(rules: dict, default=None):
    """A split callback from {regex on the tensor name: spec}; spec is an axis (split evenly),
    (axis, granule) (even in whole granules, e.g. heads of head_dim) or a function
    (tensor, n_dev) -> state. The first matching regex wins; no match -> default (MIRRORED)."""
    compiled = [(re.compile(p), spec) for p, spec in rules.items()]

    def cb(t: Tensor, n_dev: int):
        for rx, spec in compiled:
            if rx.fullmatch(t.name or ""):
                if callable(spec):
                    return spec(t, n_dev)
                axis, granule = (spec, 1) if isinstance(spec, int) else spec
                return SplitState.split(axis, even_shares(t.ne[axis], n_dev, granule))
        return default(t, n_dev) if default is not None else None
    return cb


def recipe_for(model):
    """A split-by-heads callback for the models of this repository, or None (all MIRRORED)
    when the model has no tensor-parallel layout under ggml's rules."""
    from .recipes import recipe_for as _r
    return _r(model)


def _factory(inner_names: list) -> MetaBackend:
    from minigraph.backend import backend
    return MetaBackend([backend(n) for n in inner_names])


register_backend("meta", _factory, composite=True)
