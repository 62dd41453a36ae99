"""The attention KV cache: llama.cpp's `llama_kv_cache` (one stream, no SWA, flash attention off).

Per attention layer il the cache holds two f32 tensors on that layer's device:

- `k_l[il]` = [n_embd_k_gqa, kv_size] ("cache_k_l{il}"): row c is the key of cell c;
- `v_l[il]` = [n_embd_v_gqa, kv_size] ("cache_v_l{il}"), stored *transposed* as llama.cpp does
  without flash attention: the value channel ch of cell c lives at element ch*kv_size + c, so
  get_v can hand mul_mat a [n_kv, n_embd_head_v, n_head_kv] view without a copy.
- a layer with n_embd_v_gqa 0 keeps K only (`v_l[il]` is None): llama.cpp's MLA cache, whose
  values are a view of the first channels of each key row (models/kda.py's MLA blocks).

Cells (`KVCells`, llama_kv_cells) carry a position, a set of sequence ids and an accumulated shift.
find_slot picks the ubatch's cells (any free cells, or one contiguous run when asked), apply_ubatch
writes their metadata, and the graph writes K/V through set_rows at the k_idxs / v_idxs inputs
(models/attn_inputs.py). A ubatch that does not fit is refused (find_slot returns None,
`last_refusal` says why) with nothing changed, as llama.cpp's prepare() refuses it.
"""
from __future__ import annotations

import io
import itertools
import json
import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

import minigraph as mg

from .layer_caches import alloc_zeroed, check_layers, layer_devices, per_layer

from .batch import Ubatch
from .memory import StateFileError, coalesce_rows, run_spans

__all__ = ["KVCells", "KVCache", "KVSnapshot", "GGML_KQ_MASK_PAD", "pad_to"]

POS_INF = 2**31 - 1               # llama_pos max: "to the end"
# the mask's token rows are padded to a multiple of this; ggml once padded them to 64, current
# llama.cpp no longer pads (a mask of [n_kv, n_tokens])
GGML_KQ_MASK_PAD = 1
KV_STATE_MAGIC = b"MGKV"
KV_STATE_VERSION = 1


