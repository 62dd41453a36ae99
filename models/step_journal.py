"""Failure atomicity of a decode step: an undo journal of what the step may overwrite.

A step (one `Runner.decode`, or one `speculative_step`) that raises must leave the recurrent memory
exactly as it was: cell metadata and every state byte. Copying the whole cache before each step
does that at a cost that grows with mem_size and n_rs_seq; the journal instead copies

- the cell metadata once, when the step starts (a few small Python objects per cell), and
- before each ubatch computes, the rows its graph may write (`RecurrentMemory.rows_written_by`:
  the ubatch's cells and their rollback planes), one contiguous byte span per coalesced row range
  per r/s tensor, through the backend's get_bytes (host, cuda and meta devices alike).

A hybrid memory (models/hybrid_memory.py) names byte spans instead (`byte_spans_written_by`): the
recurrent rows as above, plus the K rows of the ubatch's KV cells and, in the transposed V, those
cells in every channel row; its metadata copy holds both memories' cells.

On failure the saved spans are written back newest first, so a row written by several ubatches of
the step ends with the copy taken before the first of them: the value it had before the step.

`FullCopyJournal` is the old behaviour (the whole cache, once per step), kept for comparison
(`Runner(atomic="full")`, bench/atomicity.py).
"""
from __future__ import annotations

import numpy as np

from .batch import Ubatch
from .memory import RecurrentMemory


class StepJournal:
    """Undo journal of one step: cell metadata plus the row spans each ubatch may write."""

    def __init__(self, memory: RecurrentMemory):
        self.memory = memory
        self.meta = memory.meta_copy()
        self.spans: list[tuple[object, int, np.ndarray]] = []     # (tensor, row0, raw bytes)
        self.byte_spans: list[tuple[object, int, np.ndarray]] = []   # (tensor, byte offset, raw bytes)
        self.nbytes = 0                                           # state bytes copied so far

    def before_ubatch(self, ub: Ubatch):
        """Save the rows the graph of `ub` (just placed by find_slot) may write."""
        mem = self.memory
        if hasattr(mem, "byte_spans_written_by"):
            # a memory with other layouts (the hybrid's KV cache: transposed V) names byte spans
            for t, offs, n in mem.byte_spans_written_by(ub):
                data = mem.read_span(t, offs, n)
                self.byte_spans.append((t, offs, data))
                self.nbytes += data.size
            return
        rows = mem.rows_written_by(ub)
        for t in mem.tensors():
            for row0, count in rows:
                data = mem.read_row_bytes(t, row0, count)
                self.spans.append((t, row0, data))
                self.nbytes += data.size

    def undo(self):
        """Put back every saved row, newest first, then the metadata of the step's start."""
        for t, offs, data in reversed(self.byte_spans):
            self.memory.write_span(t, offs, data)
        for t, row0, data in reversed(self.spans):
            self.memory.write_row_bytes(t, row0, data)
        self.memory.restore_meta(self.meta)


class FullCopyJournal:
    """The whole cache copied when the step starts: the cost grows with mem_size * K."""

    def __init__(self, memory: RecurrentMemory):
        self.memory = memory
        self.snap = memory.snapshot()
        self.nbytes = sum(d.size for d in self.snap.data.values())

    def before_ubatch(self, ub: Ubatch):
        pass                                    # everything is already saved

    def undo(self):
        self.memory.restore(self.snap)


JOURNALS = {"rows": StepJournal, "full": FullCopyJournal}
