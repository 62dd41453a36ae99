"""How many cores other processes kept busy while something ran here: timings and timing-sensitive
tests on a small machine read it to tell their own result from a neighbour's (on 2 cores a second
busy process wrecks two-thread runs: a waiting thread loses a scheduler slice)."""
from __future__ import annotations

import os
import time


def busy_seconds():
    """CPU seconds all processes spent busy since boot (/proc/stat, steal included); None where
    unavailable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")      # minus idle and iowait
    except (OSError, ValueError, IndexError):
        return None


class OtherLoad:
    """Started at construction: cores() is the machine's busy CPU time since then minus this
    process's own (all its threads), over the wall time; None where /proc/stat is unavailable."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), busy_seconds(), time.process_time()

    def cores(self):
        busy = busy_seconds()
        if busy is None or self.busy0 is None:
            return None
        wall = time.perf_counter() - self.t0
        return max(0.0, (busy - self.busy0 - (time.process_time() - self.own0)) / wall)
