"""Batches and ubatch splitting (llama.cpp's llama_batch_allocr): split_equal's tail guarantee as a property,
seq-major order, split_simple / split_seq shapes, and the errors for bad input."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minigraph.models.batch import Batch, BatchAllocr, Ubatch


# -- helpers ------------------------------------------------------------------------------------
@st.composite
def batches(draw, max_seqs=5, max_len=12):
    """A batch of 1..max_seqs independent sequences (distinct, possibly non-contiguous ids), each
    with 1..max_len tokens at consecutive positions, laid out in a random interleaving that keeps
    every sequence's own order."""
    n_seqs = draw(st.integers(1, max_seqs))
    ids = draw(st.lists(st.integers(0, 7), min_size=n_seqs, max_size=n_seqs, unique=True))
    lens = draw(st.lists(st.integers(1, max_len), min_size=n_seqs, max_size=n_seqs))
    starts = draw(st.lists(st.integers(0, 20), min_size=n_seqs, max_size=n_seqs))
    labels = [s for s, n in zip(ids, lens) for _ in range(n)]
    order = draw(st.permutations(labels))
    nxt = dict(zip(ids, starts))
    tokens, pos, seq_ids = [], [], []
    for s in order:
        tokens.append(1000 * s + nxt[s])
        pos.append(nxt[s])
        seq_ids.append([s])
        nxt[s] += 1
    out = draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
    return Batch(tokens, pos, seq_ids, out)


def check_common(batch, ubs, n_ubatch):
    """Every token used exactly once; n_tokens == n_seq_tokens*n_seqs <= n_ubatch; the ubatch
    fields agree with the batch; out_ids list the output tokens in ubatch order."""
    seen = [i for ub in ubs for i in ub.idxs]
    assert sorted(seen) == list(range(batch.n_tokens))
    for ub in ubs:
        assert ub.n_tokens == ub.n_seq_tokens * ub.n_seqs == len(ub.idxs) <= n_ubatch
        assert ub.token.dtype == np.int32 and ub.pos.dtype == np.int32
        assert list(ub.token) == [batch.tokens[i] for i in ub.idxs]
        assert list(ub.pos) == [batch.pos[i] for i in ub.idxs]
        assert ub.seq_id == [batch.seq_ids[i] for i in ub.idxs]
        assert ub.n_seq_id == [len(batch.seq_ids[i]) for i in ub.idxs]
        assert ub.output == [batch.output[i] for i in ub.idxs]
        unq = sorted({s for ids in ub.seq_id for s in ids})
        assert ub.seq_id_unq == unq and ub.n_seqs_unq == len(unq)
        assert all(ub.seq_idx[s] == k for k, s in enumerate(unq))


def check_seq_major(ub, sequential):
    """Token s*n_seq_tokens + t is token t of sequence set s: one set per block, consecutive
    positions, disjoint sets; sequential splits have consecutive first seq ids."""
    nst = ub.n_seq_tokens
    firsts = []
    sets = []
    for s in range(ub.n_seqs):
        block = range(s * nst, (s + 1) * nst)
        ss = {frozenset(ub.seq_id[i]) for i in block}
        assert len(ss) == 1
        sets.append(ss.pop())
        ps = [int(ub.pos[i]) for i in block]
        assert ps == list(range(ps[0], ps[0] + nst))
        firsts.append(ub.seq_id[s * nst][0])
    for a in range(len(sets)):
        for b in range(a + 1, len(sets)):
            assert not (sets[a] & sets[b])
    if sequential:
        assert firsts == list(range(firsts[0], firsts[0] + len(firsts)))


# -- split_equal: the property ------------------------------------------------------------------
@given(batch=batches(), n_keep_tail=st.integers(0, 6), extra=st.integers(1, 10),
       sequential=st.booleans())
