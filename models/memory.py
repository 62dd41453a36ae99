"""The recurrent memory with rollback planes: llama.cpp's `llama_memory_recurrent`.

Per recurrent layer il the memory holds two f32 caches, `r_l[il]` = [n_embd_r, mem_size*K] (conv /
token-shift history, "cache_r_l{il}") and `s_l[il]` = [n_embd_s, mem_size*K] (SSM / delta-net state,
"cache_s_l{il}"), K = n_rs_seq + 1. Row `slot*mem_size + cell`: plane (slot) 0 is the live state,
plane j the state j tokens before the end of the last ubatch that wrote the cell.

The cell metadata (pos, src, src0, tail, seq ids), `find_slot`, `s_copy` and the sequence operations
follow llama.cpp; a rollback of k tokens only records `rs_idx[seq] = k`, and the next ubatch reads
its initial state from plane k (`s_copy`). The memory refuses a rollback it cannot serve exactly
(k > n_rs_seq, k >= n_last, one already pending); `last_refusal` says which rule.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

import minigraph as mg

from .layer_caches import alloc_zeroed, check_layers, layer_devices, per_layer

from .batch import Ubatch

log = logging.getLogger(__name__)

__all__ = ["Cell", "RecurrentMemory", "RecurrentContext", "MemorySnapshot", "StateFileError", "coalesce_rows"]

POS_INF = 2**31 - 1            # llama_pos max: "to the end"
STATE_FORMAT = "minigraph-recurrent-state"
STATE_VERSION = 1


class StateFileError(ValueError):
    """A state file that does not match this memory (or is not a state file at all)."""


@dataclass
class Cell:
    pos: int = -1                 # last position held, -1 empty
    src: int = -1                 # cell whose (plane-0) data this cell's state must be read from
    src0: int = -1                # src frozen by find_slot for input setting
    tail: int = -1                # for cell index == seq id: the cell holding that seq's state
    seq_id: set = field(default_factory=set)

    def is_empty(self) -> bool:
        return not self.seq_id

    def has_seq_id(self, s: int) -> bool:
        return s in self.seq_id

    def copy(self) -> "Cell":
        return Cell(self.pos, self.src, self.src0, self.tail, set(self.seq_id))


@dataclass
class MemorySnapshot:
    """Everything `restore` needs to put the memory back exactly: metadata and state bytes."""
    meta: dict
    data: dict                    # tensor name -> uint8 array


def coalesce_rows(spans) -> list[tuple[int, int]]:
    """(row0, count) spans sorted, overlapping or adjacent ones merged: one byte range each."""
    out: list[list[int]] = []
    for row0, count in sorted((int(a), int(b)) for a, b in spans if b > 0):
        if out and row0 <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], row0 + count - out[-1][0])
        else:
            out.append([row0, count])
    return [(a, b) for a, b in out]


def run_spans(runs) -> list[tuple[object, int, int]]:
    """(tensor, byte offset, stride, count, nbytes) runs of equal spans as plain
    (tensor, byte offset, nbytes) spans, one per span of each run."""
    return [(t, offs + i * stride, n) for t, offs, stride, count, n in runs for i in range(count)]


class RecurrentMemory:
    """llama_memory_recurrent for the given recurrent layers.

    layers   : recurrent layer indices
    n_embd_r : int or callable il -> int (row width of the r cache; 0 = no r tensor)
    n_embd_s : int or callable il -> int (row width of the s cache; 0 = no s tensor, e.g. LFM2)
    mem_size : cells (= max(1, n_seq_max)); sequence ids must be < mem_size
    n_rs_seq : rollback depth; K = n_rs_seq + 1 planes (forced to 0 when there are no layers)
    devices  : one backend for every layer, or a dict il -> backend (the per-layer device map)
    n_seq_max: sequences with a rollback index (default mem_size; at most mem_size)
    """

    def __init__(self, layers: Sequence[int], n_embd_r, n_embd_s, mem_size: int, n_rs_seq: int,
                 devices, n_seq_max: int | None = None):
        self.layers = check_layers(layers, "recurrent memory")
        if int(mem_size) < 1:
            raise ValueError(f"recurrent memory: mem_size must be >= 1, got {mem_size}")
        if int(n_rs_seq) < 0:
            raise ValueError(f"recurrent memory: n_rs_seq must be >= 0, got {n_rs_seq}")
        self.size = int(mem_size)
        self.n_seq_max = self.size if n_seq_max is None else int(n_seq_max)
        if not 1 <= self.n_seq_max <= self.size:
            raise ValueError(f"recurrent memory: n_seq_max ({self.n_seq_max}) must be in [1, mem_size={self.size}]")
        # a memory without layers has nothing to roll back
        self.n_rs_seq = int(n_rs_seq) if self.layers else 0
        self.K = self.n_rs_seq + 1

        self.n_embd_r = {il: per_layer(n_embd_r, il) for il in self.layers}
        self.n_embd_s = {il: per_layer(n_embd_s, il) for il in self.layers}
        for il in self.layers:
            if self.n_embd_r[il] < 0 or self.n_embd_s[il] < 0:
                raise ValueError(f"recurrent memory: negative state size for layer {il}")

        self.devices = layer_devices(self.layers, devices, "recurrent memory")

        self.r_l: dict[int, mg.Tensor | None] = {}
        self.s_l: dict[int, mg.Tensor | None] = {}
        n_rows = self.size * self.K

        def make(ctx, il):
            r = s = None
            if self.n_embd_r[il] > 0:
                r = ctx.new_tensor_2d(mg.f32, self.n_embd_r[il], n_rows).set_name(f"cache_r_l{il}")
            if self.n_embd_s[il] > 0:
                s = ctx.new_tensor_2d(mg.f32, self.n_embd_s[il], n_rows).set_name(f"cache_s_l{il}")
            self.r_l[il], self.s_l[il] = r, s
        self.buffers = alloc_zeroed(self.layers, self.devices, "rs_cache", make)

        self.last_refusal: str | None = None
        self.clear(data=False)

    # -- basic state --------------------------------------------------------------------------
    def is_empty(self) -> bool:
        """True when no layer is recurrent (llama.cpp's is_empty(): nothing to store)."""
        return not self.layers

    def clear(self, data: bool = False):
        self.cells = [Cell() for _ in range(self.size)]
        self.head = 0
        self.n = 0
        self.used = 0
        self.rs_z = -1
        self.rs_idx = [0] * self.n_seq_max
        self.n_last = [0] * self.n_seq_max
        self._ubatch_seqs: set = set()
        if data:
            for t in self.tensors():
                buf, offs = t.storage()
                t.backend.set_bytes(buf, offs, np.zeros(t.nbytes(), np.uint8))

    def tensors(self) -> list[mg.Tensor]:
        out = []
        for il in self.layers:
            out += [t for t in (self.r_l[il], self.s_l[il]) if t is not None]
        return out

    def set_rs_idx(self, seq: int, idx: int):
        if seq < 0:
            self.rs_idx = [0] * self.n_seq_max
            return
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"set_rs_idx: seq {seq} out of range [0, {self.n_seq_max})")
        if not 0 <= idx <= self.n_rs_seq:
            raise ValueError(f"set_rs_idx: plane {idx} out of range [0, n_rs_seq={self.n_rs_seq}]")
        self.rs_idx[seq] = idx

    def _forget(self, seq: int):
        """seq no longer has a state here: drop its pending rollback and its snapshot count."""
        if 0 <= seq < self.n_seq_max:
            self.rs_idx[seq] = 0
            self.n_last[seq] = 0

    # -- getters (llama_memory_recurrent_context) ---------------------------------------------
    def get_head(self) -> int:
        return self.head

    def get_n_rs(self) -> int:
        return self.n

    def get_rs_z(self) -> int:
        return self.rs_z

    def get_size(self) -> int:
        return self.size

    def get_r_l(self, il: int):
        return self.r_l[il]

    def get_s_l(self, il: int):
        return self.s_l[il]

    def seq_pos_min(self, seq: int) -> int:
        ps = [c.pos for c in self.cells if c.has_seq_id(seq)]
        return min(ps) if ps else -1

    def seq_pos_max(self, seq: int) -> int:
        ps = [c.pos for c in self.cells if c.has_seq_id(seq)]
        return max(ps) if ps else -1

    def used_cells(self) -> list[int]:
        """Indices of the cells that hold some sequence."""
        return [i for i, c in enumerate(self.cells) if not c.is_empty()]

    def pending_rollback(self, seq: int) -> int:
        return self.rs_idx[seq] if 0 <= seq < self.n_seq_max else 0

    # -- find_slot ------------------------------------------------------------------------------
    def _meta(self) -> dict:
        # Cell.copy, not copy.deepcopy: find_slot and every atomic step save the metadata, and
        # deepcopy of 64 cells costs milliseconds
        return {"cells": [c.copy() for c in self.cells], "head": self.head, "n": self.n, "used": self.used,
                "rs_z": self.rs_z, "rs_idx": list(self.rs_idx), "n_last": list(self.n_last),
                "ubatch_seqs": set(self._ubatch_seqs)}

    def _set_meta(self, m: dict):
        self.cells = [c.copy() for c in m["cells"]]
        self.head, self.n, self.used, self.rs_z = m["head"], m["n"], m["used"], m["rs_z"]
        self.rs_idx, self.n_last = list(m["rs_idx"]), list(m["n_last"])
        self._ubatch_seqs = set(m["ubatch_seqs"])

    def find_slot(self, ubatch: Ubatch) -> bool:
        """Place the ubatch's sequences in a contiguous cell range [head, head+n); False (memory
        unchanged, `last_refusal` says why) when it cannot."""
        if not ubatch.equal_seqs:
            raise ValueError("find_slot: the recurrent memory needs an equal split (equal_seqs=True); "
                             "use split_equal or split_seq")
        saved = self._meta()
        try:
            ok, why = self._find_slot(ubatch)
        except BaseException:
            self._set_meta(saved)
            raise
        if not ok:
            self._set_meta(saved)
            self.last_refusal = f"find_slot: {why}"
        return ok

    def _find_slot(self, ub: Ubatch) -> tuple[bool, str]:
        cells, size = self.cells, self.size
        nst, n_seqs = ub.n_seq_tokens, ub.n_seqs

        # 1. enough unused cells before head -> search from the start
        if self.head > self.used + 2 * n_seqs:
            self.head = 0

        tails_before = [c.tail for c in cells]
        # seq ids must fit; 2. extra seq ids of a token lose their own tail (cells become shared)
        for s in range(n_seqs):
            i = s * nst
            for j, seq in enumerate(ub.seq_id[i]):
                if seq < 0 or seq >= size or seq >= self.n_seq_max:
                    return False, (f"seq_id {seq} out of range [0, {min(size, self.n_seq_max)}): "
                                   f"the memory has {size} cells (use a bigger mem_size / n_seq_max)")
                if j > 0:
                    meta = cells[seq]
                    self._forget(seq)
                    if meta.tail >= 0:
                        cell = cells[meta.tail]
                        cell.seq_id.discard(seq)
                        meta.tail = -1
                        if cell.is_empty():
                            cell.pos = -1
                            cell.src = -1
                            self.used -= 1

        # 3. next empty cell from head (wrapping)
        claimed: set[int] = set()

        def next_empty(start: int) -> int | None:
            for k in range(size):
                c = (start + k) % size
                if cells[c].is_empty() and c not in claimed:
                    return c
            return None

        empty = next_empty(self.head)

        # 4. usable cell range
        lo, hi = size - 1, 0
        for s in range(n_seqs):
            seq = ub.seq_id[s * nst][0]
            meta = cells[seq]
            has_cell = False
            if meta.tail >= 0:
                cell = cells[meta.tail]
                if not cell.has_seq_id(seq):
                    raise ValueError(f"find_slot: the tail of seq {seq} points at cell {meta.tail}, which does "
                                     f"not hold seq {seq} (rule: a tail cell holds its sequence)")
                has_cell = len(cell.seq_id) == 1          # does this seq own the cell?
            if not has_cell:
                if empty is None:
                    return False, f"no free cell for seq {seq} ({self.used} of {size} cells used)"
                ec = cells[empty]
                if meta.tail >= 0:                         # copy the old tail into the empty cell
                    orig = cells[meta.tail]
                    ec.pos, ec.src = orig.pos, orig.src
                    orig.seq_id.discard(seq)
                    ec.seq_id.add(seq)                     # overwritten in step 6
                    if orig.is_empty():
                        raise ValueError(f"find_slot: cell {meta.tail} held only seq {seq} but was counted as "
                                         f"shared (rule: a shared tail cell keeps its other sequences)")
                meta.tail = empty
                claimed.add(empty)
                if s + 1 < n_seqs:
                    empty = next_empty(empty + 1)
            lo = min(lo, meta.tail)
            hi = max(hi, meta.tail)

        # 5. gather & reorder: ubatch seq s lives at cell lo + s
        for s in range(n_seqs):
            dst = lo + s
            src = cells[ub.seq_id[s * nst][0]].tail
            if dst != src:
                d, c = cells[dst], cells[src]
                d.pos, c.pos = c.pos, d.pos
                d.src, c.src = c.src, d.src
                d.seq_id, c.seq_id = c.seq_id, d.seq_id
                for cell in cells:
                    if cell.tail == src:
                        cell.tail = dst
                    elif cell.tail == dst:
                        cell.tail = src

        # 6. positions and seq ids of the ubatch's cells
        for s in range(n_seqs):
            i = s * nst
            last_pos = int(ub.pos[i + nst - 1])
            cid = lo + s
            cell = cells[cid]
            if cell.pos >= 0 and last_pos != cell.pos + nst:
                log.warning("find_slot: non-consecutive token position %d after %d for sequence %d "
                            "with %d new tokens", last_pos, cell.pos, ub.seq_id[i][0], nst)
            cell.pos = last_pos
            cell.seq_id = set(ub.seq_id[i])
            main = ub.seq_id[i][0]
            for seq in ub.seq_id[i]:
                cells[seq].tail = cid
                # the sequences of a cell share its state, so also its pending rollback (the
                # one of the token's main sequence); s_copy reads it from the cell's first seq
                self.rs_idx[seq] = self.rs_idx[main]

        # 7. the zero cell and the frozen sources
        refcount = [0] * size
        for c in cells:
            if c.src >= 0:
                refcount[c.src] += 1
        self.rs_z = next((i for i in range(lo, hi + 1) if refcount[i] == 0), -1)
        for i in range(lo, hi + 1):
            c = cells[i]
            if c.src < 0:
                if self.rs_z < 0:
                    return False, "no zero-able cell in the range (internal)"
                c.src0 = self.rs_z
            else:
                c.src0 = c.src
            c.src = i                                      # avoid moving or clearing twice

        # 8. range, used count
        self.head = lo
        self.n = hi - lo + 1
        self.used = sum(1 for c in cells if not c.is_empty())
        if self.n < n_seqs:
            return False, f"cell range of {self.n} is smaller than the {n_seqs} sequences of the ubatch"

        # snapshot bookkeeping (the k < n rule): the ubatch writes planes 0..min(n,K)-1 of its
        # sequences; a sequence whose cell moved without being in the ubatch only has plane 0 moved
        in_ub = {seq for s in range(n_seqs) for seq in ub.seq_id[s * nst]}
        self._ubatch_seqs = in_ub
        for seq in range(min(size, self.n_seq_max)):
            if seq in in_ub:
                self.n_last[seq] = nst
            elif cells[seq].tail != tails_before[seq]:
                self.n_last[seq] = 0
        return True, ""

    def prepare(self, ubatches: Sequence[Ubatch]) -> bool:
        """Dry run: True when every ubatch would find a slot; the memory is left as it was."""
        saved = self._meta()
        refusal = self.last_refusal
        ok = True
        try:
            for ub in ubatches:
                if not self.find_slot(ub):
                    ok = False
                    refusal = self.last_refusal
                    break
        finally:
            self._set_meta(saved)
            self.last_refusal = refusal
        return ok

    # -- the gather index -----------------------------------------------------------------------
    def s_copy(self, i: int, head: int | None = None) -> int:
        """Row to read the initial state of cell head+i from: src0, or k*size + src0 when the
        cell's first sequence has a pending rollback of k (which this call consumes)."""
        cid = (self.head if head is None else head) + i
        if not 0 <= cid < self.size:
            raise IndexError(f"s_copy: cell {cid} out of range [0, {self.size})")
        cell = self.cells[cid]
        if self.n_rs_seq == 0:
            return cell.src0
        idx = 0
        if cell.seq_id:
            seq = min(cell.seq_id)
            if 0 <= seq < self.n_seq_max:
                idx = self.rs_idx[seq]
                for s in cell.seq_id:                  # consume the pending rollback (of every
                    if 0 <= s < self.n_seq_max:        # sequence sharing the cell)
                        self.rs_idx[s] = 0
                        if idx and s not in self._ubatch_seqs:
                            # only plane k moves into plane 0 here; the other planes are stale
                            self.n_last[s] = 0
        return idx * self.size + cell.src0

    def s_copy_all(self, n_rs: int | None = None) -> np.ndarray:
        """[s_copy(i) for i < n_rs] as the I32 graph input (consumes pending rollbacks)."""
        n_rs = self.n if n_rs is None else n_rs
        return np.array([self.s_copy(i) for i in range(n_rs)], np.int32)

    # -- sequence operations --------------------------------------------------------------------
    def _refuse(self, msg: str) -> bool:
        self.last_refusal = msg
        return False

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of seq (p0 < 0: 0, p1 < 0: to the end; seq < 0: all seqs).

        Dropping a suffix that ends at the last position is a ROLLBACK of k tokens: allowed iff no
        rollback is pending, 1 <= k <= n_rs_seq and k < n_last[seq]; it only records rs_idx[seq] = k
        and sets pos -= k. Otherwise it is refused: False, nothing changed, `last_refusal` names
        the rule."""
        what = f"seq_rm(seq={seq}, p0={p0}, p1={p1})"
        p0 = 0 if p0 < 0 else p0
        p1 = POS_INF if p1 < 0 else p1
        rm_all = p0 == 0 and p1 == POS_INF
        if seq >= self.n_seq_max:
            return self._refuse(f"{what}: seq {seq} >= n_seq_max ({self.n_seq_max})")
        if seq >= self.size:
            return self._refuse(f"{what}: seq {seq} >= mem_size ({self.size})")

        new_head = self.size
        if seq >= 0:
            tail_id = self.cells[seq].tail
            if tail_id >= 0:
                cell = self.cells[tail_id]
                if 0 < p0 <= cell.pos < p1:
                    k = cell.pos - (p0 - 1)
                    if self.is_empty():
                        cell.pos = p0 - 1
                        self.last_refusal = None
                        return True
                    sharers = [s for s in cell.seq_id if 0 <= s < self.n_seq_max]
                    pending = {s: self.rs_idx[s] for s in sharers if self.rs_idx[s]}
                    if self.rs_idx[seq] or pending:
                        return self._refuse(
                            f"{what}: rollback of {k} refused by rule 'single pending rollback': "
                            f"a rollback is already pending ({pending or {seq: self.rs_idx[seq]}}) "
                            f"for the state of seq {seq}; it is consumed by the next ubatch")
                    if not 1 <= k <= self.n_rs_seq:
                        return self._refuse(
                            f"{what}: rollback of {k} refused by rule 'k <= n_rs_seq': only "
                            f"{self.n_rs_seq} rollback planes exist; re-evaluate from a checkpoint")
                    if not k < self.n_last[seq]:
                        return self._refuse(
                            f"{what}: rollback of {k} refused by rule 'k < n_last': the last ubatch "
                            f"wrote {self.n_last[seq]} token(s) of seq {seq}, so only planes "
                            f"0..{max(self.n_last[seq] - 1, 0)} hold its history")
                    for s in sharers:            # the cell's pos moves for all its sequences
                        self.set_rs_idx(s, k)
                    cell.pos = p0 - 1
                    self.last_refusal = None
                    return True
                if p0 <= cell.pos < p1:                # the seq loses its state
                    self.cells[seq].tail = -1
                    self._forget(seq)
        elif p0 != p1 and not rm_all:
            return self._refuse(f"{what}: a negative seq id only removes everything or nothing")

        if rm_all:
            if seq < 0:
                self.set_rs_idx(-1, 0)
                self.n_last = [0] * self.n_seq_max
            else:
                self._forget(seq)

        for i, c in enumerate(self.cells):
            if p0 <= c.pos < p1:
                if seq < 0:
                    for s in c.seq_id:
                        if 0 <= s < self.size:
                            self.cells[s].tail = -1 if self.cells[s].tail == i else self.cells[s].tail
                    c.seq_id.clear()
                elif c.has_seq_id(seq):
                    c.seq_id.discard(seq)
                else:
                    continue
                if c.is_empty():
                    if c.pos >= 0:
                        self.used -= 1
                    c.pos = -1
                    c.src = -1
                    if new_head == self.size:
                        new_head = i
        if new_head != self.size and new_head < self.head:
            self.head = new_head
        self.last_refusal = None
        return True

    def rollback(self, seq: int, k: int) -> bool:
        """Drop the last k tokens of seq: seq_rm(seq, pos_last - k + 1, -1), refused unless it is a
        rollback the planes can serve (see seq_rm)."""
        what = f"rollback(seq={seq}, k={k})"
        if k < 1:
            return self._refuse(f"{what}: refused by rule 'k >= 1': nothing to roll back")
        if not 0 <= seq < min(self.size, self.n_seq_max) or self.cells[seq].tail < 0:
            return self._refuse(f"{what}: seq {seq} has no state in the memory")
        pos_last = self.cells[self.cells[seq].tail].pos
        if pos_last - k + 1 <= 0:
            return self._refuse(f"{what}: refused: it would remove the whole sequence "
                                f"(last pos {pos_last}); use seq_rm(seq, -1, -1)")
        return self.seq_rm(seq, pos_last - k + 1, -1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1):
        """dst shares src's cell (no data copy): dst's old cell membership is dropped first."""
        if src == dst:
            return
        if 0 <= dst < self.size and 0 <= src < self.size:
            t_src, t_dst = self.cells[src], self.cells[dst]
            if t_dst.tail >= 0:
                cd = self.cells[t_dst.tail]
                cd.seq_id.discard(dst)
                t_dst.tail = -1
                if cd.is_empty():
                    cd.pos = -1
                    cd.src = -1
                    self.used -= 1
            self._forget(dst)                              # dst's own state is gone
            if t_src.tail >= 0:
                self.cells[t_src.tail].seq_id.add(dst)
                t_dst.tail = t_src.tail
                if dst < self.n_seq_max and src < self.n_seq_max:
                    # dst shares src's state: its snapshots and its pending rollback
                    self.n_last[dst] = self.n_last[src]
                    self.rs_idx[dst] = self.rs_idx[src]

    def seq_keep(self, seq: int):
        """Every cell not holding seq is cleared; cells holding it keep only seq."""
        new_head = self.size
        for i, c in enumerate(self.cells):
            if i != seq:
                c.tail = -1
            if not c.has_seq_id(seq):
                if c.pos >= 0:
                    self.used -= 1
                c.pos = -1
                c.src = -1
                c.seq_id.clear()
                if new_head == self.size:
                    new_head = i
            else:
                c.seq_id = {seq}
        for s in range(self.n_seq_max):
            if s != seq:
                self._forget(s)
        if new_head != self.size and new_head < self.head:
            self.head = new_head

    def _tail_cell_in(self, seq: int, p0: int, p1: int):
        """The seq's tail cell when its pos lies in [p0, p1) (negative bounds: open), else None."""
        p0 = 0 if p0 < 0 else p0
        p1 = POS_INF if p1 < 0 else p1
        if p0 == p1 or not 0 <= seq < self.size:
            return None
        t = self.cells[seq].tail
        if t < 0:
            return None
        c = self.cells[t]
        return c if c.has_seq_id(seq) and p0 <= c.pos < p1 else None

    def seq_add(self, seq: int, p0: int, p1: int, delta: int):
        """Shift the tail cell's pos by delta when it lies in [p0, p1)."""
        c = self._tail_cell_in(seq, p0, p1) if delta != 0 else None
        if c is not None:
            c.pos += delta

    def seq_div(self, seq: int, p0: int, p1: int, d: int):
        """Divide the tail cell's pos by d when it lies in [p0, p1)."""
        c = self._tail_cell_in(seq, p0, p1) if d != 1 else None
        if c is not None:
            c.pos = int(c.pos / d)          # C integer division truncates toward 0

    # -- batch init -------------------------------------------------------------------------------
    def init_batch(self, balloc, n_ubatch: int, embd_all: bool = False) -> "RecurrentContext":
        """Split the batch (split_seq if embd_all, else sequential split_equal keeping the last
        n_rs_seq+1 tokens of each sequence together) and dry-run find_slot on every ubatch."""
        balloc.split_reset()
        ubatches = []
        n_keep_tail = self.n_rs_seq + 1 if self.n_rs_seq > 0 else 0
        try:
            while True:
                ub = (balloc.split_seq(n_ubatch) if embd_all
                      else balloc.split_equal(n_ubatch, True, n_keep_tail))
                if ub is None:
                    break
                ubatches.append(ub)
        except ValueError as e:                            # e.g. coupled sequences, n_ubatch too small
            return RecurrentContext(self, status="failed_prepare", reason=str(e))
        if balloc.n_used < balloc.n_tokens:
            return RecurrentContext(self, status="failed_prepare",
                                    reason=f"only {balloc.n_used} of {balloc.n_tokens} tokens could be split")
        if not self.prepare(ubatches):
            return RecurrentContext(self, status="failed_prepare", reason=self.last_refusal or "")
        return RecurrentContext(self, ubatches=ubatches)

    def init_full(self) -> "RecurrentContext":
        """Worst-case context for graph reservation: head 0, n_rs = size, rs_z = 0."""
        return RecurrentContext(self, full=True)

    # -- snapshot / restore ---------------------------------------------------------------------
    def _tensor_bytes(self, t: mg.Tensor, offs: int = 0, n: int | None = None) -> np.ndarray:
        buf, base = t.storage()
        return t.backend.get_bytes(buf, base + offs, t.nbytes() if n is None else n)

    def _set_tensor_bytes(self, t: mg.Tensor, data: np.ndarray, offs: int = 0):
        buf, base = t.storage()
        t.backend.set_bytes(buf, base + offs, np.ascontiguousarray(data, np.uint8).reshape(-1))

    def snapshot(self) -> MemorySnapshot:
        """A deep copy of all cell metadata and of the bytes of every r/s tensor."""
        return MemorySnapshot(meta=self._meta(), data={t.name: self._tensor_bytes(t) for t in self.tensors()})

    def restore(self, snap: MemorySnapshot):
        """Put metadata and state bytes back exactly as they were at `snapshot()`."""
        names = {t.name: t for t in self.tensors()}
        if set(names) != set(snap.data):
            raise ValueError("restore: the snapshot was taken from a memory with other tensors "
                             f"({sorted(snap.data)} vs {sorted(names)})")
        for name, data in snap.data.items():
            if data.size != names[name].nbytes():
                raise ValueError(f"restore: {name} has {names[name].nbytes()} bytes, snapshot {data.size}")
            self._set_tensor_bytes(names[name], data)
        self._set_meta(snap.meta)

    # -- the rows a ubatch writes (failure atomicity) -------------------------------------------
    def rows_written_by(self, ub: Ubatch, live=None) -> list[tuple[int, int]]:
        """The cache rows (row0, count), coalesced, that the graph of `ub` may write, ub having just
        been placed by find_slot at [head, head+n). The same rows in every r/s tensor:

        - plane 0 of every cell in the range: build_rs zeroes the rs_z row and copies the states
          of the tail cells [head+n_seqs, head+n) in place;
        - planes 0..min(n_seq_tokens, K)-1 of the ubatch's own cells [head, head+n_seqs): the conv
          store and the ssm/delta-net state store write one rollback plane per token kept.

        live (a set of cell ids, live_cells()): only the rows of those cells. A step's undo journal
        passes the cells that held a sequence when the step began: the rows of the others hold
        nothing the restored memory reads (an empty cell that takes a sequence reads its state
        from the zeroed rs_z row, never its own bytes), so a prompt of new sequences saves none.

        This is what a step's undo journal copies, so its cost follows the ubatch, not mem_size."""
        if self.n < ub.n_seqs:
            raise ValueError(f"rows_written_by: the memory range holds {self.n} cells, the ubatch "
                             f"{ub.n_seqs} sequences (rule: call it right after a successful find_slot)")
        spans = [(self.head, self.n)]
        for plane in range(1, min(ub.n_seq_tokens, self.K)):
            spans.append((plane * self.size + self.head, ub.n_seqs))
        if live is not None:
            spans = [(row0 + i, 1) for row0, count in spans for i in range(count) if (row0 + i) % self.size in live]
        return coalesce_rows(spans)

    def row_runs(self, rows) -> list:
        """(tensor, byte offset, stride 0, count 1, nbytes) runs of the row ranges `rows` ((row0,
        count), as rows_written_by gives them) in every r/s tensor: one run per range and tensor."""
        return [(t, row0 * t.nb[1], 0, 1, count * t.nb[1]) for row0, count in rows for t in self.tensors()]

    def live_cells(self, meta: dict | None = None) -> frozenset:
        """The cells that hold a sequence: now, or in `meta` (a meta_copy)."""
        cells = self.cells if meta is None else meta["cells"]
        return frozenset(i for i, c in enumerate(cells) if not c.is_empty())

    def reads_rows_in_place(self, ub: Ubatch) -> bool:
        """True when the graph of `ub` (just placed by find_slot) writes only plane 0 of its own
        cells [head, head+n_seqs) and reads each cell's state from that same row (no tail cells,
        no zeroed row, no pending rollback): build_rs's gather of a cache tensor then holds, row for
        row, the old bytes of everything the graph writes in it. A decode step of sequences that
        stay in their cells is the common case."""
        if self.n != ub.n_seqs or self.rs_z >= 0 or self.rows_written_by(ub) != [(self.head, ub.n_seqs)]:
            return False
        for q in range(ub.n_seqs):
            cid = self.head + q
            cell = self.cells[cid]
            if cell.src0 != cid:
                return False
            if self.n_rs_seq and cell.seq_id and self.pending_rollback(min(cell.seq_id)):
                return False                               # s_copy would read another plane
        return True

    def read_row_bytes(self, t: mg.Tensor, row0: int, count: int) -> np.ndarray:
        """Raw bytes of rows [row0, row0+count) of a cache tensor: one contiguous span."""
        return self._tensor_bytes(t, row0 * t.nb[1], count * t.nb[1])

    def write_row_bytes(self, t: mg.Tensor, row0: int, data: np.ndarray):
        """Put raw row bytes (from read_row_bytes) back at row0."""
        self._set_tensor_bytes(t, data, row0 * t.nb[1])

    def meta_copy(self) -> dict:
        """A deep copy of the cell metadata and the rollback bookkeeping (no state bytes)."""
        return self._meta()

    def restore_meta(self, meta: dict):
        self._set_meta(meta)

    # -- rows ------------------------------------------------------------------------------------
    def row_index(self, cell: int, plane: int = 0) -> int:
        """Cache row of (plane, cell) = plane*mem_size + cell."""
        if not 0 <= cell < self.size or not 0 <= plane < self.K:
            raise IndexError(f"row_index: (plane {plane}, cell {cell}) out of range "
                             f"([0, {self.K}) x [0, {self.size}))")
        return plane * self.size + cell

    def read_rows(self, t: mg.Tensor, row0: int, count: int = 1) -> np.ndarray:
        """Rows [row0, row0+count) of a cache tensor as f32 [count, row width]."""
        nb1 = t.nb[1]
        raw = self._tensor_bytes(t, row0 * nb1, count * nb1)
        return raw.view(np.float32).reshape(count, t.ne[0]).copy()

    def write_rows(self, t: mg.Tensor, row0: int, rows: np.ndarray):
        rows = np.ascontiguousarray(rows, np.float32).reshape(-1, t.ne[0])
        self._set_tensor_bytes(t, rows.view(np.uint8).reshape(-1), row0 * t.nb[1])

    # -- state save / load --------------------------------------------------------------------------
    def _source_row(self, i: int, seq: int) -> int:
        """The logical source row of cell i: rs_idx*size + (src >= 0 ? src : i)."""
        c = self.cells[i]
        if self.n_rs_seq == 0:
            plane = 0
        elif seq >= 0:
            plane = self.rs_idx[seq]
        else:
            planes = {self.rs_idx[s] for s in c.seq_id if 0 <= s < self.n_seq_max}
            if len(planes) > 1:
                raise ValueError(f"state_write: cell {i} is shared by sequences {sorted(c.seq_id)} "
                                 f"with different pending rollbacks {sorted(planes)}")
            plane = planes.pop() if planes else 0
        return plane * self.size + (c.src if c.src >= 0 else i)

    def state_write(self, seq: int, path) -> int:
        """Write seq's cells (seq = -1: every used cell, with its seq ids) and, for every layer,
        their r and s rows read from the logical source row (a pending rollback of k reads plane
        k). Returns the number of cells written."""
        if seq >= self.n_seq_max:
            raise ValueError(f"state_write: seq {seq} >= n_seq_max ({self.n_seq_max})")
        ids = [i for i, c in enumerate(self.cells)
               if (seq == -1 and not c.is_empty()) or (seq >= 0 and c.has_seq_id(seq))]
        rows = [self._source_row(i, seq) for i in ids]
        header = {
            "format": STATE_FORMAT, "version": STATE_VERSION, "seq_id": int(seq),
            "mem_size": self.size, "n_rs_seq": self.n_rs_seq, "dtype": "f32", "s_trans": 0,
            "layers": self.layers,
            "n_embd_r": [self.n_embd_r[il] for il in self.layers],
            "n_embd_s": [self.n_embd_s[il] for il in self.layers],
            "cell_count": len(ids),
            "cells": [{"pos": self.cells[i].pos,
                       "seq_ids": sorted(self.cells[i].seq_id) if seq == -1 else []} for i in ids],
        }
        arrays = {"header": np.array(json.dumps(header))}
        for il in self.layers:
            for kind, t in (("r", self.r_l[il]), ("s", self.s_l[il])):
                if t is None:
                    continue
                arrays[f"{kind}_l{il}"] = (np.stack([self.read_rows(t, r)[0] for r in rows]) if rows
                                          else np.zeros((0, t.ne[0]), np.float32))
        if isinstance(path, (str, os.PathLike)):
            with open(path, "wb") as f:
                np.savez(f, **arrays)
        else:
            np.savez(path, **arrays)
        return len(ids)

    def _load_state(self, path) -> tuple[dict, dict]:
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except Exception as e:  # noqa: BLE001  (zip, pickle or format errors alike)
            raise StateFileError(f"state_read: {path!r} is not a readable state file: {e}") from e
        if "header" not in arrays:
            raise StateFileError(f"state_read: {path!r} has no header")
        try:
            h = json.loads(str(arrays["header"]))
        except ValueError as e:
            raise StateFileError(f"state_read: bad header: {e}") from e
        if h.get("format") != STATE_FORMAT:
            raise StateFileError(f"state_read: not a recurrent state file (format {h.get('format')!r})")
        if h.get("version") != STATE_VERSION:
            raise StateFileError(f"state_read: unsupported version {h.get('version')} (expected {STATE_VERSION})")
        if h.get("s_trans", 0):
            raise StateFileError("state_read: incompatible s transposition (transposed s layout)")
        if h.get("dtype") != "f32":
            raise StateFileError(f"state_read: state type {h.get('dtype')!r}, this memory stores f32")
        if list(h["layers"]) != self.layers:
            raise StateFileError(f"state_read: mismatched layers: the file has {len(h['layers'])} "
                                 f"recurrent layers {h['layers']}, this memory {len(self.layers)} {self.layers}")
        for j, il in enumerate(self.layers):
            for kind, sizes in (("r", self.n_embd_r), ("s", self.n_embd_s)):
                if h[f"n_embd_{kind}"][j] != sizes[il]:
                    raise StateFileError(f"state_read: mismatched {kind} row size in layer {il}: "
                                         f"file {h[f'n_embd_{kind}'][j]}, memory {sizes[il]}")
                key = f"{kind}_l{il}"
                want = (h["cell_count"], sizes[il])
                if sizes[il] > 0:
                    if key not in arrays or arrays[key].shape != want or arrays[key].dtype != np.float32:
                        got = None if key not in arrays else (arrays[key].shape, str(arrays[key].dtype))
                        raise StateFileError(f"state_read: {key} should be float32 {want}, got {got}")
        if h["cell_count"] != len(h["cells"]):
            raise StateFileError("state_read: cell count does not match the cell list")
        if h["cell_count"] > self.size:
            raise StateFileError(f"state_read: not enough cells: {h['cell_count']} > mem_size {self.size}")
        return h, arrays

    def state_read(self, seq: int, path) -> int:
        """Restore a state written by state_write into seq (seq = -1: the whole memory, which is
        cleared first). The rows go into plane 0 of the cells found; seq's rs_idx is reset.
        Raises StateFileError (a ValueError) on a file that does not match; the memory is then
        unchanged. Returns the number of cells read."""
        if seq >= self.n_seq_max:
            raise ValueError(f"state_read: seq {seq} >= n_seq_max ({self.n_seq_max})")
        h, arrays = self._load_state(path)
        count = h["cell_count"]
        saved = self._meta()
        try:
            if seq != -1:
                if count > 1:
                    raise StateFileError(f"state_read: a single sequence occupies one cell, the file has {count}")
                if any(c["seq_ids"] for c in h["cells"]):
                    raise StateFileError("state_read: the file holds seq-id-carrying cells (a whole-memory "
                                         "dump); read it with seq = -1")
                self.seq_rm(seq, -1, -1)
                if count == 0:
                    return 0
                ub = Ubatch.from_seq_sets([([seq], [c["pos"] for c in h["cells"]])])
                if not self.find_slot(ub):
                    raise StateFileError(f"state_read: failed to find a free cell for seq {seq}: "
                                         f"{self.last_refusal}")
                head = self.head
                if not (self.cells[head].has_seq_id(seq) and self.cells[head].pos == h["cells"][-1]["pos"]):
                    raise StateFileError(f"state_read: find_slot placed seq {seq} at cell {head} with pos "
                                         f"{self.cells[head].pos}, not at the file's pos {h['cells'][-1]['pos']}")
            else:
                if any(not c["seq_ids"] for c in h["cells"]):
                    raise StateFileError("state_read: the file was written for a single sequence; "
                                         "read it with that sequence's id, not -1")
                seqs = [s for c in h["cells"] for s in c["seq_ids"]]
                bad = [s for s in seqs if not 0 <= s < min(self.size, self.n_seq_max)]
                if bad:
                    raise StateFileError(f"state_read: seq ids {bad} out of range [0, {min(self.size, self.n_seq_max)})")
                if len(set(seqs)) != len(seqs):
                    raise StateFileError("state_read: a sequence appears in several cells")
                self.clear(data=True)
                for i, c in enumerate(h["cells"]):
                    self.cells[i].pos = int(c["pos"])
                    self.cells[i].seq_id = set(c["seq_ids"])
                    for s in c["seq_ids"]:
                        self.cells[s].tail = i
                head = 0
                self.head = 0
                self.used = count
            for i in range(count):
                self.cells[head + i].src = head + i        # keep the restored state in place
        except BaseException:
            self._set_meta(saved)
            raise
        for il in self.layers:
            for kind, t in (("r", self.r_l[il]), ("s", self.s_l[il])):
                if t is not None and count:
                    self.write_rows(t, head, arrays[f"{kind}_l{il}"])
        if seq >= 0:
            self._forget(seq)                              # rs_idx = 0, no valid older planes
        else:
            self.set_rs_idx(-1, 0)
            self.n_last = [0] * self.n_seq_max
        self.last_refusal = None
        return count

    # -- debugging ----------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"RecurrentMemory(size={self.size}, n_rs_seq={self.n_rs_seq}, layers={self.layers}, "
                 f"head={self.head}, n={self.n}, used={self.used}, rs_z={self.rs_z})",
                 " cell |  pos |  src | src0 | tail | seqs"]
        for i, c in enumerate(self.cells):
            mark = "*" if self.head <= i < self.head + self.n else " "
            seqs = ",".join(str(s) for s in sorted(c.seq_id)) or "-"
            lines.append(f"{mark}{i:4d} | {c.pos:4d} | {c.src:4d} | {c.src0:4d} | {c.tail:4d} | {seqs}")
        pend = {s: k for s, k in enumerate(self.rs_idx) if k}
        last = {s: k for s, k in enumerate(self.n_last) if k}
        lines.append(f" pending rollbacks: {pend or '-'}   n_last: {last or '-'}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<RecurrentMemory size={self.size} n_rs_seq={self.n_rs_seq} layers={self.layers} "
                f"used={self.used}>")


