"""The KV cache on its own: cells and find_slot, refusals that change nothing, the kq mask,
K/V stored through set_rows (V transposed), the sequence operations with llama.cpp's semantics,
state save/load, and the attention input's reuse verdicts."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.models.attn_inputs import InputAttnKV, kq_mask_values
from minigraph.models.batch import Ubatch
from minigraph.models.graph import GraphParams
from minigraph.models.kv_cache import GGML_KQ_MASK_PAD, KVCache, pad_to
from minigraph.models.memory import StateFileError


def kv(size=8, n_seq_max=4, n_pad=4, layers=(1,), n_embd=4):
    return KVCache(list(layers), n_embd, n_embd, size, mg.backend("cpu"), n_seq_max=n_seq_max, n_pad=n_pad)


def ub(*sets):
    """ub(([seq], [pos...]), ...): an equal ubatch."""
    return Ubatch.from_seq_sets(list(sets))


def meta(c):
    return (list(c.cells.pos), [sorted(s) for s in c.cells.seq], c.head)


def test_find_slot_places_tokens_and_pads_n_kv():
    c = kv()
    assert c.place(ub(([0], [0, 1, 2])))
    assert c.idxs == [0, 1, 2] and c.head == 3
    assert c.cells.pos[:3] == [0, 1, 2] and c.n_kv == 4          # used 3 -> padded to n_pad 4
    assert c.place(ub(([1], [0, 1])))
    assert c.idxs == [3, 4] and c.n_kv == 8


def test_find_slot_non_contiguous_fills_holes_and_contiguous_skips_them():
    c = kv()
    c.place(ub(([0], [0, 1, 2, 3])))
    c.seq_rm(0, 1, 2)                                             # a hole at cell 1; head moves back
    assert c.head == 1
    assert c.find_slot(ub(([1], [0, 1]))) == [1, 4]
    assert c.find_slot(ub(([1], [0, 1])), cont=True) == [4, 5]


def test_refused_ubatch_changes_nothing():
    c = kv(size=4)
    c.place(ub(([0], [0, 1, 2])))
    before = meta(c)
    assert not c.place(ub(([1], [0, 1])))
    assert "no 2 free cells" in c.last_refusal and meta(c) == before
    assert not c.place(ub(([0], list(range(5)))))
    assert "n_tokens 5 > kv_size 4" in c.last_refusal and meta(c) == before
    assert not c.prepare([ub(([1], [0])), ub(([2], [0]))]) and meta(c) == before


def test_kq_mask_hides_other_sequences_future_positions_and_empty_cells():
    c = kv()
    u = ub(([0], [0, 1]), ([1], [0, 1]))
    c.place(u)
    rows = pad_to(u.n_tokens, GGML_KQ_MASK_PAD)
    m = kq_mask_values(c, u, c.n_kv, rows)
    assert m.shape == (rows, 4)
    seen = m[:4] == 0
    assert seen.tolist() == [[True, False, False, False], [True, True, False, False],
                             [False, False, True, False], [False, False, True, True]]
    assert np.all(np.isneginf(m[4:]))                             # padded rows see nothing
    assert np.all(kq_mask_values(c, u, c.n_kv, rows, causal=False)[:2, :2] == 0)


def test_seq_ops_follow_llama_cpp():
    c = kv()
    c.place(ub(([0], [0, 1, 2, 3])))
    c.seq_cp(0, 1, 1, 3)                                          # cells of positions 1, 2 shared
    assert [sorted(s) for s in c.cells.seq[:4]] == [[0], [0, 1], [0, 1], [0]]
    c.seq_rm(0, 2, -1)                                            # cell 2 keeps seq 1, cell 3 freed
    assert c.cells.pos[:4] == [0, 1, 2, -1] and c.seq_pos_max(0) == 1 and c.seq_pos_max(1) == 2
    c.seq_add(1, 0, -1, 5)
    assert c.cells.pos[:3] == [0, 6, 7] and c.cells.shift[1:3] == [5, 5] and c.cells.has_shift
    c.seq_add(1, 0, -1, -7)                                       # position 6 -> -1: cell 1 loses it
    assert c.cells.pos[1] == -1 and c.cells.pos[2] == 0
    c.seq_div(1, 0, -1, 2)
    assert c.cells.pos[2] == 0
    c.place(ub(([2], [0, 1])))
    c.seq_keep(2)
    assert [p >= 0 for p in c.cells.pos] == [False, True, False, True, False, False, False, False]
    c.seq_rm(-1, -1, -1)
    assert c.cells.used() == 0 and c.head == 0


def test_seq_div_rejects_a_zero_divisor():
    with pytest.raises(ValueError, match="seq 0: divisor 0"):
        kv().seq_div(0, 0, -1, 0)


def _fill(c, il=1):
    k = np.arange(c.size * 4, dtype=np.float32).reshape(c.size, 4)
    c.write_cells(il, list(range(c.size)), k, -k)
    return k


def test_v_is_stored_transposed():
    c = kv()
    k = _fill(c)
    assert np.array_equal(c.v_l[1].numpy().reshape(4, c.size), -k.T)
    assert np.array_equal(c.v_rows(1, [2, 5]), -k[[2, 5]])


def test_state_round_trip_of_one_sequence_and_refusals():
    c = kv()
    c.place(ub(([0], [0, 1, 2])))
    c.place(ub(([1], [0, 1])))
    k = _fill(c)
    blob = c.state_write(1)
    d = kv()
    d.place(ub(([2], [0])))
    assert d.state_read(1, blob) == 2
    assert d.seq_pos_max(1) == 1 and d.idxs == [1, 2]
    assert np.array_equal(d.k_rows(1, [1, 2]), k[[3, 4]]) and np.array_equal(d.v_rows(1, [1, 2]), -k[[3, 4]])
    whole = kv()
    assert whole.state_read(-1, c.state_write(-1)) == 5
    cells = sorted((p, sorted(s)) for p, s in zip(whole.cells.pos, whole.cells.seq) if p >= 0)
    assert cells == [(0, [0]), (0, [1]), (1, [0]), (1, [1]), (2, [0])]
    small = kv(size=1)
    before = meta(small)
    with pytest.raises(StateFileError, match="do not fit"):
        small.state_read(1, blob)
    assert meta(small) == before
    with pytest.raises(StateFileError, match="layers"):
        kv(layers=(3,)).state_read(1, blob)
    with pytest.raises(StateFileError, match="bad magic"):
        kv().state_read(1, b"nope")


def test_layers_may_differ_in_v_width_and_k_only_layers_have_no_v():
    c = KVCache([0, 1, 2], lambda il: 4 + il, lambda il: [4, 6, 0][il], 8, mg.backend("cpu"))
    assert c.v_widths == [4, 6] and c.v_l[2] is None
    assert [t.ne[:2] for t in c.tensors()] == [(4, 8), (4, 8), (5, 8), (6, 8), (6, 8)]
    u = ub(([0], [0, 1]))
    c.place(u)
    k, v = np.arange(6, dtype=np.float32).reshape(2, 3) + 1, np.ones((2, 6), np.float32)
    c.write_cells(1, c.idxs, np.tile(k, 2)[:, :5], v)
    assert np.array_equal(c.v_rows(1, c.idxs), v) and c.v_rows(2, c.idxs).shape == (2, 0)
    back = KVCache([0, 1, 2], lambda il: 4 + il, lambda il: [4, 6, 0][il], 8, mg.backend("cpu"))
    assert back.state_read(-1, c.state_write()) == 2
    assert np.array_equal(back.k_rows(1, c.idxs), c.k_rows(1, c.idxs))


class _Mem:
    def __init__(self, kv):
        self.kv = kv


def test_attn_input_reuse_verdict_names_the_rule():
    c = kv(size=16)
    u = ub(([0], [0, 1]))
    c.place(u)
    ctx = mg.Context()
    inp = InputAttnKV(c, ctx.new_tensor_1d(mg.i64, 2), {c.n_embd_v_max: ctx.new_tensor_1d(mg.i64, 2 * c.n_embd_v_max)},
                      ctx.new_tensor_2d(mg.f32, c.n_kv, pad_to(2, GGML_KQ_MASK_PAD)), True)
    params = lambda u: GraphParams("x", u, _Mem(c), 0, "per-layer", u.n_tokens)
    assert inp.can_reuse(params(u))
    u2 = ub(([0], [2, 3, 4]))
    c.place(u2)
    v = inp.can_reuse(params(u2))
    assert not v and v.reason == "k_idxs (n_tokens): 2 -> 3"
    u3 = ub(([0], [5, 6]))
    c.place(u3)
    v = inp.can_reuse(params(u3))
    assert not v and v.reason == "kq_mask (n_kv): 4 -> 8"


def test_cells_counts_agree_with_a_plain_scan():
    """used, used_max_p1 and seq_pos (scanned in blocks at C speed, up to the highest cell ever
    placed) against a cell-by-cell scan, with the highest used cell on and around block edges, a
    stray negative position, and cells freed again (the bound stays where it was)."""
    from minigraph.models.kv_cache import KVCells
    rng = np.random.default_rng(0)
    for size in (1, 63, 64, 65, 200):
        for top in sorted({0, size // 2, size - 1, min(63, size - 1), min(64, size - 1)}):
            c = KVCells(size)
            for i in rng.choice(top + 1, size=min(top + 1, 5), replace=False):
                c.place(int(i), int(rng.integers(0, 100)), frozenset({int(i) % 2}))
            c.place(top, 7, frozenset({1}))
            if size > 2 and top > 0:
                c.pos[0] = -5                           # negative: not used, but it names seq 1
                c.place(size - 1, -3, frozenset({1}))
            if size > 2 and top > 1:
                c.free(top)                             # the highest used cell freed again
            assert c.copy().hi == c.hi >= max((i + 1 for i, q in enumerate(c.seq) if q), default=0)
            assert c.used() == sum(1 for p in c.pos if p >= 0)
            assert c.used_max_p1() == max((i + 1 for i, p in enumerate(c.pos) if p >= 0), default=0)
            for s in (0, 1):
                assert c.seq_pos(s) == [p for p, q in zip(c.pos, c.seq) if s in q]
    assert KVCells(100).used_max_p1() == 0 and KVCells(100).used() == 0


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("causal", [True, False])
def test_the_list_mask_equals_the_numpy_mask(seed, causal):
    # decode steps take kq_mask_list, larger ubatches kq_mask_values: the same mask, bit for bit,
    # on caches with empty cells, cells of several sequences, negative positions and cells past
    # the used ones; tokens of several sequences, padded rows
    from minigraph.models.attn_inputs import kq_mask_list
    rng = np.random.default_rng(seed)
    c = kv(size=64, n_pad=16)
    for _ in range(int(rng.integers(1, 40))):
        seqs = rng.choice(4, int(rng.integers(1, 3)), replace=False)
        c.cells.place(int(rng.integers(0, 48)), int(rng.integers(-1, 30)), frozenset(int(q) for q in seqs))
    n_seq_tokens = int(rng.integers(1, 3))
    u = ub(*[([int(q)], rng.integers(0, 32, n_seq_tokens).tolist()) for q in rng.choice(4, 2, replace=False)])
    for n_kv in (16, 48, 64):
        want = kq_mask_values(c, u, n_kv, u.n_tokens + 1, causal)
        got = np.asarray(kq_mask_list(c, u, n_kv, u.n_tokens + 1, causal), np.float32).reshape(want.shape)
        assert got.tobytes() == want.tobytes()