def test_split_equal_tail_guarantee(batch, n_keep_tail, extra, sequential):
    n_ubatch = n_keep_tail + extra                       # n_keep_tail < n_ubatch
    al = BatchAllocr(batch)
    ubs = al.split_all("equal", n_ubatch, sequential=sequential, n_keep_tail=n_keep_tail)
    check_common(batch, ubs, n_ubatch)
    assert al.n_used == batch.n_tokens
    assert al.out_ids == [i for ub in ubs for i in ub.idxs if batch.output[i]]
    for ub in ubs:
        assert ub.equal_seqs
        check_seq_major(ub, sequential)
    # each sequence's tokens come in order across ubatches
    total = {}
    for ids in batch.seq_ids:
        total[ids[0]] = total.get(ids[0], 0) + 1
    for s in total:
        got = [int(ub.pos[j]) for ub in ubs for j in range(ub.n_tokens) if ub.seq_id[j][0] == s]
        assert got == sorted(got)
        # the guarantee: the LAST ubatch holding s has >= min(total, n_keep_tail) of its tokens
        last = [ub for ub in ubs if s in ub.seq_id_unq][-1]
        n_in_last = sum(1 for ids in last.seq_id if s in ids)
        assert n_in_last >= min(total[s], n_keep_tail)


@given(batch=batches(max_seqs=3), n_ubatch=st.integers(1, 9))
def test_split_simple_and_seq_shapes(batch, n_ubatch):
    al = BatchAllocr(batch)
    simple = al.split_all("simple", n_ubatch)
    check_common(batch, simple, n_ubatch)
    flat = [i for ub in simple for i in ub.idxs]
    assert flat == list(range(batch.n_tokens))           # batch order, chunks of n_ubatch
    for k, ub in enumerate(simple):
        assert not ub.equal_seqs and ub.n_seq_tokens == 1 and ub.n_seqs == ub.n_tokens
        assert ub.n_tokens == min(n_ubatch, batch.n_tokens - k * n_ubatch)

    seq = al.split_all("seq", n_ubatch)
    check_common(batch, seq, n_ubatch)
    for ub in seq:
        assert ub.equal_seqs and ub.n_seqs == 1 and ub.n_seq_tokens == ub.n_tokens
        assert len({ids[0] for ids in ub.seq_id}) == 1    # independent seqs: one per ubatch
        assert ub.idxs == sorted(ub.idxs)


# -- split_equal: hand-worked examples ----------------------------------------------------------
def sizes(ubs):
    return [(ub.n_seqs, ub.n_seq_tokens) for ub in ubs]


def test_split_equal_keep_tail_one_seq():
    b = Batch.from_seqs({0: list(range(10))})
    al = BatchAllocr(b)
    assert sizes(al.split_all("equal", 4)) == [(1, 4), (1, 4), (1, 2)]
    # 4 taken, 6 left; then 4 would leave 2 < 3 -> give 1 back (3 taken, 3 left); then 3
    assert sizes(al.split_all("equal", 4, True, 3)) == [(1, 4), (1, 3), (1, 3)]
    # a short sequence is finished when it fits
    assert sizes(BatchAllocr(Batch.from_seqs({0: [1, 2]})).split_all("equal", 4, True, 3)) == [(1, 2)]


def test_split_equal_keep_tail_prefix_of_sets():
    # seq 0: 5 tokens, seq 1: 3 tokens, n_ubatch 4, keep 3
    b = Batch.from_seqs({0: [1] * 5, 1: [2] * 3})
    ubs = BatchAllocr(b).split_all("equal", 4, sequential=True, n_keep_tail=3)
    # round 1: 2+2 tokens; seq 1 would keep 1 < 3 -> dropped (prefix = seq 0), seq 0 keeps 3 left
    # round 2: 2+2 again; seq 0 would keep 1 -> seq 0 alone finishes (2+1 <= 4); then seq 1 alone
    assert [(ub.seq_id_unq, ub.n_seq_tokens) for ub in ubs] == [([0], 2), ([0], 3), ([1], 3)]
    assert [list(ub.pos) for ub in ubs] == [[0, 1], [2, 3, 4], [0, 1, 2]]
    # without the tail rule both go in lock-step
    ubs = BatchAllocr(b).split_all("equal", 4, sequential=True)
    assert [(ub.seq_id_unq, ub.n_seq_tokens) for ub in ubs] == [([0, 1], 2), ([0, 1], 1), ([0], 2)]


