"""ROPE beyond the op table: a token's rows are bit-identical whatever else is in the batch (the
cpu kernel builds a row's angles from its own position, shared by the heads of a token), the
reference agrees with a plain float64 rotation written from the formula, and ggml's asserts are
OpErrors."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import Built, run_built
from minigraph.tensor import Context

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)

N0, N_HEAD, T_ALL = 48, 3, 9
MODES = [(0, None), (2, None), (8, [6, 5, 5, 2]), (40, [6, 5, 5, 2])]


def _rope(x, pos, mode, sections, be, yarn=False):
    """rope of x [T, n_head, n0] at positions pos ([T], or [4, T] for multi): [T, n_head, n0]."""
    b = Built(Context())
    a = b.leaf(mg.f32, (x.shape[2], x.shape[1], x.shape[0]), data=x)
    p = b.leaf(mg.i32, (pos.size,), data=pos.reshape(-1))
    fl = (4096, 10000.0, 0.5 if yarn else 1.0, 1.0 if yarn else 0.0, 1.0, 32.0, 1.0)
    if sections is None:
        b.out(mg.rope_ext(a, p, None, 40, mode, *fl))
    else:
        b.out(mg.rope_multi(a, p, None, 40, sections, mode, *fl))
    return run_built(b, be)[0].reshape(x.shape)


@pytest.mark.parametrize("mode,sections", MODES, ids=lambda m: str(m))
def test_rope_token_is_independent_of_the_batch(mode, sections):
    rng = np.random.default_rng(mode)
    x = rng.uniform(-1, 1, (T_ALL, N_HEAD, N0)).astype(np.float32)
    n_streams = 1 if sections is None else 4
    pos = rng.integers(0, 5000, (n_streams, T_ALL)).astype(np.int32)
    one = cpu.CpuBackend(300).set_n_threads(1)
    alone = [_rope(x[t:t + 1], pos[:, t:t + 1], mode, sections, one, yarn=True)[0] for t in range(T_ALL)]
    for n_threads in (1, 2):
        be = cpu.CpuBackend(300 + n_threads).set_n_threads(n_threads)
        for t0, T in ((0, T_ALL), (2, 5), (4, 1)):
            got = _rope(x[t0:t0 + T], pos[:, t0:t0 + T], mode, sections, be, yarn=True)
            for t in range(T):
                assert np.array_equal(got[t], alone[t0 + t]), (mode, t0, T, t, n_threads)


def _formula(x, pos, mode, sections, n_dims, base):
    """float64 rope from the formula: pair k turns by pos * base^(-2k/n_dims); NORMAL pairs
    (2k, 2k+1), the others (k, k + n_dims/2); multi modes pick pair k's position stream."""
    half = n_dims // 2
    out = x.astype(np.float64).copy()
    for k in range(half):
        if sections is None:
            s = 0
        else:
            r = k % sum(sections)
            if mode == 40:
                s = next((i for i in (1, 2, 0) if r % 3 == i % 3 and r < 3 * sections[i]), 3)
            else:
                s = int(np.searchsorted(np.cumsum(sections), r, side="right"))
        th = pos[s].astype(np.float64)[:, None] * base ** (-2.0 * k / n_dims)
        i0, i1 = (2 * k, 2 * k + 1) if mode == 0 else (k, k + half)
        x0, x1 = x[:, :, i0].astype(np.float64), x[:, :, i1].astype(np.float64)
        out[:, :, i0] = x0 * np.cos(th) - x1 * np.sin(th)
        out[:, :, i1] = x0 * np.sin(th) + x1 * np.cos(th)
    return out


@pytest.mark.parametrize("mode,sections", MODES, ids=lambda m: str(m))
def test_rope_matches_the_formula(mode, sections):
    rng = np.random.default_rng(10 + mode)
    x = rng.uniform(-1, 1, (T_ALL, N_HEAD, N0)).astype(np.float32)
    pos = rng.integers(0, 200, (1 if sections is None else 4, T_ALL)).astype(np.int32)
    want = _formula(x, pos, mode, sections, 40, 10000.0)
    for be in (mg.backend("ref"), mg.backend("cpu")):
        got = _rope(x, pos, mode, sections, be)
        # the f32 angle p * theta_scale^k drifts by a few ulp of p * theta: positions < 200 keep it < 1e-4
        assert np.max(np.abs(got - want)) < 1e-4
        assert np.array_equal(got[:, :, 40:], x[:, :, 40:])   # dims past n_dims are copied


def test_rope_rules_are_op_errors():
    ctx = Context()
    q, pos = ctx.new_tensor_3d(mg.f32, 8, 2, 3), ctx.new_tensor_1d(mg.i32, 3)
    with pytest.raises(mg.OpError, match="ROPE: n_dims=3 must be even"):
        mg.rope_ext(q, pos, None, 3, 0, 0, 1e4, 1.0, 0.0, 1.0, 0.0, 0.0)
    with pytest.raises(mg.OpError, match="ROPE: positions .* has 4 entries"):
        mg.rope(q, ctx.new_tensor_1d(mg.i32, 4), 8, 2)
    with pytest.raises(mg.OpError, match="needs 4 per token"):
        mg.rope_multi(q, pos, None, 8, [2, 1, 1, 0], 8, 0, 1e4, 1.0, 0.0, 1.0, 0.0, 0.0)
    with pytest.raises(mg.OpError, match="not VISION"):
        mg.rope_multi(q, ctx.new_tensor_1d(mg.i32, 12), None, 4, [1, 1, 0, 0], 24, 0, 1e4, 1.0, 0.0, 1.0, 0.0, 0.0)
    with pytest.raises(mg.OpError, match="rows must be contiguous"):
        mg.rope(mg.transpose(ctx.new_tensor_3d(mg.f32, 3, 8, 3)), pos, 2, 0)


@pytest.mark.parametrize("mode", [0, 2])
def test_rope_rows_longer_than_the_angle_cache(mode):
    """n_dims 1200 (600 pairs: past the 512 pairs the cpu kernel shares between a token's heads,
    so it computes them row by row): the formula, and a token alone equals it in a batch."""
    rng = np.random.default_rng(20 + mode)
    x = rng.uniform(-1, 1, (5, 3, 1280)).astype(np.float32)
    pos = rng.integers(0, 200, (1, 5)).astype(np.int32)

    def run(xs, ps, be):
        b = Built(Context())
        a = b.leaf(mg.f32, (xs.shape[2], xs.shape[1], xs.shape[0]), data=xs)
        p = b.leaf(mg.i32, (ps.size,), data=ps.reshape(-1))
        b.out(mg.rope_ext(a, p, None, 1200, mode, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0))
        return run_built(b, be)[0].reshape(xs.shape)
    one = cpu.CpuBackend(310).set_n_threads(1)
    got = run(x, pos, cpu.CpuBackend(312).set_n_threads(2))
    assert np.max(np.abs(got - _formula(x, pos, mode, None, 1200, 10000.0))) < 1e-4
    assert np.array_equal(got[:, :, 1200:], x[:, :, 1200:])
    for t in range(5):
        assert np.array_equal(run(x[t:t + 1], pos[:, t:t + 1], one)[0], got[t]), t
