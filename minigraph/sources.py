"""Which tensors a node reads.

A node reads ``node.srcs``. When a scheduler computes a graph over several devices, a node that
reads a tensor living on another device reads the scheduler's copy of it on its own device
instead. Those replacements belong to the schedule, not to the graph: node.srcs are never
rewritten, and backends, the memory planner and the meta device ask ``srcs_of(node)``.

``srcs_of`` answers from, in order:
* the replacements of the compute in progress (``reading(table)``: a scheduled compute passes
  its schedule's table, a single-device compute an empty one);
* outside any compute, the replacements of the newest schedule of the node's graph (a device
  that reads a result back, such as the meta device, needs to see the sources it was computed
  from). They are held weakly: dropping the nodes drops them;
* else node.srcs."""
from __future__ import annotations

import weakref
from contextvars import ContextVar

# node id -> the node's sources with cross-device reads replaced by copies (only nodes that read
# a copy are listed); None outside a compute
_replaced: ContextVar = ContextVar("minigraph_replaced_srcs", default=None)
# node -> its sources under the newest schedule of its graph
_standing: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def srcs_of(node) -> dict:
    """The sources ``node`` reads now (see the module docstring)."""
    table = _replaced.get()
    if table is not None:
        return table.get(node.id, node.srcs)
    got = _standing.get(node)
    return got if got is not None else node.srcs


class reading:
    """Make ``table`` (node id -> sources) what srcs_of answers with, for a block. (A class, not
    a generator context manager: every compute enters one, and a generator costs ~1.5 us.)"""
    __slots__ = ("table", "token")

    def __init__(self, table: dict):
        self.table = table

    def __enter__(self):
        self.token = _replaced.set(self.table)
        return self

    def __exit__(self, *exc):
        _replaced.reset(self.token)
        return False


def stand(replacements: dict, withdraw=()):
    """Publish a new schedule's replacements (node -> sources) for reads outside a compute,
    after withdrawing those of the schedule it supersedes (its nodes ``withdraw``)."""
    for n in withdraw:
        _standing.pop(n, None)
    _standing.update(replacements)
