"""Hybrid memory: llama.cpp's `llama_memory_hybrid`. The attention layers keep a KV cache
(models/kv_cache.py), the other layers the recurrent memory (models/memory.py); one sequence API
covers both.

Operations that may be refused are checked before anything changes: the recurrent memory is the
one that refuses (a partial seq_rm, a rollback deeper than its planes) and leaves itself unchanged
when it does, so it goes first and the KV cache (which never refuses a sequence operation) follows
only once it agreed. A rollback of k tokens restores the recurrent planes and removes the last k
positions of the sequence from the KV cache.

For the runner it is a drop-in for the recurrent memory: the recurrent getters (head, n_rs,
rs_z, r_l, s_l, s_copy ...) are the recurrent memory's, `kv` is the KV cache, and the step
journal's byte spans and metadata cover both."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .batch import Ubatch
from .kv_cache import KVCache
from .memory import RecurrentMemory, StateFileError, run_spans

HYBRID_STATE_MAGIC = b"MGHY"


@dataclass
class HybridSnapshot:
    recurrent: object
    kv: object

    @property
    def data(self) -> dict:
        """Tensor name -> bytes of both memories (what a full-copy journal counts)."""
        return {**self.recurrent.data, **self.kv.data}


class HybridMemory:
    def __init__(self, recurrent: RecurrentMemory, kv: KVCache):
        self.recurrent = recurrent
        self.kv = kv
        self.last_refusal: str | None = None

    # -- the recurrent memory's face (what InputRS, build_rs and the models read) -----------------
    @property
    def r_l(self):
        return self.recurrent.r_l

    @property
    def s_l(self):
        return self.recurrent.s_l

    @property
    def size(self) -> int:
        return self.recurrent.size

    @property
    def n_rs_seq(self) -> int:
        return self.recurrent.n_rs_seq

    def get_head(self) -> int:
        return self.recurrent.get_head()

    def get_n_rs(self) -> int:
        return self.recurrent.get_n_rs()

    def get_rs_z(self) -> int:
        return self.recurrent.get_rs_z()

    def get_size(self) -> int:
        return self.recurrent.get_size()

    def s_copy(self, i: int, head: int | None = None) -> int:
        return self.recurrent.s_copy(i, head)

    def tensors(self) -> list:
        return self.recurrent.tensors() + self.kv.tensors()

    def seq_pos_min(self, seq: int) -> int:
        return self.kv.seq_pos_min(seq)

    def seq_pos_max(self, seq: int) -> int:
        """The recurrent memory holds a sequence's last position even when it is a pure attention
        model's; the two agree after every step."""
        return max(self.recurrent.seq_pos_max(seq), self.kv.seq_pos_max(seq))

    # -- placing ubatches ----------------------------------------------------------------------------
    def _refuse(self, who: str, why: str | None) -> bool:
        self.last_refusal = f"{who}: {why}"
        return False

    def prepare(self, ubatches: Sequence[Ubatch]) -> bool:
        """Dry run on both memories; nothing changes."""
        if not self.recurrent.prepare(ubatches):
            return self._refuse("recurrent memory", self.recurrent.last_refusal)
        if not self.kv.prepare(ubatches):
            return self._refuse("kv cache", self.kv.last_refusal)
        return True

    def find_slot(self, ub: Ubatch) -> bool:
        """Place ub in both memories, or in neither: the KV cells are found first (no change),
        then the recurrent slot (which undoes itself on refusal), then the KV cells are applied."""
        idxs = self.kv.find_slot(ub)
        if idxs is None:
            return self._refuse("kv cache", self.kv.last_refusal)
        if not self.recurrent.find_slot(ub):
            return self._refuse("recurrent memory", self.recurrent.last_refusal)
        self.kv.apply_ubatch(idxs, ub)
        return True

    # -- sequence operations -------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        if not self.recurrent.seq_rm(seq, p0, p1):
            return self._refuse("seq_rm", self.recurrent.last_refusal)
        return self.kv.seq_rm(seq, p0, p1)

    def rollback(self, seq: int, k: int) -> bool:
        """Drop the last k tokens of seq: recurrent planes (may refuse, then nothing changes) and
        the KV cells of those positions."""
        last = self.seq_pos_max(seq)
        if not self.recurrent.rollback(seq, k):
            return self._refuse("rollback", self.recurrent.last_refusal)
        if k > 0:
            self.kv.seq_rm(seq, last - k + 1, -1)
        return True

    def pending_rollback(self, seq: int) -> int:
        return self.recurrent.pending_rollback(seq)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1):
        self.recurrent.seq_cp(src, dst, p0, p1)
        self.kv.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq: int):
        self.recurrent.seq_keep(seq)
        self.kv.seq_keep(seq)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int):
        self.recurrent.seq_add(seq, p0, p1, delta)
        self.kv.seq_add(seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int, d: int):
        self.recurrent.seq_div(seq, p0, p1, d)
        self.kv.seq_div(seq, p0, p1, d)

    def clear(self, data: bool = False):
        self.recurrent.clear(data)
        self.kv.clear(data)

    # -- snapshots and the step journal ------------------------------------------------------------
    def snapshot(self) -> HybridSnapshot:
        return HybridSnapshot(self.recurrent.snapshot(), self.kv.snapshot())

    def restore(self, snap: HybridSnapshot):
        self.recurrent.restore(snap.recurrent)
        self.kv.restore(snap.kv)

    def meta_copy(self) -> tuple:
        return self.recurrent.meta_copy(), self.kv.meta_copy()

    def restore_meta(self, meta: tuple):
        self.recurrent.restore_meta(meta[0])
        self.kv.restore_meta(meta[1])

    def byte_spans_written_by(self, ub: Ubatch, live=None) -> list:
        """(tensor, byte offset, nbytes) the graph of ub may write, in both memories (live: the
        recurrent cells whose rows count, RecurrentMemory.rows_written_by)."""
        return run_spans(self.byte_runs_written_by(ub, live))

    def byte_runs_written_by(self, ub: Ubatch, live=None, kv_cells=None) -> list:
        """The same as (tensor, byte offset, stride, count, nbytes) runs: one per recurrent row
        range and tensor, and the KV cache's (its V as strided runs); kv_cells: only those KV
        cells' (KVCache.byte_runs_written_by)."""
        rec = self.recurrent
        return rec.row_runs(rec.rows_written_by(ub, live)) + self.kv.byte_runs_written_by(ub, kv_cells)

    def kv_cells_positioned(self, cells, meta: tuple) -> set:
        """Those of the KV cells `cells` that held a position in `meta` (a meta_copy)."""
        pos = meta[1]["cells"].pos
        return {c for c in cells if pos[c] >= 0}

    def live_cells(self, meta: tuple | None = None) -> frozenset:
        """The recurrent cells that hold a sequence: now, or in `meta` (a meta_copy)."""
        return self.recurrent.live_cells(None if meta is None else meta[0])

    def read_span(self, t, offs: int, n: int) -> np.ndarray:
        return self.kv.read_span(t, offs, n)       # the same raw byte access for every tensor

    def write_span(self, t, offs: int, data: np.ndarray):
        self.kv.write_span(t, offs, data)

    # -- state save / load -------------------------------------------------------------------------
    def state_write(self, seq: int, path) -> int:
        """One file: the recurrent state (its own format) and the KV cells with their K/V rows.
        Returns the number of recurrent cells written."""
        rec_bytes, n = self._recurrent_state_bytes(seq)
        kv_bytes = self.kv.state_write(seq)
        with open(path, "wb") as f:
            f.write(HYBRID_STATE_MAGIC + len(rec_bytes).to_bytes(8, "little") + rec_bytes + kv_bytes)
        return n

    def _recurrent_state_bytes(self, seq: int) -> tuple[bytes, int]:
        fd, tmp = tempfile.mkstemp(suffix=".rs")
        os.close(fd)
        try:
            n = self.recurrent.state_write(seq, tmp)
            with open(tmp, "rb") as f:
                return f.read(), n
        finally:
            os.unlink(tmp)

    def state_read(self, seq: int, path) -> int:
        """Load a state_write file into seq; on a mismatch neither memory changes
        (StateFileError)."""
        with open(path, "rb") as f:
            data = f.read()
        if data[:4] != HYBRID_STATE_MAGIC:
            raise StateFileError(f"hybrid state_read: {path} is not a hybrid state (bad magic)")
        n = int.from_bytes(data[4:12], "little")
        rec_bytes, kv_bytes = data[12:12 + n], data[12 + n:]
        self.kv._parse_state(kv_bytes)               # a bad KV part refuses before anything changes
        saved = self.snapshot()
        fd, tmp = tempfile.mkstemp(suffix=".rs")
        os.close(fd)
        try:
            with open(tmp, "wb") as f:
                f.write(rec_bytes)
            count = self.recurrent.state_read(seq, tmp)
            self.kv.state_read(seq, kv_bytes)
        except BaseException:
            self.restore(saved)
            raise
        finally:
            os.unlink(tmp)
        return count

    def __repr__(self) -> str:
        return f"HybridMemory({self.recurrent!r}, {self.kv!r})"