class RecurrentContext:
    """llama_memory_recurrent_context: the ubatches of one batch (apply() = find_slot for the
    current one) or a "full" context for worst-case graph reservation."""

    def __init__(self, mem: RecurrentMemory, ubatches: list | None = None, full: bool = False,
                 status: str = "success", reason: str = ""):
        self.mem = mem
        self.ubatches = list(ubatches or [])
        self.is_full = full
        self.status = status
        self.reason = reason
        self.i_next = 0

    @property
    def ok(self) -> bool:
        return self.status == "success"

    def next(self) -> bool:
        self.i_next += 1
        return self.i_next < len(self.ubatches)

    def apply(self) -> bool:
        if not self.ubatches:
            return True
        return self.mem.find_slot(self.ubatches[self.i_next])

    def get_ubatch(self) -> Ubatch:
        return self.ubatches[self.i_next]

    def get_n_rs(self) -> int:
        return self.mem.size if self.is_full else self.mem.n

    def get_head(self) -> int:
        return 0 if self.is_full else self.mem.head

    def get_rs_z(self) -> int:
        return 0 if self.is_full else self.mem.rs_z

    def get_size(self) -> int:
        return self.mem.size

    def get_r_l(self, il: int):
        return self.mem.r_l[il]

    def get_s_l(self, il: int):
        return self.mem.s_l[il]

    @property
    def r_l(self):
        return self.mem.r_l

    @property
    def s_l(self):
        return self.mem.s_l

    def s_copy(self, i: int) -> int:
        return self.mem.s_copy(i, head=self.get_head())