def test_split_equal_seq_major_layout_interleaved():
    b = Batch.from_seqs({0: [10, 11, 12], 1: [20, 21, 22]}, start_pos={0: 5, 1: 0}, interleave=True)
    assert b.tokens == [10, 20, 11, 21, 12, 22]
    (ub,) = BatchAllocr(b).split_all("equal", 8)
    assert (ub.n_seqs, ub.n_seq_tokens) == (2, 3)
    assert list(ub.token) == [10, 11, 12, 20, 21, 22]     # seq-major
    assert list(ub.pos) == [5, 6, 7, 0, 1, 2]
    assert ub.seq_set(0) == [0] and ub.seq_set(1) == [1]
    assert ub.output == [False, False, True, False, False, True]   # 'last' of each seq


def test_split_equal_caps_sets_at_n_ubatch():
    b = Batch.from_seqs({s: [s] for s in range(5)})
    ubs = BatchAllocr(b).split_all("equal", 3)
    assert sizes(ubs) == [(3, 1), (2, 1)]
    assert all(ub.n_tokens <= 3 for ub in ubs)


def test_split_equal_sequential_needs_consecutive_ids():
    b = Batch.from_seqs({0: [1, 1], 2: [2, 2], 3: [3, 3]})
    ubs = BatchAllocr(b).split_all("equal", 8, sequential=True)
    assert [ub.seq_id_unq for ub in ubs] == [[0], [2, 3]]
    ubs = BatchAllocr(b).split_all("equal", 8, sequential=False)
    assert [ub.seq_id_unq for ub in ubs] == [[0, 2, 3]]


def test_coupled_sequences():
    # a shared prompt of two tokens (seqs 0 and 1), then one token each
    b = Batch([1, 2, 3, 4], [0, 1, 2, 2], [[0, 1], [0, 1], [0], [1]], [False, False, True, True])
    al = BatchAllocr(b)
    assert al.has_cpl
    with pytest.raises(ValueError, match="coupled"):
        al.split_equal(4, sequential=True)
    ubs = al.split_all("equal", 4, sequential=False)
    check_common(b, ubs, 4)
    assert [(ub.seq_id_unq, ub.n_seqs, ub.n_seq_tokens) for ub in ubs] == [([0, 1], 1, 2), ([0, 1], 2, 1)]
    assert ubs[0].n_seq_id == [2, 2]
    # split_seq: the set {0,1} continues with its subsets {0}; {1} is a new ubatch
    seq = al.split_all("seq", 8)
    assert [ub.idxs for ub in seq] == [[0, 1, 2], [3]]


def test_n_keep_tail_must_be_below_n_ubatch():
    al = BatchAllocr(Batch.from_seqs({0: [1, 2, 3]}))
    with pytest.raises(ValueError, match="n_ubatch .* must be > n_keep_tail"):
        al.split_equal(3, True, 3)
    with pytest.raises(ValueError, match="n_ubatch"):
        al.split_simple(0)
    with pytest.raises(ValueError, match="unknown split kind"):
        al.split_all("bogus", 4)


def test_split_returns_none_when_done():
    al = BatchAllocr(Batch.from_seqs({0: [1, 2]}))
    assert al.split_equal(8) is not None
    assert al.split_equal(8) is None and al.split_simple(8) is None and al.split_seq(8) is None


# -- batch validation ---------------------------------------------------------------------------
def test_batch_validation():
    with pytest.raises(ValueError, match="at least one token"):
        Batch([])
    with pytest.raises(ValueError, match="pos has 1 entries"):
        Batch([1, 2], [0], [[0], [0]])
    with pytest.raises(ValueError, match="negative"):
        Batch([1], [0], [[-1]])
    with pytest.raises(ValueError, match="no sequence"):
        Batch([1], [0], [[]])
    with pytest.raises(ValueError, match="not continuous"):
        BatchAllocr(Batch([1, 2], [0, 2], [[0], [0]]))
    with pytest.raises(ValueError, match="decrease"):
        BatchAllocr(Batch([1, 2], [1, 0], [[0], [0]]))
    # seq 1 in {0,1} and then in {1,2}: incompatible sets
    with pytest.raises(ValueError, match="incompatible"):
        BatchAllocr(Batch([1, 2], [0, 1], [[0, 1], [1, 2]]))


