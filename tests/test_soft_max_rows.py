"""SOFT_MAX on the rows attention gives it in a decode step: short rows, most of the mask -inf
(empty and padded cells). The cpu kernel's dense-row path (8-lane max, 8 double chains for the
sum, exp lanes at or below -104 taken as +0 without the slow path) against float64 NumPy, for
every row length from 1 to 70 and a few long ones, with masks that leave 1, some or all cells:
masked cells come out +0 exactly. (Strided rows, the in-order path, are in the op table.)"""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import Built, run_built
from minigraph.tensor import Context

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)


def _softmax64(x, mask, scale):
    w = x.astype(np.float64) * scale + mask.astype(np.float64)
    e = np.exp(w - w.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _run(x, mask, scale, be):
    b = Built(Context())
    rows, n = x.shape
    a = b.leaf(mg.f32, (n, 1, rows), data=x.reshape(rows, 1, n))
    m = b.leaf(mg.f32, (n, 1), data=mask.reshape(1, n))
    b.out(mg.soft_max_ext(a, m, scale, 0.0))
    return run_built(b, be)[0].reshape(rows, n)


@pytest.mark.parametrize("n", list(range(1, 71)) + [255, 256, 257, 4096])
def test_decode_attention_rows(n):
    rng = np.random.default_rng(n)
    rows = 6
    x = rng.uniform(-8, 8, (rows, n)).astype(np.float32)
    be = cpu.CpuBackend(300).set_n_threads(1)
    for used in sorted({1, max(1, n // 3), n}):
        mask = np.full(n, -np.inf, np.float32)
        mask[rng.permutation(n)[:used]] = rng.uniform(-1, 0, used).astype(np.float32)
        got = _run(x, mask, 0.125, be)
        want = _softmax64(x, np.broadcast_to(mask, x.shape), np.float32(0.125))
        np.testing.assert_allclose(got, want, rtol=3e-6, atol=1e-7)
        assert np.all(got[:, mask == -np.inf] == 0.0) and not np.signbit(got).any()
