"""The recurrent memory (llama.cpp's llama_memory_recurrent): find_slot's steps on hand-worked examples, s_copy and the
rollback planes, the rollback rules (each refusal named, nothing changed), sequence operations,
snapshot/restore, state save/load with a pending rollback, and the per-layer device map."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.models.batch import Batch, BatchAllocr, Ubatch
from minigraph.models.memory import RecurrentMemory, StateFileError

REF = mg.backend("ref")


def mem(size=4, n_rs_seq=0, layers=(0,), r=6, s=4, devices=REF):
    return RecurrentMemory(list(layers), r, s, size, n_rs_seq, devices)


def ub(*sets):
    """ub(([seq...], first_pos, n_tokens), ...) -> an equal-split ubatch, seq-major."""
    return Ubatch.from_seq_sets([(ids, list(range(p, p + n))) for ids, p, n in sets])


def cells(m):
    return [(c.pos, c.src, c.src0, c.tail, sorted(c.seq_id)) for c in m.cells]


def state(m):
    """Everything observable about the metadata, for 'nothing changed' checks."""
    return (cells(m), m.head, m.n, m.used, m.rs_z, list(m.rs_idx), list(m.n_last))


def fill_random(m, seed=0):
    rng = np.random.default_rng(seed)
    for t in m.tensors():
        t.set(rng.standard_normal(t.shape).astype(np.float32) + 1.0)


# -- layout ---------------------------------------------------------------------------------------
def test_tensors_layout_names_zeroed():
    m = RecurrentMemory([1, 3, 4], lambda il: 2 + il, lambda il: 0 if il == 3 else 5, 3, 2, REF)
    assert m.K == 3
    for il in (1, 3, 4):
        r = m.r_l[il]
        assert r.name == f"cache_r_l{il}" and r.type == mg.f32 and list(r.ne[:2]) == [2 + il, 9]
        assert np.all(r.numpy() == 0)
        assert r.backend is REF
    assert m.s_l[3] is None                                  # n_embd_s = 0 -> no s tensor (LFM)
    assert m.s_l[1].name == "cache_s_l1" and list(m.s_l[1].ne[:2]) == [5, 9]
    assert np.all(m.s_l[4].numpy() == 0)
    assert m.row_index(cell=2, plane=1) == 1 * 3 + 2
    with pytest.raises(IndexError):
        m.row_index(3, 0)


def test_device_map_per_layer():
    devs = {0: REF, 1: REF}
    try:
        devs[1] = mg.backend("cpu:1")
    except Exception:                                         # noqa: BLE001  (cpu backend not built)
        pass
    m = RecurrentMemory([0, 1], 4, 3, 2, 1, devs)
    for il, d in devs.items():
        assert m.r_l[il].backend.name == d.name and m.s_l[il].backend.name == d.name
        assert np.all(m.r_l[il].numpy() == 0)
    assert len(m.buffers) == len({d.name for d in devs.values()})   # one context per device
    # raw bytes through each device's get_bytes / set_bytes
    fill_random(m, 9)
    data = {t.name: t.numpy() for t in m.tensors()}
    snap = m.snapshot()
    fill_random(m, 10)
    m.restore(snap)
    assert all(np.array_equal(t.numpy(), data[t.name]) for t in m.tensors())
    assert np.array_equal(m.read_rows(m.s_l[1], 3)[0], data["cache_s_l1"][3])
    with pytest.raises(ValueError, match="no device"):
        RecurrentMemory([0, 1], 4, 3, 2, 1, {0: REF})


def test_no_layers_forces_n_rs_seq_0():
    m = RecurrentMemory([], 4, 4, 2, 3, REF)
    assert m.n_rs_seq == 0 and m.is_empty() and m.tensors() == []


# -- find_slot --------------------------------------------------------------------------------------
def test_find_slot_one_seq():
    m = mem()
    assert m.find_slot(ub(([0], 0, 3)))
    assert cells(m)[0] == (2, 0, 0, 0, [0])                  # pos = last pos, src = i, src0 = rs_z
    assert (m.get_head(), m.get_n_rs(), m.get_rs_z(), m.used) == (0, 1, 0, 1)
    assert m.n_last[0] == 3
    # next ubatch: the seq owns its cell -> it stays there, src0 = itself
    assert m.find_slot(ub(([0], 3, 1)))
    assert cells(m)[0] == (3, 0, 0, 0, [0]) and m.get_rs_z() == -1
    assert m.s_copy(0) == 0 and m.n_last[0] == 1


def test_find_slot_several_seqs_and_gather():
    m = mem(size=4)
    assert m.find_slot(ub(([1], 0, 2)))                      # seq 1 -> cell 0
    assert m.find_slot(ub(([2], 0, 2)))                      # seq 2 -> cell 1
    assert m.find_slot(ub(([0], 0, 2)))                      # seq 0 -> cell 2
    assert [m.cells[s].tail for s in range(3)] == [2, 0, 1]
    assert m.seq_rm(2, -1, -1)                               # frees cell 1, head moves back
    assert m.head == 1 and m.used == 2 and m.cells[1].is_empty()
    # ubatch with seqs 0 and 1: tails 2 and 0 -> range [0, 2]; gather puts seq 0 at cell 0 and
    # seq 1 at cell 1, remembering where their data is (src)
    assert m.find_slot(ub(([0], 2, 1), ([1], 2, 1)))
    assert (m.head, m.n) == (0, 3)
    assert cells(m)[:3] == [(2, 0, 2, 0, [0]), (2, 1, 0, 1, [1]), (-1, 2, 1, -1, [])]
    assert m.rs_z == 1                                       # first cell in range nobody reads from
    assert list(m.s_copy_all()) == [2, 0, 1]
    assert m.used == 2


def test_find_slot_restarts_at_zero_and_checks_seq_ids():
    m = mem(size=8)
    m.head = 7                                               # head > used + 2*n_seqs -> search from 0
    assert m.find_slot(ub(([0], 0, 1)))
    assert m.cells[0].seq_id == {0}
    before = state(m)
    assert not m.find_slot(ub(([8], 0, 1)))                  # seq ids must be < mem_size
    assert "seq_id 8" in m.last_refusal and state(m) == before
    with pytest.raises(ValueError, match="equal split"):
        m.find_slot(BatchAllocr(Batch([1, 2])).split_simple(2))


def test_seq_cp_sharing_and_copy_on_write():
    m = mem(size=4)
    assert m.find_slot(ub(([0], 0, 3)))
    m.seq_cp(0, 1)                                           # seq 1 shares cell 0, no data copy
    assert m.cells[0].seq_id == {0, 1} and m.cells[1].tail == 0 and m.used == 1
    assert m.seq_pos_max(1) == 2 and m.n_last[1] == m.n_last[0]
    # seq 1 continues: its cell is shared, so it gets the next empty cell, pos and src copied
    assert m.find_slot(ub(([1], 3, 1)))
    assert cells(m)[0] == (2, 0, 0, 0, [0])
    assert cells(m)[1] == (3, 1, 0, 1, [1])                  # src0 = 0: read seq 0's state
    assert (m.head, m.n) == (1, 1) and m.s_copy(0) == 0 and m.used == 2


def test_extra_seq_ids_lose_their_tail():
    m = mem(size=4)
    assert m.find_slot(ub(([0], 0, 2), ([1], 0, 2)))
    # a token of seqs {0, 1}: seq 1 gives up its own cell and shares seq 0's
    assert m.find_slot(ub(([0, 1], 2, 1)))
    assert m.cells[0].seq_id == {0, 1} and m.cells[1].is_empty()
    assert m.cells[0].tail == 0 and m.cells[1].tail == 0 and m.used == 1


def test_seq_rm_frees_and_moves_head():
    m = mem(size=4)
    assert m.find_slot(ub(([0], 0, 1), ([1], 0, 1), ([2], 0, 1)))
    m.head = 2
    assert m.seq_rm(1, -1, -1)
    assert m.cells[1].is_empty() and m.cells[1].tail == -1 and m.used == 2 and m.head == 1
    assert m.seq_rm(-1, -1, -1)                              # everything
    assert m.used_cells() == [] and m.used == 0 and m.head == 0
    assert all(c.tail == -1 for c in m.cells)
    assert not m.seq_rm(-1, 1, 3) and "negative seq" in m.last_refusal
    assert not m.seq_rm(9, -1, -1) and "n_seq_max" in m.last_refusal


def test_prepare_is_a_dry_run():
    m = mem(size=2)
    assert m.find_slot(ub(([0], 0, 1)))
    before = state(m)
    assert m.prepare([ub(([1], 0, 2)), ub(([1], 2, 2))])
    assert state(m) == before
    assert not m.prepare([ub(([0], 1, 1), ([1], 0, 1), ([1 + 1], 0, 1))])
    assert state(m) == before and m.last_refusal


# -- s_copy and rollback ------------------------------------------------------------------------------
def decode(m, seq, p0, n):
    """find_slot and consume the inputs, as a decode step would."""
    assert m.find_slot(ub(([seq], p0, n)))
    return list(m.s_copy_all())


def test_s_copy_with_and_without_pending_rollback():
    m = mem(size=2, n_rs_seq=3)
    assert decode(m, 0, 0, 5) == [0]
    assert decode(m, 1, 0, 5) == [1]
    assert m.rollback(0, 2)
    assert m.rs_idx[0] == 2 and m.seq_pos_max(0) == 2 and m.last_refusal is None
    assert m.find_slot(ub(([0], 3, 1)))
    assert m.s_copy(0) == 2 * 2 + 0                          # k*size + src0: plane 2 of cell 0
    assert m.rs_idx[0] == 0 and m.s_copy(0) == 0             # consumed
    # n_rs_seq == 0: plain src0
    m0 = mem(size=2)
    decode(m0, 1, 0, 2)
    assert m0.s_copy(0) == 0


def test_rollback_refusals_change_nothing():
    m = mem(size=2, n_rs_seq=3)
    decode(m, 0, 0, 3)
    decode(m, 0, 3, 2)                                       # n_last = 2: only planes 0, 1 written
    decode(m, 1, 0, 6)
    for seq, k, rule in [(0, 0, "k >= 1"), (0, 2, "k < n_last"), (0, 3, "k < n_last"),
                         (1, 4, "k <= n_rs_seq"), (1, 6, "whole sequence"), (3, 1, "no state")]:
        before = state(m)
        assert not m.rollback(seq, k)
        assert rule in m.last_refusal, m.last_refusal
        assert state(m) == before
    assert m.rollback(0, 1) and m.seq_pos_max(0) == 3        # k = 1 < n_last = 2
    before = state(m)
    assert not m.rollback(0, 1)                              # one already pending
    assert "single pending rollback" in m.last_refusal and state(m) == before
    # the same rules through seq_rm
    assert not m.seq_rm(1, 1, -1) and "k <= n_rs_seq" in m.last_refusal    # k = 5
    assert m.seq_rm(1, 3, -1) and m.rs_idx[1] == 3 and m.seq_pos_max(1) == 2


def test_rollback_after_consumption():
    m = mem(size=3, n_rs_seq=2)
    decode(m, 0, 0, 4)
    assert m.rollback(0, 2)
    assert decode(m, 0, 2, 1) == [2 * 3 + 0]                 # consumes plane 2
    assert not m.rollback(0, 1) and "k < n_last" in m.last_refusal   # n_last = 1 now
    decode(m, 0, 3, 3)
    assert m.rollback(0, 2) and m.seq_pos_max(0) == 3


def test_pending_rollback_of_a_moved_sequence():
    # seq 1 -> cell 0, seq 0 -> cell 1, seq 2 -> cell 2; seq 0 has a rollback pending
    m = mem(size=3, n_rs_seq=2)
    decode(m, 1, 0, 3)
    decode(m, 0, 0, 3)
    decode(m, 2, 0, 3)
    assert m.rollback(0, 1) and m.n_last[0] == 3
    # a ubatch of seqs 1 and 2 swaps seq 0 out of the way: only its plane-0 row follows it
    assert m.find_slot(ub(([1], 3, 1), ([2], 3, 1)))
    assert m.cells[0].tail == 2 and m.cells[2].src0 == 1 and m.n_last[0] == 0
    assert list(m.s_copy_all()) == [0, 2, 1 * 3 + 1]        # plane 1 of seq 0's old cell
    assert m.rs_idx[0] == 0 and m.seq_pos_max(0) == 1
    assert not m.rollback(0, 1) and "k < n_last" in m.last_refusal


def test_pending_rollback_consumed_in_place_by_another_ubatch():
    # seq 1 -> cell 0, seq 3 -> cell 1, seq 0 -> cell 2, seq 2 -> cell 3; then cell 1 is freed
    m = mem(size=4, n_rs_seq=2)
    for seq in (1, 3, 0, 2):
        decode(m, seq, 0, 3)
    assert m.seq_rm(3, -1, -1)
    assert m.rollback(0, 1)
    # seqs 1 and 2: range [0, 3]; seq 0 stays in cell 2 but its row is re-gathered from plane 1
    assert m.find_slot(ub(([1], 3, 1), ([2], 3, 1)))
    assert (m.head, m.n, m.rs_z) == (0, 4, 1)
    assert m.n_last[0] == 3                                  # not moved (yet)
    assert list(m.s_copy_all()) == [0, 3, 1 * 4 + 2, 1]
    assert m.rs_idx[0] == 0 and m.n_last[0] == 0             # older planes now stale
    assert not m.rollback(0, 1)


def test_seq_rm_full_removal_resets_rollback():
    m = mem(size=2, n_rs_seq=2)
    decode(m, 0, 0, 3)
    assert m.rollback(0, 1) and m.rs_idx[0] == 1
    assert m.seq_rm(0, -1, -1)
    assert m.rs_idx[0] == 0 and m.n_last[0] == 0 and m.cells[0].tail == -1


def test_rollback_on_memory_without_layers_just_moves_pos():
    m = RecurrentMemory([], 4, 4, 2, 3, REF)
    assert m.find_slot(ub(([0], 0, 4)))
    assert m.seq_rm(0, 2, -1) and m.seq_pos_max(0) == 1 and m.rs_idx[0] == 0


# -- other sequence operations -------------------------------------------------------------------------
def test_seq_keep():
    m = mem(size=4, n_rs_seq=1)
    assert m.find_slot(ub(([0], 0, 2), ([1], 0, 2), ([2], 0, 2)))
    m.seq_cp(1, 3)
    assert m.rollback(2, 1)
    m.seq_keep(1)
    assert m.used_cells() == [1] and m.cells[1].seq_id == {1} and m.used == 1
    assert [c.tail for c in m.cells] == [-1, 1, -1, -1]
    assert m.rs_idx == [0, 0, 0, 0] and m.head == 0


def test_seq_add_and_div():
    m = mem(size=2)
    assert m.find_slot(ub(([0], 0, 5)))
    m.seq_add(0, 0, 3, 10)                                   # pos 4 not in [0, 3): unchanged
    assert m.seq_pos_max(0) == 4
    m.seq_add(0, 2, -1, 10)
    assert m.seq_pos_max(0) == 14
    m.seq_add(0, -1, -1, -4)
    assert m.seq_pos_max(0) == 10
    m.seq_div(0, -1, -1, 3)
    assert m.seq_pos_max(0) == 3
    m.seq_add(1, -1, -1, 5)                                  # no such seq: nothing
    assert m.seq_pos_max(1) == -1


def test_init_batch_and_full_context():
    m = mem(size=2, n_rs_seq=2)
    b = Batch.from_seqs({0: list(range(7)), 1: [1, 2]})
    ctx = m.init_batch(BatchAllocr(b), 4)
    assert ctx.ok and state(m)[3] == 0                        # nothing placed yet (dry run)
    # 2+2 (seq 1 finished); seq 0 alone: 4 would leave 1 < 3 -> 2, then its last 3 together
    assert [(u.seq_id_unq, u.n_seq_tokens) for u in ctx.ubatches] == [([0, 1], 2), ([0], 2), ([0], 3)]
    assert ctx.apply() and m.used == 2 and ctx.next() and ctx.get_ubatch() is ctx.ubatches[1]
    full = m.init_full()
    assert (full.get_head(), full.get_n_rs(), full.get_rs_z(), full.get_size()) == (0, 2, 0, 2)
    big = Batch.from_seqs({0: [1], 1: [1], 2: [1]})
    bad = m.init_batch(BatchAllocr(big), 4)
    assert not bad.ok and "seq_id 2" in bad.reason


# -- snapshot / restore --------------------------------------------------------------------------------
def test_snapshot_restore_round_trip():
    m = RecurrentMemory([0, 2], 5, lambda il: 3 if il == 0 else 0, 3, 2, REF)
    fill_random(m, 1)
    decode(m, 0, 0, 4)
    assert m.rollback(0, 1)
    before = state(m)
    data = {t.name: t.numpy() for t in m.tensors()}
    snap = m.snapshot()
    # a step that is then undone: metadata and bytes change
    decode(m, 1, 0, 2)
    m.s_copy(0)
    fill_random(m, 2)
    assert state(m) != before
    m.restore(snap)
    assert state(m) == before
    for t in m.tensors():
        assert np.array_equal(t.numpy(), data[t.name]) and np.any(data[t.name] != 0)
    m.restore(snap)                                          # a snapshot can be restored twice
    assert state(m) == before
    other = mem(size=3, n_rs_seq=2)
    with pytest.raises(ValueError, match="other tensors"):
        other.restore(snap)


def test_rows_written_by_a_ubatch():
    """The rows a ubatch's graph may write: plane 0 of the whole range [head, head+n) (zero row,
    tail copies) and planes 0..min(n_seq_tokens, K)-1 of its own cells; adjacent spans merge."""
    m = mem(size=4, n_rs_seq=2)
    with pytest.raises(ValueError, match="after a successful find_slot"):
        m.rows_written_by(ub(([0], 0, 1)))
    u = ub(([0], 0, 3), ([1], 0, 3))
    assert m.find_slot(u) and (m.head, m.n) == (0, 2)
    assert m.rows_written_by(u) == [(0, 2), (4, 2), (8, 2)]        # planes 0, 1, 2 of cells 0, 1
    u = ub(([0], 3, 1), ([1], 3, 1))
    assert m.find_slot(u) and m.rows_written_by(u) == [(0, 2)]     # one token: plane 0 only
    u = ub(([1], 4, 2))
    assert m.find_slot(u) and m.head == 1 and m.rows_written_by(u) == [(1, 1), (5, 1)]
    full = mem(size=2, n_rs_seq=2)
    live = full.live_cells()
    u = ub(([0], 0, 4), ([1], 0, 4))
    assert full.find_slot(u) and full.rows_written_by(u) == [(0, 6)]    # the planes touch: one span
    # only the rows of the cells that held a sequence before: none, then cell 1's planes
    assert live == frozenset() and full.rows_written_by(u, live) == []
    assert full.live_cells() == {0, 1} and full.rows_written_by(u, frozenset({1})) == [(1, 1), (3, 1), (5, 1)]
    t = full.tensors()[0]
    raw = np.arange(2 * t.nb[1], dtype=np.int64).astype(np.uint8)
    full.write_row_bytes(t, 3, raw)
    assert np.array_equal(full.read_row_bytes(t, 3, 2), raw)


# -- state save / load ---------------------------------------------------------------------------------
def two_layer(size=3, n_rs_seq=2):
    return RecurrentMemory([0, 3], lambda il: 4 + il, lambda il: 6 if il == 0 else 2, size, n_rs_seq, REF)


def test_state_write_read_with_pending_rollback(tmp_path):
    a = two_layer()
    fill_random(a, 3)
    decode(a, 0, 0, 2)
    decode(a, 1, 0, 5)                                       # seq 1 lives in cell 1
    assert a.rollback(1, 2) and a.rs_idx[1] == 2
    cell = a.cells[1].tail
    want = {t.name: a.read_rows(t, a.row_index(cell, plane=2))[0] for t in a.tensors()}
    path = tmp_path / "seq1.npz"
    assert a.state_write(1, path) == 1

    b = two_layer()
    fill_random(b, 4)
    decode(b, 0, 0, 1)                                       # cell 0 taken by another sequence
    assert b.state_read(1, path) == 1
    c = b.cells[1].tail
    assert c == 1 and b.cells[c].pos == 2 and b.cells[c].seq_id == {1} and b.cells[c].src == c
    assert b.rs_idx[1] == 0 and b.n_last[1] == 0
    for t in b.tensors():                                    # plane 0 holds the rolled-back state
        assert np.array_equal(b.read_rows(t, b.row_index(c, 0))[0], want[t.name])
    assert not b.rollback(1, 1) and "k < n_last" in b.last_refusal
    assert b.find_slot(ub(([1], 3, 1))) and b.s_copy(0) == c  # continues from the restored row


def test_state_whole_memory_round_trip(tmp_path):
    a = two_layer(size=4)
    fill_random(a, 5)
    decode(a, 0, 0, 3)
    decode(a, 2, 0, 3)
    a.seq_cp(2, 3)
    assert a.rollback(0, 1)
    rows = {}
    for s in (0, 2):
        i = a.cells[s].tail
        rows[s] = {t.name: a.read_rows(t, a.row_index(i, a.rs_idx[s]))[0] for t in a.tensors()}
    p = tmp_path / "all.npz"
    assert a.state_write(-1, p) == 2
    b = two_layer(size=4)
    fill_random(b, 6)
    assert b.state_read(-1, p) == 2
    assert b.used == 2 and b.cells[0].seq_id == {0} and b.cells[1].seq_id == {2, 3}
    assert [b.cells[s].tail for s in range(4)] == [0, -1, 1, 1]
    assert b.seq_pos_max(0) == 1 and b.seq_pos_max(3) == 2 and b.rs_idx == [0, 0, 0, 0]
    for s, i in ((0, 0), (2, 1)):
        for t in b.tensors():
            assert np.array_equal(b.read_rows(t, i)[0], rows[s][t.name])
    # a single-seq file is not a whole-memory dump
    a.state_write(0, tmp_path / "one.npz")
    with pytest.raises(StateFileError, match="single sequence"):
        b.state_read(-1, tmp_path / "one.npz")


def test_state_read_validates(tmp_path):
    a = two_layer()
    fill_random(a, 7)
    decode(a, 0, 0, 2)
    p = tmp_path / "s.npz"
    a.state_write(0, p)
    b = RecurrentMemory([0], 4, 6, 3, 2, REF)
    before = state(b)
    with pytest.raises(StateFileError, match="mismatched layers"):
        b.state_read(0, p)
    c = RecurrentMemory([0, 3], 4, 6, 3, 2, REF)             # layer 3's r row is 7 wide in the file
    with pytest.raises(StateFileError, match="r row size in layer 3"):
        c.state_read(0, p)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a state")
    with pytest.raises(StateFileError, match="not a readable state file"):
        b.state_read(0, junk)
    assert state(b) == before
    with pytest.raises(ValueError, match="n_seq_max"):
        two_layer(size=1).state_read(1, p)
    # the wrong format / version
    np.savez(tmp_path / "other.npz", header=np.array('{"format": "x"}'))
    with pytest.raises(StateFileError, match="not a recurrent state file"):
        b.state_read(0, tmp_path / "other.npz")
    assert state(b) == before


def test_str_shows_cells():
    m = mem(size=2, n_rs_seq=1)
    decode(m, 0, 0, 2)
    assert m.rollback(0, 1)
    s = str(m)
    assert "cell" in s and "pending rollbacks: {0: 1}" in s and "n_last: {0: 2}" in s


# -- random operation sequences keep the metadata consistent ---------------------------------------
from hypothesis import given, strategies as st  # noqa: E402


def check_invariants(m):
    size = m.size
    holders = {}
    for i, c in enumerate(m.cells):
        if c.is_empty():
            assert c.pos == -1, (i, str(m))
        for s in c.seq_id:
            assert s not in holders, f"seq {s} in cells {holders[s]} and {i}\n{m}"
            holders[s] = i
        # the sequences of a cell share its pending rollback
        assert len({m.rs_idx[s] for s in c.seq_id}) <= 1, str(m)
    for s in range(size):
        assert m.cells[s].tail == holders.get(s, -1), f"tail of seq {s}\n{m}"
        if m.cells[s].tail < 0:
            assert m.rs_idx[s] == 0 and m.n_last[s] == 0, f"seq {s} without state\n{m}"
        assert 0 <= m.rs_idx[s] <= m.n_rs_seq
    assert m.used == len(m.used_cells())


ops = st.lists(st.one_of(
    st.tuples(st.just("decode"), st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True),
              st.integers(1, 4)),
    st.tuples(st.just("shared"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("rollback"), st.integers(0, 3), st.integers(0, 4)),
    st.tuples(st.just("rm"), st.integers(-1, 3), st.integers(-1, 4)),
    st.tuples(st.just("cp"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("keep"), st.integers(0, 3)),
), max_size=25)


@given(ops=ops)
def test_random_operations_keep_metadata_consistent(ops):
    m = mem(size=4, n_rs_seq=2, r=2, s=2)
    for op in ops:
        before = state(m)
        kind = op[0]
        if kind == "decode":
            seqs, n = op[1], op[2]
            u = ub(*[([s], m.seq_pos_max(s) + 1, n) for s in seqs])
            fits = m.prepare([u])
            assert state(m) == before                 # a dry run
            assert m.find_slot(u) == fits
            if fits:
                # ubatch seq s lives at cell head + s; its snapshots count n tokens
                assert [m.cells[s].tail for s in seqs] == list(range(m.head, m.head + len(seqs)))
                assert all(m.n_last[s] == n for s in seqs)
                pending = [m.rs_idx[s] for s in seqs]
                src0 = [m.cells[m.head + i].src0 for i in range(len(seqs))]
                got = list(m.s_copy_all())
                assert got[:len(seqs)] == [k * m.size + c for k, c in zip(pending, src0)]
                in_range = {q for c in m.cells[m.head:m.head + m.n] for q in c.seq_id}
                assert all(m.rs_idx[q] == 0 for q in in_range)   # pending rollbacks consumed
            else:
                assert state(m) == before
        elif kind == "shared":                     # a token in two sequences
            a, b = op[1], op[2]
            if a != b:
                p = max(m.seq_pos_max(a), m.seq_pos_max(b)) + 1
                if m.find_slot(ub(([a, b], p, 1))):
                    assert m.cells[a].tail == m.cells[b].tail
        elif kind == "rollback":
            s, k = op[1], op[2]
            pend = m.rs_idx[s]
            if m.rollback(s, k):
                assert 1 <= k <= m.n_rs_seq and k < before[6][s] and pend == 0
                assert m.rs_idx[s] == k
            else:
                assert state(m) == before and m.last_refusal
        elif kind == "rm":
            s, p0 = op[1], op[2]
            ok = m.seq_rm(s, p0, -1)
            if not ok:
                assert state(m) == before
        elif kind == "cp":
            m.seq_cp(op[1], op[2])
        elif kind == "keep":
            m.seq_keep(op[1])
        check_invariants(m)


def test_init_batch_failures_are_reported():
    m = mem(size=2, n_rs_seq=2)
    coupled = Batch([1, 2], [0, 1], [[0, 1], [0, 1]])
    ctx = m.init_batch(BatchAllocr(coupled), 4)
    assert not ctx.ok and "coupled" in ctx.reason
    ctx = m.init_batch(BatchAllocr(Batch([1, 2, 3])), 3)     # n_ubatch 3 <= n_keep_tail 3
    assert not ctx.ok and "n_keep_tail" in ctx.reason