def test_batch_defaults_and_memory_positions():
    b = Batch([5, 6, 7])
    assert b.seq_ids == [[0], [0], [0]] and b.output == [False, False, True] and b.pos is None

    class Mem:                        # seq 0 holds positions up to 9
        def seq_pos_max(self, s):
            return 9 if s == 0 else -1

        def seq_pos_min(self, s):
            return 9 if s == 0 else -1

    al = BatchAllocr(Batch([1, 2, 3], None, [[0], [1], [0]]), memory=Mem())
    assert al.pos == [10, 0, 11]
    with pytest.raises(ValueError, match="must continue at 10"):
        BatchAllocr(Batch([1], [3], [[0]]), memory=Mem())


def test_ubatch_from_seq_sets_and_reserve():
    ub = Ubatch.from_seq_sets([([2], [4, 5]), ([0, 1], [7, 8])])
    assert ub.equal_seqs and (ub.n_seqs, ub.n_seq_tokens, ub.n_tokens) == (2, 2, 4)
    assert ub.seq_id_unq == [0, 1, 2] and ub.n_seqs_unq == 3 and ub.seq_set(1) == [0, 1]
    r = Ubatch.reserve(3, 2)
    assert (r.n_seqs, r.n_seq_tokens) == (2, 3) and r.seq_id_unq == [0, 1]
    with pytest.raises(ValueError):
        Ubatch.from_seq_sets([([0], [1, 2]), ([1], [1])])


def test_nested_sequence_sets():
    # a shared prefix may split into its sequences ...
    BatchAllocr(Batch([1, 2, 3], [0, 1, 1], [[0, 1], [0], [1]]))
    # ... but a sequence may not join a larger set after being alone
    with pytest.raises(ValueError, match="incompatible"):
        BatchAllocr(Batch([1, 2], [0, 1], [[0], [0, 1]]))


@st.composite
def coupled_batches(draw):
    """A shared prompt of seqs {0..g-1} followed by each sequence's own tokens, interleaved."""
    g = draw(st.integers(2, 3))
    n_shared = draw(st.integers(1, 8))
    lens = draw(st.lists(st.integers(0, 8), min_size=g, max_size=g))
    labels = [s for s in range(g) for _ in range(lens[s])]
    order = draw(st.permutations(labels))
    tokens, pos, seq_ids = [], [], []
    for p in range(n_shared):
        tokens.append(p)
        pos.append(p)
        seq_ids.append(list(range(g)))
    nxt = [n_shared] * g
    for s in order:
        tokens.append(100 + s)
        pos.append(nxt[s])
        seq_ids.append([s])
        nxt[s] += 1
    return Batch(tokens, pos, seq_ids, [True] * len(tokens))


@given(batch=coupled_batches(), n_keep_tail=st.integers(0, 4), extra=st.integers(1, 6))
def test_split_equal_coupled_sets_keep_their_tail(batch, n_keep_tail, extra):
    n_ubatch = n_keep_tail + extra
    al = BatchAllocr(batch)
    ubs = al.split_all("equal", n_ubatch, sequential=False, n_keep_tail=n_keep_tail)
    check_common(batch, ubs, n_ubatch)
    for ub in ubs:
        check_seq_major(ub, False)
    # the guarantee holds per sequence SET (the shared prompt is a set of its own)
    for ss, idxs in al.seq_set_map.items():
        last = [ub for ub in ubs if any(frozenset(ids) == ss for ids in ub.seq_id)][-1]
        n_in_last = sum(1 for ids in last.seq_id if frozenset(ids) == ss)
        assert n_in_last >= min(len(idxs), n_keep_tail)
