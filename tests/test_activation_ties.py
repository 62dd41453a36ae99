"""tests/activation_ties.py, the helper that lets the llama.cpp file-type comparison resolve an
activation rounding tie: on a value placed exactly on a midpoint of each vec_dot grid it records
the tie, leaves the run as it was, and with flip= gives that value the other grid point in every
mul_mat that converts the same row, exactly as if the row had held that grid point."""
import numpy as np
import pytest

import minigraph as mg
from minigraph import types as T
from minigraph.ops import matmul
from minigraph.testing.op_cases import Built, run_built

import activation_ties

COL = 5


def _row(t, rng):
    """A row with x[COL] on a midpoint of t's vec_dot grid and no other value near one; the grid
    point round-half-even gives x[COL]; the one across the midpoint."""
    if t in (T.f16, T.bf16):
        step = 2.0 ** (-10 if t == T.f16 else -7)              # the grid step at 1.0
        x = np.round(rng.uniform(-4, 4, 256) * 8) / 8              # on both grids
        x[COL] = 1 + step / 2
        return x, 1.0, 1 + step
    blk = 32 if t in (T.q8_0, T.q4_0) else 256
    x = np.round(rng.uniform(-100, 100, 256)) + 0.25           # scale 1: levels are the integers
    x[0::blk] = 127 if blk == 32 else -127                     # each block's (signed) absmax
    x[COL] = 40.5
    return x, 40.0, 41.0


def _run(t, x, flip=None):
    rng = np.random.default_rng(3)
    b = Built(mg.Context())
    other_row, _, _ = _row(t, np.random.default_rng(2))
    other_row[COL] = 3.25                                      # no midpoint in the second row
    xt = b.leaf(T.f32, (256, 2), data=np.stack([x, other_row]).astype(np.float32))
    for _ in range(2):                                         # two weights sharing the input
        raw = mg.quantize(rng.standard_normal((4, 256)).astype(np.float32), t)
        a = b.ctx.new_tensor_2d(t, 256, 4)
        b.data[a] = raw if t.is_quantized else raw.view(t.np_dtype).reshape(4, 256)
        b.out(mg.mul_mat(a, xt))
    with activation_ties.watch(flip) as ties:
        out = run_built(b, mg.backend("ref"))
    return np.concatenate([o.ravel() for o in out]), ties


@pytest.mark.parametrize("t", [T.f16, T.bf16, T.q8_0, T.q4_0, T.q4_k, T.q6_k], ids=lambda t: t.name)
def test_a_midpoint_is_recorded_and_flipped_in_every_use(t):
    x, here, across = _row(t, np.random.default_rng(1))
    got, ties = _run(t, x)
    at_col = [tie for tie in ties if tie.col == COL and tie.distance == 0]
    assert len(at_col) == 1, [str(tie) for tie in ties]          # one tie, though two mul_mats met it
    plain, _ = _run(t, np.where(np.arange(256) == COL, here, x))
    assert np.array_equal(got, plain)                             # the run itself is untouched
    flipped, _ = _run(t, x, flip=at_col[0])
    other, _ = _run(t, np.where(np.arange(256) == COL, across, x))
    assert np.array_equal(flipped, other) and not np.array_equal(flipped, got)


def test_watch_restores_mul_mat():
    original = matmul.mul_mat_rows
    with pytest.raises(RuntimeError):
        with activation_ties.watch():
            assert matmul.mul_mat_rows is not original
            raise RuntimeError("inside")
    assert matmul.mul_mat_rows is original
