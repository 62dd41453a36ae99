"""FLASH_ATTN_EXT and ROPE beyond the op table: the meta backend's split rules (which splits
run per device, which are refused), and flash attention's batch invariance (a query row's
result is bit-identical whatever other rows are in the batch, any thread count)."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph.backends.meta.split_state import AXIS_0, AXIS_1, AXIS_2, MIRRORED, SPLIT_RULES, SplitState, _Fail
from minigraph.testing.op_cases import Built, run_built
from minigraph.tensor import Context

M = SplitState.mirrored()


def _fa_nodes(n_head=4, n_kv_head=2, mask_heads=1):
    ctx = Context()
    q = ctx.new_tensor_3d(mg.f32, 8, 3, n_head)
    k, v = ctx.new_tensor_3d(mg.f32, 8, 6, n_kv_head), ctx.new_tensor_3d(mg.f32, 8, 6, n_kv_head)
    mask = ctx.new_tensor_3d(mg.f16, 6, 3, mask_heads)
    return mg.flash_attn_ext(q, k, v, mask, 0.3), [q, k, v, mask]


def test_flash_attn_split_along_heads_keeps_whole_kv_groups():
    t, srcs = _fa_nodes()
    rule = SPLIT_RULES["flash_attn_ext"]
    st, _ = rule(t, srcs, [SplitState.split(AXIS_2, (2, 2)), SplitState.split(AXIS_2, (1, 1)),
                           SplitState.split(AXIS_2, (1, 1)), M], 2, False)
    assert st.axis == AXIS_1 and st.shares() == (2, 2)   # the result's heads are its dim 1
    assert rule(t, srcs, [M, M, M, M], 2, False)[0].axis == MIRRORED
    with pytest.raises(_Fail, match="each device holding"):   # KV heads not split with their q heads
        rule(t, srcs, [SplitState.split(AXIS_2, (2, 2)), M, M, M], 2, False)
    with pytest.raises(_Fail, match="must be split along its heads"):
        rule(t, srcs, [SplitState.split(AXIS_1, (1, 2)), M, M, M], 2, False)
    t, srcs = _fa_nodes(mask_heads=4)
    with pytest.raises(_Fail, match="mask"):                  # a per-head mask MIRRORED: wrong heads
        rule(t, srcs, [SplitState.split(AXIS_2, (2, 2)), SplitState.split(AXIS_2, (1, 1)),
                       SplitState.split(AXIS_2, (1, 1)), M], 2, False)


def test_rope_split_on_heads_only_with_mirrored_positions():
    ctx = Context()
    a, pos = ctx.new_tensor_3d(mg.f32, 8, 4, 3), ctx.new_tensor_1d(mg.i32, 3)
    t = mg.rope(a, pos, 8, 2)
    rule = SPLIT_RULES["rope"]
    assert rule(t, [a, pos, None], [SplitState.split(AXIS_1, (2, 2)), M, None], 2, False)[0].shares() == (2, 2)
    with pytest.raises(_Fail, match="tokens"):
        rule(t, [a, pos, None], [SplitState.split(AXIS_2, (1, 2)), M, None], 2, False)
    with pytest.raises(_Fail, match="rows would be cut"):
        rule(t, [a, pos, None], [SplitState.split(AXIS_0, (4, 4)), M, None], 2, False)
    with pytest.raises(_Fail, match="MIRRORED"):
        rule(t, [a, pos, None], [SplitState.split(AXIS_1, (2, 2)), SplitState.split(AXIS_0, (1, 2)), None], 2, False)


cpu = pytest.importorskip("minigraph.backends.cpu")


@pytest.mark.skipif(cpu.lib is None, reason="cpu extension not built")
def test_flash_attn_query_row_is_independent_of_the_batch():
    rng = np.random.default_rng(5)
    D, n_kv, n_head, n_q = 24, 11, 4, 7
    q_all = rng.uniform(-1, 1, (n_head, n_q, D)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, n_kv, D)).astype(np.float32)
    v = rng.uniform(-1, 1, (2, n_kv, D)).astype(np.float32)
    mask_all = np.where(np.arange(n_kv)[None, :] > np.arange(n_q)[:, None] + n_kv - n_q, -np.inf,
                        rng.uniform(-1, 1, (n_q, n_kv))).astype(np.float16)

    def fa(rows, n_threads):
        b = Built(Context())
        q = b.leaf(mg.f32, (D, len(rows), n_head), data=q_all[:, rows])
        kk, vv = b.leaf(mg.f32, (D, n_kv, 2), data=k), b.leaf(mg.f32, (D, n_kv, 2), data=v)
        m = b.leaf(mg.f16, (n_kv, len(rows)), data=mask_all[rows])
        b.out(mg.flash_attn_ext(q, kk, vv, m, 0.2))
        be = cpu.CpuBackend(400 + n_threads).set_n_threads(n_threads)
        return run_built(b, be)[0].reshape(len(rows), n_head, D)
    alone = [fa([r], 1)[0] for r in range(n_q)]
    for n_threads in (1, 2):
        for rows in (list(range(n_q)), [3, 1, 6], [5]):
            got = fa(rows, n_threads)
            for i, r in enumerate(rows):
                assert np.array_equal(got[i], alone[r]), (rows, r, n_threads)