def pad_to(x: int, n: int) -> int:
    """GGML_PAD: x rounded up to a multiple of n."""
    return ((x + n - 1) // n) * n


class KVCells:
    """llama_kv_cells: per cell a position (-1: empty), a set of seq ids and the shift accumulated
    by seq_add / seq_div since the last K shift (a rope model re-rotates K by it; see has_shift).
    The seq sets are frozensets, replaced rather than changed, so that a copy (once per step, for
    the undo journal and prepare's dry run) shares them: O(kv_size) list copies, no set copies.

    `hi` bounds the cells ever placed: cells [hi, size) have never held a position or a sequence
    since the cells were made (or cleared), so the scans a step makes (used cells, the highest
    one, a sequence's positions) stop there instead of walking a mostly empty cache of thousands
    of cells. Cells are placed only through `place`, which raises it."""

    def __init__(self, size: int):
        self.pos = [-1] * size
        self.seq: list[frozenset] = [frozenset()] * size
        self.shift = [0] * size
        self.has_shift = False
        self.hi = 0

    def place(self, i: int, pos: int, seqs: frozenset):
        """Cell i holds pos for seqs (a ubatch's token put in its cell)."""
        self.pos[i] = pos
        self.seq[i] = seqs
        if i >= self.hi:
            self.hi = i + 1

    def size(self) -> int:
        return len(self.pos)

    def is_empty(self, i: int) -> bool:
        return self.pos[i] < 0

    def used(self) -> int:
        pos = self.pos[:self.hi]
        if not pos or min(pos) >= -1:      # empty cells hold -1: counted at C speed (once per step)
            return len(pos) - pos.count(-1)
        return sum(1 for p in pos if p >= 0)

    def used_max_p1(self) -> int:
        """One past the highest used cell (0 when none): the graph attends to cells [0, n_kv).
        Scanned down from hi in blocks whose max is taken at C speed."""
        pos, step = self.pos, 64
        for end in range(self.hi, 0, -step):
            start = max(0, end - step)
            if max(pos[start:end]) >= 0:
                for i in range(end - 1, start - 1, -1):
                    if pos[i] >= 0:
                        return i + 1
        return 0

    def free(self, i: int):
        self.pos[i] = -1
        self.seq[i] = frozenset()
        self.shift[i] = 0

    def seq_rm(self, i: int, seq: int) -> bool:
        """Drop seq from cell i; True when that emptied the cell."""
        self.seq[i] = self.seq[i] - {seq}
        if not self.seq[i]:
            self.free(i)
            return True
        return False

    def pos_add(self, i: int, delta: int) -> bool:
        """Move cell i by delta; True when it fell below position 0 and was freed."""
        self.pos[i] += delta
        self.shift[i] += delta
        self.has_shift = True
        if self.pos[i] < 0:
            self.free(i)
            return True
        return False

    def pos_div(self, i: int, d: int):
        old = self.pos[i]
        self.pos[i] = old // d
        # llama.cpp's llama_kv_cells::pos_div records old - new, the opposite sign of pos_add's
        # (the K shift then rotates these keys forward by the distance, not back); kept as it
        # is so the cache matches llama.cpp's after a seq_div (tests/test_llama_oracle_lfm2.py)
        self.shift[i] += old - self.pos[i]
        self.has_shift = True

    def holds(self, seq: int, n: int):
        """For cells [0, n): whether each names seq (an iterator evaluated at C speed: map over
        the cells' sets, no Python loop per cell)."""
        return map(operator.contains, self.seq[:n], itertools.repeat(seq))

    def seq_pos(self, seq: int) -> list[int]:
        n = self.used_max_p1()             # no used cell lies past it, and an empty one names no
        if any(self.seq[n:self.hi]):       # sequence, unless a negative position put one there
            n = self.hi
        return list(itertools.compress(self.pos[:n], self.holds(seq, n)))

    def copy(self) -> "KVCells":
        c = KVCells(0)
        c.pos, c.seq, c.shift, c.has_shift = list(self.pos), list(self.seq), list(self.shift), self.has_shift
        c.hi = self.hi
        return c


@dataclass
class KVSnapshot:
    """Everything `restore` needs: cell metadata and the bytes of every K/V tensor."""
    meta: dict
    data: dict = field(default_factory=dict)     # tensor name -> uint8 array


class KVCache:
    """llama_kv_cache for the given attention layers.

    layers   : attention layer indices
    n_embd_k : int or callable il -> int (n_embd_head_k * n_head_kv)
    n_embd_v : int or callable il -> int (n_embd_head_v * n_head_kv, per layer; 0: K only)
    kv_size  : cells
    devices  : one backend, or a dict il -> backend (each layer's K/V on its layer's device)
    n_seq_max: sequence ids must be < n_seq_max
    n_pad    : n_kv (the cells a graph attends to) is a multiple of n_pad, so the graph can be
               reused while the used cells grow inside one pad step (llama.cpp pads to at least
               256; the test caches are small, so it is a parameter here)
    """

    def __init__(self, layers: Sequence[int], n_embd_k, n_embd_v, kv_size: int, devices,
                 n_seq_max: int = 1, n_pad: int = 32):
        self.layers = check_layers(layers, "kv cache")
        if int(kv_size) < 1:
            raise ValueError(f"kv cache: kv_size must be >= 1, got {kv_size}")
        if int(n_pad) < 1:
            raise ValueError(f"kv cache: n_pad must be >= 1, got {n_pad}")
        self.size = int(kv_size)
        self.n_seq_max = int(n_seq_max)
        self.n_pad = int(n_pad)
        self.n_embd_k = {il: per_layer(n_embd_k, il) for il in self.layers}
        self.n_embd_v = {il: per_layer(n_embd_v, il) for il in self.layers}
        # the V widths in use: the graph has one v_idxs input per width (llama.cpp pads every V
        # to the widest instead; the values read back are the same)
        self.v_widths = sorted(set(self.n_embd_v.values()) - {0})
        self.n_embd_v_max = max(self.v_widths) if self.v_widths else 0
        self.devices = layer_devices(self.layers, devices, "kv cache")

        self.k_l: dict[int, mg.Tensor] = {}
        self.v_l: dict[int, mg.Tensor | None] = {il: None for il in self.layers}

        def make(ctx, il):
            self.k_l[il] = ctx.new_tensor_2d(mg.f32, self.n_embd_k[il], self.size).set_name(f"cache_k_l{il}")
            if self.n_embd_v[il]:          # 0: a K-only layer (MLA) has no V tensor
                self.v_l[il] = ctx.new_tensor_2d(mg.f32, self.n_embd_v[il], self.size).set_name(f"cache_v_l{il}")
        self.buffers = alloc_zeroed(self.layers, self.devices, "kv_cache", make)
        self.last_refusal: str | None = None
        self.clear()

    # -- basic state ---------------------------------------------------------------------------
    def clear(self, data: bool = False):
        self.cells = KVCells(self.size)
        self.head = 0
        self.idxs: list[int] = []        # the cells of the ubatch placed last (k_idxs / v_idxs)
        self.n_kv = 0                    # the cells its graph attends to
        self.ubatch: Ubatch | None = None
        if data:
            for t in self.tensors():
                self._set_bytes(t, np.zeros(t.nbytes(), np.uint8))

    def tensors(self) -> list[mg.Tensor]:
        out = []
        for il in self.layers:
            out += [t for t in (self.k_l[il], self.v_l[il]) if t is not None]
        return out

    def get_size(self) -> int:
        return self.size

    def get_n_kv(self) -> int:
        """llama.cpp's get_n_kv: the used cells rounded up to n_pad, at most kv_size."""
        return min(self.size, max(self.n_pad, pad_to(self.cells.used_max_p1(), self.n_pad)))

    def seq_pos_min(self, seq: int) -> int:
        ps = self.cells.seq_pos(seq)
        return min(ps) if ps else -1

    def seq_pos_max(self, seq: int) -> int:
        ps = self.cells.seq_pos(seq)
        return max(ps) if ps else -1

    def _refuse(self, msg: str):
        self.last_refusal = msg
        return None

    # -- slots -----------------------------------------------------------------------------------
    def find_slot(self, ub: Ubatch, cont: bool = False) -> list[int] | None:
        """The cells for the ubatch's tokens, in token order, or None (`last_refusal` says why).
        Starts at head (from 0 when head is far past the used cells, as llama.cpp does, so the
        cache fills from the front); cont asks for one contiguous run. Changes nothing."""
        n_tokens, size, cells = ub.n_tokens, self.size, self.cells
        if n_tokens > size:
            return self._refuse(f"find_slot: n_tokens {n_tokens} > kv_size {size}")
        for s in ub.seq_id_unq:
            if not 0 <= s < self.n_seq_max:
                return self._refuse(f"find_slot: seq {s} out of range [0, {self.n_seq_max})")
        head = self.head
        if head > cells.used() + 2 * n_tokens:
            head = 0
        idxs: list[int] = []
        for n_tested in range(size):
            i = (head + n_tested) % size
            if cont and idxs and i != idxs[-1] + 1:
                idxs = []                  # wrapped around: a run cannot cross the end
            if cells.is_empty(i):
                idxs.append(i)
                if len(idxs) == n_tokens:
                    return idxs
            elif cont:
                idxs = []
        how = "contiguous free cells" if cont else "free cells"
        return self._refuse(f"find_slot: no {n_tokens} {how} in kv_size {size} "
                            f"({size - cells.used()} free)")

    def apply_ubatch(self, idxs: list[int], ub: Ubatch):
        """Write the ubatch's positions and seq ids into its cells; the graph inputs read idxs."""
        for i, c in enumerate(idxs):
            if not self.cells.is_empty(c):
                self.cells.free(c)
            self.cells.place(c, int(ub.pos[i]), frozenset(int(s) for s in ub.seq_id[i]))
        self.head = idxs[-1] + 1           # may be kv_size: the next search wraps to cell 0
        self.idxs = list(idxs)
        self.ubatch = ub
        self.n_kv = self.get_n_kv()

    def place(self, ub: Ubatch) -> bool:
        """find_slot then apply_ubatch; False (nothing changed) when there is no slot."""
        idxs = self.find_slot(ub)
        if idxs is None:
            return False
        self.apply_ubatch(idxs, ub)
        return True

    def prepare(self, ubatches: Sequence[Ubatch]) -> bool:
        """Dry run of placing every ubatch in turn; the cache is left as it was."""
        saved = self.meta_copy()
        try:
            return all(self.place(ub) for ub in ubatches)
        finally:
            refusal = self.last_refusal
            self.restore_meta(saved)
            self.last_refusal = refusal

    # -- sequence operations (llama.cpp's semantics: p0 < 0 is 0, p1 < 0 is "to the end") -------
    @staticmethod
    def _range(p0: int, p1: int) -> tuple[int, int]:
        return (0 if p0 < 0 else p0), (POS_INF if p1 < 0 else p1)

    def _in(self, i: int, seq: int, p0: int, p1: int) -> bool:
        c = self.cells
        return c.pos[i] >= 0 and (seq < 0 or seq in c.seq[i]) and p0 <= c.pos[i] < p1

    def _freed(self, i: int):
        if i < self.head:
            self.head = i              # a freed cell before head is where the next search starts

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of seq (seq < 0: of every sequence). Never refuses."""
        p0, p1 = self._range(p0, p1)
        for i in range(self.size):
            if self._in(i, seq, p0, p1):
                if seq < 0:
                    self.cells.free(i)
                    self._freed(i)
                elif self.cells.seq_rm(i, seq):
                    self._freed(i)
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1):
        """dst also owns src's cells in [p0, p1) (the cells are shared, nothing is copied)."""
        if src == dst:
            return
        p0, p1 = self._range(p0, p1)
        for i in range(self.size):
            if self._in(i, src, p0, p1):
                self.cells.seq[i] = self.cells.seq[i] | {dst}

    def seq_keep(self, seq: int):
        """Drop every sequence but seq."""
        for i in range(self.size):
            if self.cells.pos[i] < 0:
                continue
            if seq in self.cells.seq[i]:
                self.cells.seq[i] = frozenset((seq,))
            else:
                self.cells.free(i)
                self._freed(i)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int):
        """Shift seq's positions in [p0, p1) by delta; a cell moved below 0 is freed."""
        if delta == 0:
            return
        p0, p1 = self._range(p0, p1)
        if p0 == p1:
            return
        for i in range(self.size):
            if self._in(i, seq, p0, p1) and self.cells.pos_add(i, delta):
                self._freed(i)

    def seq_div(self, seq: int, p0: int, p1: int, d: int):
        """Integer-divide seq's positions in [p0, p1) by d."""
        if d == 1:
            return
        if d < 1:
            raise ValueError(f"kv seq_div: seq {seq}: divisor {d} must be >= 1")
        p0, p1 = self._range(p0, p1)
        for i in range(self.size):
            if self._in(i, seq, p0, p1):
                self.cells.pos_div(i, d)

    # -- metadata, bytes, snapshots ----------------------------------------------------------------
    def meta_copy(self) -> dict:
        return {"cells": self.cells.copy(), "head": self.head, "idxs": list(self.idxs), "n_kv": self.n_kv,
                "ubatch": self.ubatch}

    def restore_meta(self, m: dict):
        self.cells = m["cells"].copy()
        self.head, self.idxs, self.n_kv, self.ubatch = m["head"], list(m["idxs"]), m["n_kv"], m["ubatch"]

    @staticmethod
    def _get_bytes(t: mg.Tensor, offs: int = 0, n: int | None = None) -> np.ndarray:
        buf, base = t.storage()
        return t.backend.get_bytes(buf, base + offs, t.nbytes() if n is None else n)

    @staticmethod
    def _set_bytes(t: mg.Tensor, data: np.ndarray, offs: int = 0):
        buf, base = t.storage()
        t.backend.set_bytes(buf, base + offs, np.ascontiguousarray(data, np.uint8).reshape(-1))

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(self.meta_copy(), {t.name: self._get_bytes(t) for t in self.tensors()})

    def restore(self, snap: KVSnapshot):
        for t in self.tensors():
            self._set_bytes(t, snap.data[t.name])
        self.restore_meta(snap.meta)

    def byte_spans_written_by(self, ub: Ubatch) -> list[tuple[mg.Tensor, int, int]]:
        """(tensor, byte offset, nbytes) of everything the graph of `ub` (just placed) may write:
        the K rows of its cells, and in the transposed V the same cells of every channel row."""
        return run_spans(self.byte_runs_written_by(ub))

    def byte_runs_written_by(self, ub: Ubatch, cells=None) -> list[tuple[mg.Tensor, int, int, int, int]]:
        """The same bytes as (tensor, byte offset, stride, count, nbytes) runs: per run of cells,
        one span of K rows, and one strided run over V's channel rows (kv_size cells apart), so
        that the undo journal does not handle n_embd_v spans one by one per layer. cells: only
        those of the ubatch's cells (the journal's: the ones that held a position when the step
        began)."""
        if self.ubatch is not ub:
            raise ValueError("kv byte_runs_written_by: the ubatch was not the last one placed "
                             "(rule: call it right after a successful find_slot)")
        runs = coalesce_rows((c, 1) for c in self.idxs if cells is None or c in cells)
        out = []
        for il in self.layers:
            k, v = self.k_l[il], self.v_l[il]
            out += [(k, c0 * k.nb[1], 0, 1, n * k.nb[1]) for c0, n in runs]
            if v is None:
                continue
            elt = v.type.size
            out += [(v, c0 * elt, self.size * elt, self.n_embd_v[il], n * elt) for c0, n in runs]
        return out

    def read_span(self, t: mg.Tensor, offs: int, n: int) -> np.ndarray:
        return self._get_bytes(t, offs, n)

    def write_span(self, t: mg.Tensor, offs: int, data: np.ndarray):
        self._set_bytes(t, data, offs)

    def observable_bytes(self, t: mg.Tensor) -> bytes:
        """The raw bytes of K or V tensor t as attention can observe them: the entries of the
        cells that hold no position zeroed (every attention masks those cells out, and the undo
        journal does not save them: a failed step leaves them zeroed)."""
        raw = np.frombuffer(t.numpy().tobytes(), np.uint8).copy()
        free = [i for i, p in enumerate(self.cells.pos) if p < 0]
        for il in self.layers:
            if t is self.k_l[il]:
                raw.reshape(self.size, -1)[free] = 0
            elif t is self.v_l[il]:
                raw.reshape(self.n_embd_v[il], self.size, -1)[:, free] = 0
        return raw.tobytes()

    # -- K/V of cells as arrays (state files, tests) -------------------------------------------------
    def k_rows(self, il: int, cells: list[int]) -> np.ndarray:
        """[len(cells), n_embd_k] keys of the cells."""
        return self.k_l[il].numpy().reshape(self.size, self.n_embd_k[il])[cells]

    def v_rows(self, il: int, cells: list[int]) -> np.ndarray:
        """[len(cells), n_embd_v] values of the cells (read out of the transposed layout)."""
        if self.v_l[il] is None:
            return np.zeros((len(cells), 0), np.float32)
        return self.v_l[il].numpy().reshape(self.n_embd_v[il], self.size)[:, cells].T

    def write_cells(self, il: int, cells: list[int], k: np.ndarray, v: np.ndarray):
        """Put keys / values [len(cells), n_embd] into the cells (V into its transposed layout)."""
        kt, vt = self.k_l[il], self.v_l[il]
        kk = kt.numpy().reshape(self.size, self.n_embd_k[il]).copy()
        kk[cells] = k
        self._set_bytes(kt, kk.astype(np.float32).view(np.uint8))
        if vt is not None:
            vv = vt.numpy().reshape(self.n_embd_v[il], self.size).copy()
            vv[:, cells] = v.T
            self._set_bytes(vt, vv.astype(np.float32).view(np.uint8))

    # -- state save / load ----------------------------------------------------------------------------
    def state_write(self, seq: int = -1) -> bytes:
        """The cells of seq (seq < 0: every used cell, with its seq ids) in position order, and
        per layer their K and V rows, as bytes."""
        if seq >= self.n_seq_max:
            raise ValueError(f"kv state_write: seq {seq} >= n_seq_max ({self.n_seq_max})")
        ids = [i for i in range(self.size) if self.cells.pos[i] >= 0 and (seq < 0 or seq in self.cells.seq[i])]
        ids.sort(key=lambda i: self.cells.pos[i])
        header = {"version": KV_STATE_VERSION, "layers": self.layers, "seq": seq,
                  "n_embd_k": [self.n_embd_k[il] for il in self.layers],
                  "n_embd_v": [self.n_embd_v[il] for il in self.layers],
                  "pos": [self.cells.pos[i] for i in ids],
                  "seq_ids": [sorted(self.cells.seq[i]) if seq < 0 else [seq] for i in ids]}
        out = io.BytesIO()
        hb = json.dumps(header).encode()
        out.write(KV_STATE_MAGIC + len(hb).to_bytes(4, "little") + hb)
        for il in self.layers:
            out.write(np.ascontiguousarray(self.k_rows(il, ids), np.float32).tobytes())
            out.write(np.ascontiguousarray(self.v_rows(il, ids), np.float32).tobytes())
        return out.getvalue()

    def _parse_state(self, data: bytes) -> tuple[dict, dict]:
        if data[:4] != KV_STATE_MAGIC:
            raise StateFileError("kv state_read: not a KV state (bad magic)")
        n = int.from_bytes(data[4:8], "little")
        h = json.loads(data[8:8 + n])
        if h.get("version") != KV_STATE_VERSION:
            raise StateFileError(f"kv state_read: version {h.get('version')} (rule: this cache reads {KV_STATE_VERSION})")
        if h["layers"] != self.layers:
            raise StateFileError(f"kv state_read: layers {h['layers']} != this cache's {self.layers}")
        for key, mine in (("n_embd_k", self.n_embd_k), ("n_embd_v", self.n_embd_v)):
            if h[key] != [mine[il] for il in self.layers]:
                raise StateFileError(f"kv state_read: {key} {h[key]} != this cache's {[mine[il] for il in self.layers]}")
        count, offs, arrays = len(h["pos"]), 8 + n, {}
        for il in self.layers:
            for name, width in (("k", self.n_embd_k[il]), ("v", self.n_embd_v[il])):
                nb = count * width * 4
                if offs + nb > len(data):
                    raise StateFileError(f"kv state_read: layer {il} {name}: truncated state")
                arrays[(il, name)] = np.frombuffer(data[offs:offs + nb], np.float32).reshape(count, width)
                offs += nb
        if offs != len(data):
            raise StateFileError(f"kv state_read: {len(data) - offs} bytes left over")
        return h, arrays

    def state_read(self, seq: int, data: bytes) -> int:
        """Load a state from state_write into seq (seq < 0: the whole cache, cleared first; else
        seq's cells are replaced). Raises StateFileError with the cache unchanged when the state
        does not match or does not fit. Returns the number of cells read."""
        h, arrays = self._parse_state(data)
        count = len(h["pos"])
        saved = self.meta_copy()
        if seq < 0:
            self.clear()
        else:
            self.seq_rm(seq, -1, -1)
        if count == 0:
            return 0
        seq_ids = h["seq_ids"] if seq < 0 else [[seq]] * count
        ub = Ubatch.from_seq_sets([(ids, [p]) for ids, p in zip(seq_ids, h["pos"])])
        idxs = self.find_slot(ub)
        if idxs is None:
            why = self.last_refusal
            self.restore_meta(saved)
            raise StateFileError(f"kv state_read: {count} cells do not fit ({why})")
        self.apply_ubatch(idxs, ub)
        for il in self.layers:
            self.write_cells(il, idxs, arrays[(il, "k")], arrays[(il, "v")])
        return count

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.layers}, kv_size={self.size}, used={self.cells.used()}, "
                f"head={self.head})")
