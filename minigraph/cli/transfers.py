"""Data moved between devices per step: the scheduler's cross-device copies plus the all-reduces
of meta (tensor-parallel) devices, which move data between their inner devices just the same."""
from __future__ import annotations


def allreduce_counters(devices) -> tuple[int, int]:
    """(all-reduces, bytes) the meta devices among devices have done so far."""
    n = sum(getattr(d, "n_allreduce", 0) for d in devices)
    b = sum(getattr(d, "allreduce_bytes", 0) for d in devices)
    return n, b


def planned_allreduces(devices, gf, sched) -> tuple[int, int]:
    """(all-reduces, bytes) one compute of gf does on the meta devices among devices."""
    n = b = 0
    for d in devices:
        if hasattr(d, "split_report"):
            rep = d.split_report(gf, sched)
            n += len(rep["all_reduces"])
            b += rep["all_reduce_bytes"]
    return n, b
