"""Batch invariance of the cpu kernels: a token's column of a result must be bit-identical
whatever else is in the batch. Speculative decoding's rollback compares a batch decode against
token-by-token decoding bit for bit, so a kernel whose reduction order depends on the number of
columns (the ubatch), on the column's position in it or on the thread split breaks it.

MUL_MAT: for shapes with K not a multiple of any vector width (and K past the kernel's k block),
odd M (and M past its row block), broadcast planes and strided views, the result for N = 1..9
columns (in shuffled order: every column at several positions), 1 and 2 threads, must equal
column for column the single-column result computed alone. The per-token ops the runner runs on
batches (RMS_NORM, SSM_CONV, SSM_SCAN, GATED_DELTA_NET) get the same check over T tokens."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import Built, run_built
from minigraph.tensor import Context

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)


def _backend(n_threads):
    return cpu.CpuBackend(200 + n_threads).set_n_threads(n_threads)


def _tensor(b: Built, arr: np.ndarray, layout: str):
    """A tensor holding arr (NumPy order [ne3, ne2, ne1, ne0]) with the given memory layout:
    contig; strided (padded rows and planes, an offset of 2 floats: unaligned rows); swapped
    (dims 2 and 3 swapped in memory, a permute view)."""
    ne = tuple(reversed(arr.shape))
    if layout == "contig":
        return b.leaf(mg.f32, ne, data=arr)
    if layout == "strided":
        pad = np.zeros((ne[3], ne[2] + 1, ne[1] + 1, ne[0] + 3), np.float32)
        pad[:, :ne[2], :ne[1], 2:2 + ne[0]] = arr
        base = b.leaf(mg.f32, tuple(reversed(pad.shape)), data=pad)
        return mg.view_4d(base, *ne, base.nb[1], base.nb[2], base.nb[3], 2 * 4)
    if layout == "swapped":
        base = b.leaf(mg.f32, (ne[0], ne[1], ne[3], ne[2]), data=np.ascontiguousarray(arr.transpose(1, 0, 2, 3)))
        return mg.permute(base, 0, 1, 3, 2)
    raise ValueError(layout)


def _mul_mat(a: np.ndarray, bcols: np.ndarray, la: str, lb: str, be) -> np.ndarray:
    """cpu mul_mat of a [a3, a2, M, K] by b [b3, b2, N, K]; result [b3, b2, N, M]."""
    b = Built(Context())
    out = b.out(mg.mul_mat(_tensor(b, a, la), _tensor(b, bcols, lb)))
    assert tuple(out.ne) == (a.shape[2], bcols.shape[2], bcols.shape[1], bcols.shape[0])
    return run_built(b, be)[0].reshape(bcols.shape[:3] + (a.shape[2],))


# (K, M, a planes [a2, a3], b planes [b2, b3], layout of a, layout of b)
SHAPES = [
    (1, 1, (1, 1), (1, 1), "contig", "contig"),
    (7, 5, (1, 1), (1, 1), "contig", "contig"),
    (37, 13, (1, 1), (1, 1), "contig", "contig"),
    (100, 67, (1, 1), (1, 1), "strided", "contig"),
    (129, 31, (2, 1), (4, 2), "contig", "strided"),
    (67, 9, (2, 3), (2, 3), "swapped", "strided"),
    (1035, 11, (1, 1), (1, 1), "strided", "strided"),      # past the k block, a partial last chunk
    (2061, 70, (1, 1), (1, 1), "contig", "contig"),        # two k blocks and a tail, two row blocks
    (256, 129, (1, 1), (1, 1), "contig", "contig"),        # K a multiple of every vector width
]
POOL = 9


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}-M{s[1]}-a{s[2][0]}x{s[2][1]}-b{s[3][0]}x{s[3][1]}-{s[4]}-{s[5]}")
def test_mul_mat_column_is_independent_of_the_batch(shape):
    K, M, (a2, a3), (b2, b3), la, lb = shape
    rng = np.random.default_rng(K * 1000 + M)
    a = rng.uniform(-1, 1, (a3, a2, M, K)).astype(np.float32)
    pool = rng.uniform(-1, 1, (b3, b2, POOL, K)).astype(np.float32)
    one = _backend(1)
    # each column alone (N = 1): the matrix x vector path
    single = np.stack([_mul_mat(a, pool[:, :, c:c + 1], la, lb, one)[:, :, 0] for c in range(POOL)], axis=2)
    assert np.isfinite(single).all()
    ref = np.einsum("xymk,xynk->xynm", np.repeat(np.repeat(a, b3 // a3, 0), b2 // a2, 1).astype(np.float64),
                    pool.astype(np.float64))
    np.testing.assert_allclose(single, ref, rtol=1e-4, atol=1e-4 * np.sqrt(K))
    for n_threads in (1, 2):
        be = _backend(n_threads)
        for N in range(1, POOL + 1):
            for draw in range(2):
                cols = rng.permutation(POOL)[:N] if draw else np.arange(N)
                got = _mul_mat(a, pool[:, :, cols], la, lb, be)
                for pos, c in enumerate(cols):
                    if not np.array_equal(got[:, :, pos].view(np.uint32), single[:, :, c].view(np.uint32)):
                        bad = int(np.sum(got[:, :, pos] != single[:, :, c]))
                        pytest.fail(f"column {c} at position {pos} of N={N} ({n_threads} threads): "
                                    f"{bad} elements differ from its single-column result")


@pytest.mark.parametrize("n_threads", [1, 2])
def test_mul_mat_wide_batch_crosses_column_blocks(n_threads):
    """N = 70 (past the kernel's column block) against single columns, a few of them."""
    K, M, N = 300, 45, 70
    rng = np.random.default_rng(7)
    a = rng.uniform(-1, 1, (1, 1, M, K)).astype(np.float32)
    b = rng.uniform(-1, 1, (1, 1, N, K)).astype(np.float32)
    got = _mul_mat(a, b, "contig", "contig", _backend(n_threads))
    for c in (0, 3, 4, 63, 64, 66, 69):
        alone = _mul_mat(a, b[:, :, c:c + 1], "contig", "contig", _backend(1))
        assert np.array_equal(got[:, :, c].view(np.uint32), alone[:, :, 0].view(np.uint32)), c


# -- the per-token ops the runner runs on batches --------------------------------------------

def test_rms_norm_row_is_independent_of_the_batch():
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (9, 1037)).astype(np.float32)

    def norm(rows, n_threads):
        b = Built(Context())
        b.out(mg.rms_norm(b.leaf(mg.f32, (1037, len(rows)), data=x[rows]), 1e-6))
        return run_built(b, _backend(n_threads))[0].reshape(len(rows), 1037)
    alone = [norm([r], 1)[0] for r in range(9)]
    for n_threads in (1, 2):
        for N in range(1, 10):
            got = norm(list(range(N)), n_threads)
            for r in range(N):
                assert np.array_equal(got[r], alone[r]), (N, r, n_threads)


