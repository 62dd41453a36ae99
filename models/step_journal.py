"""Failure atomicity of a decode step: an undo journal of what the step may overwrite.

A step (one `Runner.decode`, or one `speculative_step`) that raises must leave the recurrent memory
exactly as it was: cell metadata and every state byte. Copying the whole cache before each step
does that at a cost that grows with mem_size and n_rs_seq; the journal instead copies

- the cell metadata once, when the step starts (a few small Python objects per cell), and
- before each ubatch computes, the rows its graph may write (`RecurrentMemory.rows_written_by`:
  the ubatch's cells and their rollback planes), one contiguous byte span per coalesced row range
  per r/s tensor: on the host through the backend's save_rows, all of a ubatch's spans in one
  call (the cpu backend runs them as one batch on its threads); on cuda and meta devices through
  get_bytes.

A hybrid memory (models/hybrid_memory.py) names byte spans (`byte_spans_written_by`): the
recurrent rows as above, plus the K rows of the ubatch's KV cells and, in the transposed V, those
cells in every channel row; its metadata copy holds both memories' cells. `runs_written_by`
gives either memory's set as strided runs of equal spans (a hybrid names those itself: one run per
layer and cell run covers V's channel rows), the one form the journal (and the tests) use;
`spans_written_by` the same bytes as plain spans.

Rows of cells that held no sequence when the step began are not copied (`live`): nothing reads
them once the metadata is back (a cell that takes a sequence reads its state from the zeroed rs_z
row), so a prompt of new sequences saves nothing of theirs.

Rows the graph reads in place are not copied at all. When every sequence of the ubatch stays in
its own cell and nothing else moves (`RecurrentMemory.reads_rows_in_place`: a plain decode step,
no rollback, no tail cells), build_rs's gather of each cache tensor reads exactly the rows the graph
then writes, before it writes them: the gather's output *is* the undo copy. The graph keeps that
output in memory no other node uses (`Tensor.set_whole_graph`), and `bind` stamps its first bytes
with random ones before the compute, so that undo can tell a gather that ran (stamp overwritten:
restore from it) from one that never did (its rows were never written either). Before the next
ubatch reuses the compute buffer, the gathers that ran are copied into the journal (`_settle`).
A node that reads its rows in place instead of through a gather (mamba2's ssm_scan) gets a side copy
of them from build_rs, just before it, that serves the same way (`GraphParams.side_copies`); the
cpu backend has the scan itself write that copy, head by head as it reads the rows.
The arena those copies leave unused is dropped (`_fit_arena`).

On failure the saved spans are written back newest first, so a row written by several ubatches of
the step ends with the copy taken before the first of them: the value it had before the step.

`FullCopyJournal` is the old behaviour (the whole cache, once per step), kept for comparison
(`Runner(atomic="full")`, bench/atomicity.py).
"""
from __future__ import annotations

import os
import weakref

import numpy as np

from minigraph.backend import HostBackend

from .batch import Ubatch
from .memory import RecurrentMemory


def spans_written_by(memory, ub: Ubatch, live=None) -> list[tuple[object, int, int]]:
    """(tensor, byte offset, nbytes) of everything the graph of `ub` (just placed by find_slot)
    may write, for either memory: a hybrid memory names its spans (byte_spans_written_by), a
    recurrent memory its rows (rows_written_by), here one span per coalesced row range per r/s
    tensor; live: only the rows of those recurrent cells (the journal's: the cells that held a
    sequence when the step began). The journal copies exactly these; tests spy on this one
    function for both kinds."""
    if hasattr(memory, "byte_spans_written_by"):
        return memory.byte_spans_written_by(ub, live)
    rows = memory.rows_written_by(ub, live)
    return [(t, row0 * t.nb[1], count * t.nb[1]) for t in memory.tensors() for row0, count in rows]


def runs_written_by(memory, ub: Ubatch, live=None, kv_cells=None) -> list[tuple[object, int, int, int, int]]:
    """The same bytes as spans_written_by, as (tensor, byte offset, stride, count, nbytes) runs
    (strided_runs): what the journal copies. A memory that names its runs itself
    (byte_runs_written_by: a hybrid's transposed V, one strided run per layer and cell run) skips
    building and regrouping thousands of small spans; kv_cells: only those of a hybrid's KV cells
    (the journal's: the ones that held a position when the step began). Tests spy on this
    function."""
    if hasattr(memory, "byte_runs_written_by"):
        return memory.byte_runs_written_by(ub, live, kv_cells)
    return strided_runs(spans_written_by(memory, ub, live))


