"""Placement reports: who ran where and why, the splits, and every cross-device copy."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class NodeInfo:
    name: str
    op: str
    device: str
    cause: str
    is_view: bool


@dataclass
class SplitInfo:
    index: int
    device: str
    nodes: list
    inputs: list


# why a tensor crosses devices, by what the copied tensor is (copy_reason)
COPY_REASONS = {
    "input": "a graph input (filled by the host) read on another device",
    "slot order": "a conv layer's slot order, built on one device and read by a store on another",
    "state gather": "recurrent state (a cache or the rows gathered from it) read on another device",
    "weights": "weights read on a device that cannot use their buffer",
    "layer boundary": "an activation passed from one layer's device to the next",
}


def copy_reason(t) -> str:
    """Why tensor t is copied to another device, judged by what t is (see COPY_REASONS)."""
    root = t.root()
    names = (t.name or "", root.name or "")
    if any("slot" in n for n in names):   # before "input": host-input's slot order is an input too
        return "slot order"
    if t.is_input or root.is_input:
        return "input"
    gathered = t.srcs.get("a") if t.op == "GET_ROWS" else None
    if root.name and root.name.startswith("cache_") or \
            gathered is not None and (gathered.root().name or "").startswith("cache_"):
        return "state gather"
    if t.is_weight or root.is_weight or (root.buffer is not None and root.buffer.usage == "weights"):
        return "weights"
    return "layer boundary"


@dataclass
class CopyInfo:
    tensor: str
    copy: str
    src_device: str
    dst_device: str
    nbytes: int
    first_split: int
    used_by_splits: list      # a copy is made once per graph and device, then reused
    reason: str = ""          # why it exists: one of COPY_REASONS

    @property
    def reason_text(self) -> str:
        return COPY_REASONS.get(self.reason, self.reason)

    @property
    def reused(self) -> bool:
        return len(self.used_by_splits) > 1


@dataclass
class PlacementReport:
    devices: list
    nodes: list = field(default_factory=list)
    leafs: list = field(default_factory=list)
    splits: list = field(default_factory=list)
    copies: list = field(default_factory=list)

    @property
    def n_copies(self) -> int:
        return len(self.copies)

    @property
    def copy_bytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def device_of(self, name: str) -> str:
        for n in self.nodes + self.leafs:
            if n.name == name:
                return n.device
        raise KeyError(name)

    @classmethod
    def from_schedule(cls, sg) -> "PlacementReport":
        """The report of one schedule (a minigraph.sched.ScheduledGraph)."""
        from .sched import is_view_op
        gf = sg.gf
        dev = lambda t: sg.backend_of(t).name if sg.backend_of(t) is not None else "-"
        label = lambda t: t.name or t.label
        r = cls(devices=[b.name for b in sg.backends])
        r.nodes = [NodeInfo(label(n), n.op, dev(n), sg.cause.get(n.id, ""), is_view_op(n)) for n in gf.nodes]
        r.leafs = [NodeInfo(label(t), "NONE", dev(t), sg.cause.get(t.id, ""), False) for t in gf.leafs]
        r.splits = [SplitInfo(i, sg.backends[sp.backend].name,
                              [label(n) for n in sp.nodes if not is_view_op(n)], [label(s) for s in sp.inputs])
                    for i, sp in enumerate(sg.splits)]
        for (sid, b), c in sg.copies.items():
            s = sg.copy_src[c.id]
            users = sg.copy_users.get(c.id, [])
            r.copies.append(CopyInfo(label(s), c.name, dev(s), sg.backends[b].name, s.nbytes(),
                                     min(users) if users else -1, users, copy_reason(s)))
        r.copies.sort(key=lambda c: (c.first_split, c.tensor))
        return r

    @classmethod
    def from_scheduler(cls, sched) -> "PlacementReport":
        """The report of a Scheduler's newest schedule."""
        return sched.placement_report()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["n_copies"] = self.n_copies
        d["copy_bytes"] = self.copy_bytes
        for c in d["copies"]:
            c["reused"] = len(c["used_by_splits"]) > 1
        return d

    def format(self, nodes: bool = True) -> str:
        out = [f"placement over {', '.join(self.devices)}: {len(self.splits)} splits, "
               f"{self.n_copies} copies, {self.copy_bytes} bytes copied per compute"]
        for s in self.splits:
            out.append(f"## SPLIT #{s.index}: {s.device} # {len(s.inputs)} inputs"
                       + (": " + " ".join(f"[{i}]" for i in s.inputs) if s.inputs else ""))
            out.append("   nodes: " + ", ".join(s.nodes))
        if self.copies:
            out.append(f"{'copy':28s} {'of tensor':28s} {'from':8s} {'to':8s} {'bytes':>10s}  "
                       f"{'why':15s} used by splits")
            for c in self.copies:
                out.append(f"{c.copy[:28]:28s} {c.tensor[:28]:28s} {c.src_device:8s} {c.dst_device:8s} "
                           f"{c.nbytes:10d}  {c.reason:15s} {c.used_by_splits}"
                           f"{'  (copied once, reused)' if c.reused else ''}")
        if nodes:
            out.append(f"{'node':40s} {'op':16s} {'device':8s} cause")
            for n in self.leafs + self.nodes:
                out.append(f"{n.name[:40]:40s} {n.op:16s} {n.device:8s} {n.cause}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()