def _ssm_conv_tokens(x_full, c, T, t0, n_threads):
    """ssm_conv over tokens t0..t0+T-1 of x_full [n_s, d_inner, d_conv-1+T_all]: [n_s, T, d_inner]."""
    d_conv = c.shape[1]
    b = Built(Context())
    xs = np.ascontiguousarray(x_full[:, :, t0:t0 + d_conv - 1 + T])
    b.out(mg.ssm_conv(b.leaf(mg.f32, tuple(reversed(xs.shape)), data=xs), b.leaf(mg.f32, (d_conv, c.shape[0]), data=c)))
    return run_built(b, _backend(n_threads))[0].reshape(x_full.shape[0], T, c.shape[0])


@pytest.mark.parametrize("d_inner", [5, 16, 37])
def test_ssm_conv_token_is_independent_of_the_batch(d_inner):
    rng = np.random.default_rng(d_inner)
    T_all, d_conv, n_s = 9, 4, 2
    x = rng.uniform(-1, 1, (n_s, d_inner, d_conv - 1 + T_all)).astype(np.float32)
    c = rng.uniform(-1, 1, (d_inner, d_conv)).astype(np.float32)
    alone = [_ssm_conv_tokens(x, c, 1, t, 1)[:, 0] for t in range(T_all)]
    for n_threads in (1, 2):
        for T in range(1, T_all + 1):
            for t0 in (0, T_all - T):
                got = _ssm_conv_tokens(x, c, T, t0, n_threads)
                for t in range(T):
                    assert np.array_equal(got[:, t], alone[t0 + t]), (T, t0, t, n_threads)
