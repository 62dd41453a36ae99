"""Batches and their split into ubatches: llama.cpp's `llama_batch` / `llama_batch_allocr`.

A `Batch` is what a user decodes: tokens, their positions, the sequences each token belongs to
(a token may belong to several sequences: a shared prompt) and which tokens produce an output.
`BatchAllocr` validates one batch and cuts it into `Ubatch`es, as llama.cpp's llama_batch_allocr does:

* `split_simple(n)`  - the next n tokens in batch order (equal_seqs=False, one "sequence set" per token);
* `split_equal(n, sequential, n_keep_tail)` - the same number of tokens from each of several
  disjoint sequence sets, laid out seq-major (token s*n_seq_tokens + t is token t of set s); with
  n_keep_tail > 0 the last min(total, n_keep_tail) tokens of every set stay in one ubatch
  ([TAG_RECURRENT_ROLLBACK_SPLITS]);
* `split_seq(n)`     - tokens of one sequence set (and its subsets) only.

Each returns the next Ubatch, or None once every token has been used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

__all__ = ["Batch", "Ubatch", "BatchAllocr"]


class Batch:
    """tokens[i] at position pos[i], belonging to the sequences seq_ids[i] (a list; the first id is
    the token's "main" sequence), output[i] True when the token's logits are wanted.

    pos=None: positions are generated per sequence (from 0, or after the memory's last position
    when the batch is given to a BatchAllocr with a memory). output=None: only the last token of
    the batch is an output (llama.cpp's default)."""

    def __init__(self, tokens: Sequence[int], pos: Sequence[int] | None = None,
                 seq_ids: Sequence | None = None, output: Sequence[bool] | None = None):
        self.tokens = [int(t) for t in tokens]
        n = len(self.tokens)
        if n == 0:
            raise ValueError("a batch needs at least one token")
        if seq_ids is None:
            seq_ids = [[0]] * n
        self.seq_ids = [self._ids(i, s) for i, s in enumerate(seq_ids)]
        self.pos = None if pos is None else [int(p) for p in pos]
        if output is None:
            output = [False] * (n - 1) + [True]
        self.output = [bool(o) for o in output]
        for name, arr in (("seq_ids", self.seq_ids), ("output", self.output)) + \
                ((("pos", self.pos),) if self.pos is not None else ()):
            if len(arr) != n:
                raise ValueError(f"batch: {name} has {len(arr)} entries for {n} tokens")

    @staticmethod
    def _ids(i, s) -> list[int]:
        ids = [int(s)] if np.isscalar(s) else [int(x) for x in s]
        if not ids:
            raise ValueError(f"batch: token {i} belongs to no sequence")
        if len(set(ids)) != len(ids):
            raise ValueError(f"batch: token {i} lists a sequence twice: {ids}")
        if min(ids) < 0:
            raise ValueError(f"batch: token {i} has a negative sequence id: {ids}")
        return ids

    @classmethod
    def from_seqs(cls, seqs: Mapping[int, Sequence[int]], start_pos: Mapping[int, int] | None = None,
                  interleave: bool = False, output: str | Sequence[bool] = "last") -> "Batch":
        """{seq_id: [tokens...]} laid out seq by seq (dict order) or, with interleave=True, round
        robin (one token of each sequence in turn). start_pos: the first position of each sequence
        (default 0). output: 'last' (last token of each sequence), 'all', 'none' or a flag list
        for the resulting token order."""
        start_pos = dict(start_pos or {})
        per_seq = [(int(s), list(toks)) for s, toks in seqs.items() if len(toks) > 0]
        order: list[tuple[int, int]] = []          # (seq, index inside the seq)
        if interleave:
            longest = max((len(t) for _, t in per_seq), default=0)
            for j in range(longest):
                order += [(s, j) for s, toks in per_seq if j < len(toks)]
        else:
            for s, toks in per_seq:
                order += [(s, j) for j in range(len(toks))]
        lengths = {s: len(toks) for s, toks in per_seq}
        toks_of = dict(per_seq)
        tokens = [toks_of[s][j] for s, j in order]
        pos = [int(start_pos.get(s, 0)) + j for s, j in order]
        seq_ids = [[s] for s, _ in order]
        if isinstance(output, str):
            if output == "last":
                flags = [j == lengths[s] - 1 for s, j in order]
            elif output == "all":
                flags = [True] * len(order)
            elif output == "none":
                flags = [False] * len(order)
            else:
                raise ValueError(f"output must be 'last', 'all', 'none' or a flag list, got {output!r}")
        else:
            flags = list(output)
        return cls(tokens, pos, seq_ids, flags)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self):
        return len(self.tokens)

    def __repr__(self):
        return f"Batch({self.n_tokens} tokens, seqs {sorted({s for ids in self.seq_ids for s in ids})})"


@dataclass
class Ubatch:
    """llama_ubatch. Inside an equal split the order is seq-major: token s*n_seq_tokens + t is
    token t of sequence set s. `idxs` are the tokens' indices in the batch."""
    equal_seqs: bool
    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    n_seqs_unq: int
    token: np.ndarray                 # int32 [n_tokens]
    pos: np.ndarray                   # int32 [n_tokens]
    n_seq_id: list                    # [n_tokens]
    seq_id: list                      # [n_tokens] lists of seq ids
    seq_id_unq: list                  # sorted unique seq ids
    seq_idx: dict                     # seq id -> index in seq_id_unq
    output: list                      # [n_tokens] bool
    idxs: list = field(default_factory=list)

    @property
    def n_outputs(self) -> int:
        return int(sum(self.output))

    def seq_set(self, s: int) -> list[int]:
        """The seq ids of sequence set s (equal splits)."""
        return list(self.seq_id[s * self.n_seq_tokens])

    @classmethod
    def from_seq_sets(cls, sets: Sequence[tuple], tokens: Sequence[int] | None = None,
                      output: Sequence[bool] | None = None) -> "Ubatch":
        """An equal-split ubatch built by hand: sets = [(seq_ids, [pos...]), ...], all with the
        same number of positions (seq-major). Handy for tests and for state loading."""
        if not sets:
            raise ValueError("a ubatch needs at least one sequence set")
        n_seq_tokens = len(sets[0][1])
        if n_seq_tokens == 0 or any(len(p) != n_seq_tokens for _, p in sets):
            raise ValueError("every sequence set of an equal ubatch needs the same number (>0) of tokens")
        seq_id, pos = [], []
        for ids, ps in sets:
            ids = [int(ids)] if np.isscalar(ids) else [int(x) for x in ids]
            for p in ps:
                seq_id.append(list(ids))
                pos.append(int(p))
        n = len(pos)
        token = np.zeros(n, np.int32) if tokens is None else np.asarray(tokens, np.int32)
        out = [False] * n if output is None else [bool(o) for o in output]
        return _make_ubatch(token, pos, seq_id, out, len(sets), True, list(range(n)))

    @classmethod
    def reserve(cls, n_seq_tokens: int, n_seqs: int) -> "Ubatch":
        """ubatch_reserve: a worst-case shaped ubatch (tokens 0, positions 0, set s = seq s)."""
        return cls.from_seq_sets([([s], [0] * n_seq_tokens) for s in range(n_seqs)])

    def __repr__(self):
        return (f"Ubatch(equal_seqs={self.equal_seqs}, n_tokens={self.n_tokens}, "
                f"n_seq_tokens={self.n_seq_tokens}, n_seqs={self.n_seqs}, seq_id_unq={self.seq_id_unq})")


def _make_ubatch(token, pos, seq_id, output, n_seqs, equal_seqs, idxs) -> Ubatch:
    n = len(pos)
    if n % n_seqs:
        raise AssertionError(f"{n} tokens do not split into {n_seqs} equal sequence sets")
    unq = sorted({s for ids in seq_id for s in ids})
    return Ubatch(equal_seqs=equal_seqs, n_tokens=n, n_seq_tokens=n // n_seqs, n_seqs=n_seqs,
                  n_seqs_unq=len(unq), token=np.asarray(token, np.int32), pos=np.asarray(pos, np.int32),
                  n_seq_id=[len(ids) for ids in seq_id], seq_id=[list(ids) for ids in seq_id],
                  seq_id_unq=unq, seq_idx={s: i for i, s in enumerate(unq)}, output=list(output),
                  idxs=list(idxs))


class BatchAllocr:
    """Validates one batch (llama_batch_allocr::init) and splits it into ubatches.

    memory (optional): anything with seq_pos_max(seq) / seq_pos_min(seq); then missing positions
    continue each sequence, and a batch must continue each sequence at memory's last pos + 1."""

    def __init__(self, batch: Batch, memory=None):
        self.batch = batch
        n = batch.n_tokens
        pos = batch.pos
        if pos is None:
            nxt: dict[int, int] = {}
            pos = []
            for ids in batch.seq_ids:
                s0 = ids[0]
                if s0 not in nxt:
                    nxt[s0] = memory.seq_pos_max(s0) + 1 if memory is not None else 0
                p = nxt[s0]
                pos.append(p)
                for s in ids:
                    nxt[s] = p + 1
        self.pos = list(pos)
        self.seq_set = [frozenset(ids) for ids in batch.seq_ids]
        self.seq_set_map: dict[frozenset, list[int]] = {}
        for i, ss in enumerate(self.seq_set):
            self.seq_set_map.setdefault(ss, []).append(i)
        self.has_cpl = any(len(ids) > 1 for ids in batch.seq_ids)
        self.n_outputs = sum(batch.output)
        self._validate(memory)
        self.split_reset()

    # -- validation (llama_batch_allocr::init consistency checks) ---------------------------
    def _validate(self, memory):
        b = self.batch
        seq_pos: dict[int, list[int]] = {}
        for i, ids in enumerate(b.seq_ids):
            for s in ids:
                seq_pos.setdefault(s, []).append(self.pos[i])
        self.seq_pos = {s: sorted(set(ps)) for s, ps in seq_pos.items()}
        for s, ps in self.seq_pos.items():
            if ps[-1] - ps[0] + 1 > len(ps):
                raise ValueError(f"batch: the positions of sequence {s} are not continuous "
                                 f"({ps[0]}..{ps[-1]} with gaps)")
            if memory is not None:
                p0 = memory.seq_pos_max(s)
                if p0 >= 0 and ps[0] != p0 + 1:
                    raise ValueError(f"batch: sequence {s} starts at position {ps[0]} but the memory "
                                     f"holds it up to {p0}; positions must continue at {p0 + 1}")
        # no partial sequence sub-sets, no decreasing positions. The sets a sequence belongs to
        # must be nested in batch order (a shared prefix may split into its sequences, never
        # merge or cross). llama.cpp tests a running intersection for emptiness, which can never
        # fire (it always contains the sequence itself); we check the rule it describes.
        cur_set: dict[int, frozenset] = {}
        cur_pos: dict[int, int] = {}
        for i, ids in enumerate(b.seq_ids):
            for s in ids:
                prev = cur_set.get(s, self.seq_set[i])
                if not self.seq_set[i] <= prev:
                    raise ValueError(f"batch: sequence {s} belongs to incompatible sequence sets "
                                     f"(token {i} has {sorted(self.seq_set[i])} after "
                                     f"{sorted(prev)}); not allowed")
                cur_set[s] = self.seq_set[i]
                if self.pos[i] < cur_pos.get(s, -1):
                    raise ValueError(f"batch: the positions of sequence {s} decrease at token {i}")
                cur_pos[s] = self.pos[i]
        if memory is not None and self.has_cpl:
            for ids in b.seq_ids:
                for s1 in ids[1:]:
                    s0 = ids[0]
                    if (memory.seq_pos_min(s0) != memory.seq_pos_min(s1) or
                            memory.seq_pos_max(s0) != memory.seq_pos_max(s1)):
                        raise ValueError(f"batch: sequence {s1} is coupled to {s0} in the batch but "
                                         f"they have diverged in the memory")

    # -- state ------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return self.batch.n_tokens

    def split_reset(self):
        self.used = [False] * self.n_tokens
        self.n_used = 0
        self.ubatches: list[Ubatch] = []
        self.out_ids: list[int] = []

    def _take(self, i: int):
        if self.used[i]:
            raise RuntimeError(f"batch splitter: token {i} is already in a ubatch (taken twice)")
        self.used[i] = True
        self.n_used += 1

    def _give_back(self, i: int):
        if not self.used[i]:
            raise RuntimeError(f"batch splitter: token {i} is given back but was never taken")
        self.used[i] = False
        self.n_used -= 1

    def _first_unused(self) -> int | None:
        for i, u in enumerate(self.used):
            if not u:
                return i
        return None

    def ubatch_add(self, idxs: list[int], n_seqs: int, equal_seqs: bool) -> Ubatch:
        b = self.batch
        ub = _make_ubatch([b.tokens[i] for i in idxs], [self.pos[i] for i in idxs],
                          [b.seq_ids[i] for i in idxs], [b.output[i] for i in idxs],
                          n_seqs, equal_seqs, idxs)
        self.out_ids += [i for i in idxs if b.output[i]]
        self.ubatches.append(ub)
        return ub

    @staticmethod
    def _check_n_ubatch(n_ubatch: int):
        if int(n_ubatch) < 1:
            raise ValueError(f"n_ubatch must be >= 1, got {n_ubatch}")

    # -- splits -----------------------------------------------------------------------------
    def split_simple(self, n_ubatch: int) -> Ubatch | None:
        """The next (up to) n_ubatch unused tokens in batch order; equal_seqs=False."""
        self._check_n_ubatch(n_ubatch)
        cur = self._first_unused()
        if cur is None:
            return None
        idxs = []
        while cur < self.n_tokens and len(idxs) < n_ubatch:
            self._take(cur)
            idxs.append(cur)
            cur += 1
        return self.ubatch_add(idxs, len(idxs), False)

    def split_equal(self, n_ubatch: int, sequential: bool = False, n_keep_tail: int = 0) -> Ubatch | None:
        """llama.cpp's split_equal. Steps:
        1. sequential with coupled sequences is an error;
        2. pick disjoint sequence sets from the unused tokens in batch order (sequential: each
           set's first seq id = previous + 1), at most n_ubatch of them;
        3. take one token of every set per round while every set has one left and the next round
           still fits in n_ubatch;
        4. n_keep_tail > 0: keep the longest prefix of sets whose remaining tokens are 0 or
           >= n_keep_tail; if none, set 0 alone either finishes (when all its remaining tokens fit)
           or gives tokens back until >= n_keep_tail remain; dropped sets return to the pool.
        """
        self._check_n_ubatch(n_ubatch)
        n_keep_tail = int(n_keep_tail)
        if n_keep_tail < 0:
            raise ValueError(f"n_keep_tail must be >= 0, got {n_keep_tail}")
        if n_keep_tail > 0 and not n_ubatch > n_keep_tail:
            raise ValueError(f"split_equal: n_ubatch ({n_ubatch}) must be > n_keep_tail ({n_keep_tail}) "
                             f"so that the tail of a sequence fits in one ubatch")
        if sequential and self.has_cpl:
            raise ValueError("split_equal: a sequential split is not supported when the batch has "
                             "coupled sequences (tokens that belong to several sequences)")
        b = self.batch

        # 2. participating sequence sets
        cur_sets: list[frozenset] = []
        last_seq = -1
        for i in range(self.n_tokens):
            if self.used[i]:
                continue
            ss = self.seq_set[i]
            add = all(not (ss & c) for c in cur_sets)
            if sequential:
                add = add and (not cur_sets or b.seq_ids[i][0] == last_seq + 1)
            if add:
                cur_sets.append(ss)
                last_seq = b.seq_ids[i][0]
                # llama.cpp breaks only once MORE than n_ubatch sets are chosen, which can make a
                # ubatch of n_ubatch + 1 tokens; we never exceed n_ubatch
                if len(cur_sets) >= n_ubatch:
                    break
        n_seqs = len(cur_sets)
        if n_seqs == 0:
            return None

        # 3. lock-step expansion
        lists = [self.seq_set_map[ss] for ss in cur_sets]
        cur = []
        for lst in lists:
            j = 0
            while self.used[lst[j]]:
                j += 1
            cur.append(j)
        taken: list[list[int]] = [[] for _ in range(n_seqs)]
        while True:
            if any(cur[s] >= len(lists[s]) for s in range(n_seqs)):
                break
            for s in range(n_seqs):
                idx = lists[s][cur[s]]
                taken[s].append(idx)
                self._take(idx)
                cur[s] += 1
            if (len(taken[0]) + 1) * n_seqs > n_ubatch:
                break

        # 4. keep the tail of every sequence set together
        if n_keep_tail > 0:
            def remaining(s):
                return len(lists[s]) - cur[s]
            keep = 0
            while keep < n_seqs and (remaining(keep) == 0 or remaining(keep) >= n_keep_tail):
                keep += 1
            if keep == 0:
                keep = 1
                if len(taken[0]) + remaining(0) <= n_ubatch:
                    while cur[0] < len(lists[0]):            # finish the sequence set
                        idx = lists[0][cur[0]]
                        taken[0].append(idx)
                        self._take(idx)
                        cur[0] += 1
                else:
                    while remaining(0) < n_keep_tail:         # leave a full tail for later
                        cur[0] -= 1
                        self._give_back(taken[0].pop())
            for s in range(keep, n_seqs):                     # dropped sets go back to the pool
                for idx in taken[s]:
                    self._give_back(idx)
            taken = taken[:keep]
            n_seqs = keep

        idxs = [i for lst in taken for i in lst]
        return self.ubatch_add(idxs, n_seqs, True)

    def split_seq(self, n_ubatch: int) -> Ubatch | None:
        """Up to n_ubatch tokens of one sequence set: starting at the first unused token, each next
        token must belong to a subset of the current set (which then narrows); n_seqs = 1."""
        self._check_n_ubatch(n_ubatch)
        cur = self._first_unused()
        if cur is None:
            return None
        cur_set = self.seq_set[cur]
        idxs = []
        while True:
            idxs.append(cur)
            self._take(cur)
            if len(idxs) >= n_ubatch:
                break
            cur += 1
            while cur < self.n_tokens and (self.used[cur] or not self.seq_set[cur] <= cur_set):
                cur += 1
            if cur >= self.n_tokens:
                break
            cur_set = self.seq_set[cur]
        return self.ubatch_add(idxs, 1, True)

    def split_all(self, kind: str, n_ubatch: int, sequential: bool = False,
                  n_keep_tail: int = 0) -> list[Ubatch]:
        """Reset and split the whole batch: kind is 'simple', 'equal' or 'seq'. Raises ValueError
        if some token could not be placed."""
        self.split_reset()
        if kind == "simple":
            step = lambda: self.split_simple(n_ubatch)  # noqa: E731
        elif kind == "equal":
            step = lambda: self.split_equal(n_ubatch, sequential, n_keep_tail)  # noqa: E731
        elif kind == "seq":
            step = lambda: self.split_seq(n_ubatch)  # noqa: E731
        else:
            raise ValueError(f"unknown split kind {kind!r}: expected 'simple', 'equal' or 'seq'")
        out = []
        while (ub := step()) is not None:
            out.append(ub)
        if self.n_used != self.n_tokens:
            raise ValueError(f"split_{kind}: only {self.n_used} of {self.n_tokens} tokens could be placed")
        return out