def dead_runs(rec: RecurrentMemory, ub: Ubatch, dead) -> list:
    """The runs of the rows of `rec`'s cells in `dead` that the graph of `ub` may write."""
    return rec.row_runs(rec.rows_written_by(ub, dead)) if dead else []


def read_span(memory, t, offs: int, n: int) -> np.ndarray:
    """Raw bytes [offs, offs+n) of a cache tensor of either memory."""
    if hasattr(memory, "read_span"):
        return memory.read_span(t, offs, n)
    return memory.read_row_bytes(t, offs // t.nb[1], n // t.nb[1])


def write_span(memory, t, offs: int, data: np.ndarray):
    """Put raw bytes (from read_span) back at offs."""
    if hasattr(memory, "write_span"):
        memory.write_span(t, offs, data)
    else:
        memory.write_row_bytes(t, offs // t.nb[1], data)


def write_run(memory, t, offs: int, stride: int, data: np.ndarray):
    """Put data ([count, n] bytes) into the run of count spans of n bytes, stride apart, from
    offs: one strided assignment on the host, span by span elsewhere."""
    host = _host_bytes(t)
    if host is not None:
        mem, base = host
        _strided(mem, base + offs, stride, *data.shape)[...] = data
        return
    for i, row in enumerate(data):
        write_span(memory, t, offs + i * stride, row)


# One reusable byte arena per memory for the host fast path: a fresh array per span each step
# would have its pages faulted in anew every step (a mamba2-130m-like decode step saves ~19 MB),
# which cost as much as the copy itself. A step's spans are views into it; the next step of the
# same memory (steps never overlap: nested ones join the outer journal) reuses it.
_ARENAS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
ARENA_KEEP_BYTES = 4 << 20   # an arena up to this size is kept whatever a step needs ...
ARENA_SLACK = 8              # ... a bigger one only while a step needs at least 1/8 of it
STAMP_BYTES = 32   # random bytes written over a bound gather's start: still there on undo = it never ran


def _host_bytes(t) -> tuple[np.ndarray, int] | None:
    """(the host byte array holding t, t's byte offset in it) for a tensor in host memory (ref,
    cpu devices); None elsewhere (cuda, meta: their own get_bytes is used)."""
    if not isinstance(t.backend, HostBackend):
        return None
    buf, base = t.storage()
    mem = getattr(buf, "mem", None)
    return (mem, base) if isinstance(mem, np.ndarray) and mem.dtype == np.uint8 else None


def _witness_bytes(res, run) -> np.ndarray | None:
    """The host bytes of the gather in res.witnesses that holds exactly the row run (tensor,
    offset, stride, count, nbytes) of a cache tensor, or None when none does (not on the host, not
    one contiguous row range of that size)."""
    t, _, _, count, n = run
    g = res.witnesses.get(t)
    host = _host_bytes(g) if g is not None else None
    if host is None or count != 1 or g.nbytes() != n or n < STAMP_BYTES or not g.is_contiguous():
        return None
    mem, base = host
    return mem[base:base + n]


class StepJournal:
    """Undo journal of one step: cell metadata plus the byte spans each ubatch may write."""

    def __init__(self, memory: RecurrentMemory, defer: bool = True):
        self.memory = memory
        self.defer = defer         # may rows be left to the graph's gathers (bind)
        self.meta = memory.meta_copy()
        self.rec = getattr(memory, "recurrent", memory)           # the recurrent part (a hybrid's)
        self.live = memory.live_cells(self.meta)    # the cells whose rows an undo must put back
        self.dead = frozenset(range(self.rec.size)) - self.live   # the others
        # a hybrid's KV cells likewise: a cell that held no position is masked out of every
        # attention, so its K/V bytes are not saved (a decode step writes only such cells); undo
        # zeroes them instead, so that no value a failed graph left there (a NaN times a masked
        # weight of 0) can reach a later step
        self.kv = getattr(memory, "kv", None)
        self._dead_runs: list = []      # runs of the dead cells' rows the step's graphs may write
        self.spans: list = []      # (tensor, byte offset, stride, raw bytes: [count, n] host run or flat)
        self.nbytes = 0                                           # state bytes copied so far
        self.witnessed = 0                                        # state bytes left to graph gathers
        self._arena_offs = 0                                      # bytes of the arena this step used
        self._deferred: list = []  # runs (runs_written_by) of this ubatch's r/s rows, for bind
        self._held: list = []      # (cache tensor, byte offset, gathered host bytes) bound to a graph
        self._stamp = os.urandom(STAMP_BYTES)   # written and compared through memoryviews:
        # no NumPy call per step (each costs tens of microseconds on the caches a decode
        # step's weights have just flushed)

    def _reserve(self, need: int):
        """Room for need more bytes after what this step already saved: when the arena is too
        small, a bigger one (the spans already saved stay views of the old one, which they keep
        alive). _save reserves a whole ubatch's runs at once, so the arena grows once per ubatch,
        not by doubling run by run with every older arena still resident."""
        arena = _ARENAS.get(self.memory)
        if arena is None or arena.size < self._arena_offs + need:
            _ARENAS[self.memory] = np.empty(max(2 * (0 if arena is None else arena.size), need, 1 << 16), np.uint8)
            self._arena_offs = 0

    def _arena(self, need: int) -> np.ndarray:
        """need bytes of this memory's arena, after what this step already saved there."""
        self._reserve(need)
        out = _ARENAS[self.memory][self._arena_offs:self._arena_offs + need]
        self._arena_offs += need
        return out

    def _fit_arena(self, need: int):
        """Drop this memory's arena when the step starting now needs far less than it holds (a
        prompt's step saved every row of new sequences; the decode steps after it leave their rows
        to the graphs' copies): its pages would otherwise stay resident beside the decode graph's
        own copies of the same rows. It is made again, at the size a step asks, when one does."""
        arena = _ARENAS.get(self.memory)
        if arena is not None and arena.size > max(ARENA_KEEP_BYTES, ARENA_SLACK * need):
            del _ARENAS[self.memory]

    def before_ubatch(self, ub: Ubatch):
        """Save the spans the graph of `ub` (just placed by find_slot) may write. On the host,
        spans of one tensor with the same length at a constant stride (a KV cache's transposed V:
        one short span per channel row) are copied as one strided block, not one by one."""
        self._settle()               # the last graph's gathers are about to be overwritten
        kv_live = None
        if self.kv is not None:      # the ubatch's KV cells, by whether they held a position
            kv_live = self.memory.kv_cells_positioned(self.kv.idxs, self.meta)
            if len(kv_live) < len(self.kv.idxs):
                self._dead_runs += self.kv.byte_runs_written_by(ub, set(self.kv.idxs) - kv_live)
        runs = runs_written_by(self.memory, ub, self.live, kv_live)
        rec = self.rec
        self._dead_runs += dead_runs(rec, ub, self.dead)
        if self.defer and isinstance(rec, RecurrentMemory) and rec.reads_rows_in_place(ub):
            # the graph's gathers will hold these rows' old bytes: bind() decides, per tensor
            mine = set(rec.tensors())
            self._deferred = [r for r in runs if r[0] in mine]
            runs = [r for r in runs if r[0] not in mine]
        if self._arena_offs == 0 and not self.spans:      # the step's first ubatch
            self._fit_arena(sum(count * n for *_, count, n in runs))
        self._save(runs)

    def bind(self, res):
        """The graph of the ubatch just passed to before_ubatch, allocated and about to compute:
        each deferred row range whose cache tensor has a gather in `res.witnesses` (on the host)
        is left to it, the gather's first bytes stamped so that undo can tell whether it ran;
        the rest is copied now, before anything is written."""
        deferred, self._deferred = self._deferred, []
        rest = []
        known = res.witness_bytes      # a reused graph's lookups are made once (a decode step's
        for run in deferred:           # runs repeat: the same cells, the same gathers)
            if run not in known:
                known[run] = _witness_bytes(res, run)
            held = known[run]
            if held is None:
                rest.append(run)
                continue
            held.data[:STAMP_BYTES] = self._stamp
            self._held.append((run[0], run[1], held))
            self.witnessed += run[4]
        self._save(rest)

    def _ran(self, held) -> bool:
        """Whether the gather behind `held` ran: it overwrote the stamp with cache bytes (that
        those equal 32 random bytes has probability 2**-256)."""
        return held.data[:STAMP_BYTES] != self._stamp

    def _settle(self):
        """Copy the bytes the gathers of the graph that ran last hold into the journal: the next
        graph reuses their memory."""
        held, self._held = self._held, []
        if self._deferred:      # before_ubatch without bind (no graph ran): copy them as usual
            self._save(self._deferred)
            self._deferred = []
        for t, offs, data in held:
            if self._ran(data):
                arena = self._arena(data.size)
                arena[...] = data
                self.spans.append((t, offs, 0, arena))
                self.nbytes += data.size
                self.witnessed -= data.size

    def _save(self, runs):
        copies = {}                  # backend -> ([(arena rows, cache rows)], the spans they save)
        located = [(run, _host_bytes(run[0])) for run in runs]
        on_host = sum(count * n for (_, _, _, count, n), host in located if host is not None)
        if on_host:
            self._reserve(on_host)
        for (t, offs, stride, count, n), host in located:
            if host is not None:
                mem, base = host
                data = self._arena(count * n).reshape(count, n)
                pairs, saved = copies.setdefault(t.backend, ([], []))
                pairs.append((data, _strided(mem, base + offs, stride, count, n)))
                saved.append((t, offs, stride, data))
            else:
                for i in range(count):
                    data = read_span(self.memory, t, offs + i * stride, n)
                    self.spans.append((t, offs + i * stride, 0, data))
            self.nbytes += count * n
        # one call per backend (one batch); a span joins the journal once its copy is made, so
        # an undo after a failure here puts back only what was saved
        for backend, (pairs, saved) in copies.items():
            backend.save_rows(pairs)
            self.spans.extend(saved)

    def undo(self):
        """Put back every saved span, newest first, then the metadata of the step's start. The
        last graph's gathers come first (they are the newest); one that never ran left its rows
        unwritten. The rows of cells that were empty are zeroed: nothing reads them, but one of
        them may become the zero row (rs_z) that build_rs clears by scaling with 0, which would
        keep a NaN a failed graph left there; a hybrid's KV cells that held no position likewise
        (attention masks them, but 0 times a NaN is NaN)."""
        for t, offs, stride, count, n in self._dead_runs:
            write_run(self.memory, t, offs, stride, np.zeros((count, n), np.uint8))
        for t, offs, data in reversed(self._held):
            if self._ran(data):
                write_span(self.memory, t, offs, data)
        self._held = []
        for t, offs, stride, data in reversed(self.spans):
            if data.ndim == 2:                   # a host run (count x nbytes)
                write_run(self.memory, t, offs, stride, data)
            else:
                write_span(self.memory, t, offs, data)
        self.memory.restore_meta(self.meta)


def strided_runs(spans) -> list[tuple[object, int, int, int, int]]:
    """(tensor, first offset, stride, count, nbytes): consecutive spans of one tensor with the same
    length whose offsets step by a constant stride (>= the length: the spans never overlap) as one
    run; a lone span is a run of 1 (stride 0)."""
    out = []
    for t, offs, n in spans:
        if out:
            t0, o0, st, c, n0 = out[-1]
            step = offs - (o0 + (c - 1) * st)
            if t0 is t and n0 == n and c >= 1 and (c == 1 and step >= n or c > 1 and step == st):
                out[-1] = (t0, o0, step, c + 1, n0)
                continue
        out.append((t, offs, 0, 1, n))
    return out


def _strided(mem: np.ndarray, start: int, stride: int, count: int, n: int) -> np.ndarray:
    """A [count, n] byte view of mem: rows of n bytes, stride bytes apart, from start."""
    if count * n == 0:
        return mem[start:start].reshape(count, n)
    end = start + (count - 1) * stride + n
    if end > mem.size:
        raise ValueError(f"undo journal: span up to byte {end} is outside its buffer of {mem.size}")
    return np.lib.stride_tricks.as_strided(mem[start:end], shape=(count, n), strides=(max(stride, n), 1))


class FullCopyJournal:
    """The whole cache copied when the step starts: the cost grows with mem_size * K."""

    witnessed = 0                               # nothing is left to the graphs' gathers

    def __init__(self, memory: RecurrentMemory, defer: bool = True):
        self.memory = memory
        self.snap = memory.snapshot()
        self.nbytes = sum(d.size for d in self.snap.data.values())

    def before_ubatch(self, ub: Ubatch):
        pass                                    # everything is already saved

    def bind(self, res):
        pass

    def undo(self):
        self.memory.restore(self.snap)


JOURNALS = {"rows": StepJournal, "full": FullCopyJournal}
