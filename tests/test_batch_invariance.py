"""Batch invariance of the cpu kernels: a token's column of a result must be bit-identical
whatever else is in the batch. Speculative decoding's rollback compares a batch decode against
token-by-token decoding bit for bit, so a kernel whose reduction order depends on the number of
columns (the ubatch), on the column's position in it or on the thread split breaks it.

MUL_MAT: for shapes with K not a multiple of any vector width (and K past the kernel's k block),
odd M (and M past its row block), broadcast planes and strided views, the result for N = 1..9
columns (in shuffled order: every column at several positions), 1 and 2 threads, must equal
column for column the single-column result computed alone. The per-token ops the runner runs on
batches (RMS_NORM, SSM_CONV) get the same check over T tokens.

The grid (the second half, about 3 s): every op whose result for one token must not depend on the
batch -- MUL_MAT, RMS_NORM, NORM, L2_NORM, SUM_ROWS, SOFT_MAX (with and without a mask), the unary
ops (SILU, SIGMOID, SOFTPLUS, EXP, NEG, SQRT, GELU), the binary ops (ADD, SUB, MUL, DIV, per-token
and broadcast operands), SCALE, ROPE (normal, NeoX with YaRN, IMROPE), FLASH_ATTN_EXT (per query
row) -- on N in {1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32, 33, 64} tokens drawn from a pool of 64, with
1 thread and with 2 threads and every node split into chunks: each token's bytes equal its
result alone. The sequence ops (SSM_CONV, SSM_SCAN, GATED_DELTA_NET with a scalar and a
per-channel gate) get it per sequence: 1 to 3 sequences of T tokens (T in the same sample) in one
call, against each sequence alone token by token, outputs and every written snapshot slot."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import Built, random_data, run_built
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
    (1035, 11, (1, 1), (1, 1), "strided", "strided"),      # past AVX-512's and the portable k block
    (2061, 70, (1, 1), (1, 1), "contig", "contig"),        # past AVX2's k block (2048): a tail, two row blocks
    (4133, 9, (1, 1), (1, 1), "contig", "strided"),        # three AVX2 k blocks, a partial last chunk
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


def _mul_mat_2d_weights(t, w, K, M, x: np.ndarray, lb: str, be) -> np.ndarray:
    """cpu mul_mat of a 2D weight [K, M] of type t by x [n_seqs, n_seq_tokens, K] (sequences as
    planes, as a recurrent layer's decode step has them); result [n_seqs, n_seq_tokens, M]."""
    b = Built(Context())
    out = b.out(mg.mul_mat(b.leaf(t, (K, M), data=w), _tensor(b, x[None], lb)))
    return run_built(b, be)[0].reshape(x.shape[:2] + (M,))


@pytest.mark.parametrize("t", [mg.f32, mg.q8_0, mg.q4_k], ids=lambda t: t.name)
@pytest.mark.parametrize("lb", ["contig", "strided"])
def test_mul_mat_sequences_as_planes_equal_single_columns(t, lb):
    """A weight shared by every plane of b ([K, n_seq_tokens, n_seqs]): the kernel may take the
    planes as one run of columns (contig: the weight is then read once, not once per sequence),
    or plane by plane (strided: padded planes are no run); either way each token's column equals
    its single-column 2D product byte for byte, from 1 to 30 sequences (past the packed path's
    24 columns), at 1 and 2 threads."""
    K, M = 256 + 37 if t == mg.f32 else 512, 67
    rng = np.random.default_rng(11)
    w = random_data(rng, t, (K, M)).reshape(M, -1)       # values, or rows of raw blocks
    pool = rng.uniform(-1, 1, (30, 2, K)).astype(np.float32)
    one = _backend(1)
    single = np.stack([np.stack([_mul_mat_2d_weights(t, w, K, M, pool[s:s + 1, i:i + 1], "contig", one)[0, 0]
                                 for i in range(2)]) for s in range(30)])
    ref = pool.astype(np.float64) @ (w.astype(np.float64).T if t == mg.f32 else
                                     mg.dequantize(np.ascontiguousarray(w).view(np.uint8), t).reshape(M, K).T)
    np.testing.assert_allclose(single, ref, rtol=2e-2, atol=2e-2 * np.sqrt(K))
    for n_threads in (1, 2):
        be = _backend(n_threads)
        for n_seqs, n_tok in ((1, 1), (4, 1), (3, 2), (9, 1), (30, 1), (13, 2)):
            got = _mul_mat_2d_weights(t, w, K, M, pool[:n_seqs, :n_tok], lb, be)
            want = single[:n_seqs, :n_tok]
            if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                pytest.fail(f"{t.name} weights, {n_seqs} sequences x {n_tok} tokens ({lb}, {n_threads} threads): "
                            f"{int(np.sum(got != want))} elements differ from the single-column results")


# (K, M, N, a planes, b planes, layout of a, layout of b): the packed prefill path (24 or more
# columns) -- k tails and several k blocks, odd M across row blocks, planes with broadcast,
# strided and swapped views, and more columns than one slab of results (512)
PACKED_SHAPES = [
    (1100, 131, 40, (1, 1), (1, 1), "strided", "contig"),
    (517, 67, 27, (2, 1), (4, 1), "contig", "strided"),
    (64, 9, 25, (2, 3), (2, 3), "swapped", "strided"),
    (77, 70, 530, (1, 1), (1, 1), "contig", "contig"),
    (2100, 53, 31, (1, 1), (1, 1), "contig", "strided"),   # AVX2: two k blocks, a partial chunk, 3-column panel
    (4100, 29, 26, (1, 1), (1, 2), "strided", "contig"),   # three k blocks, one partial tile of rows
]


@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: f"K{s[0]}-M{s[1]}-N{s[2]}-{s[5]}-{s[6]}")
@pytest.mark.parametrize("n_threads", [1, 2])
def test_mul_mat_gemm_columns_equal_their_single_column_results(shape, n_threads):
    """A GEMM-sized batch (the packed path) against each column alone (matrix x vector) and
    against NumPy in float64: bit-identical to the former, close to the latter."""
    K, M, N, (a2, a3), (b2, b3), la, lb = shape
    rng = np.random.default_rng(K + M + N)
    a = rng.uniform(-1, 1, (a3, a2, M, K)).astype(np.float32)
    b = rng.uniform(-1, 1, (b3, b2, N, K)).astype(np.float32)
    got = _mul_mat(a, b, la, lb, _backend(n_threads))
    ref = np.einsum("xymk,xynk->xynm", np.repeat(np.repeat(a, b3 // a3, 0), b2 // a2, 1).astype(np.float64),
                    b.astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.sqrt(K))
    for c in sorted({0, 1, 5, 6, 7, N // 2, N - 2, N - 1}):
        alone = _mul_mat(a, b[:, :, c:c + 1], la, lb, _backend(1))[:, :, 0]
        if not np.array_equal(got[:, :, c].view(np.uint32), alone.view(np.uint32)):
            pytest.fail(f"column {c} of N={N} ({n_threads} threads): {int(np.sum(got[:, :, c] != alone))} "
                        f"elements differ from its single-column result")


@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: f"K{s[0]}-M{s[1]}-N{s[2]}-{s[5]}-{s[6]}")
@pytest.mark.parametrize("n_threads", [1, 2])
def test_mul_mat_packed_copy_of_b_gives_the_bytes_of_b_read_in_place(shape, n_threads):
    """The packed path reads b from the panels MUL_MAT:pack_src1 wrote in the record before the
    MUL_MAT's (planes merged into columns or not, as the MUL_MAT takes them); with that copy
    taken away (src[2] NULL) the same jobs run the direct path on b in place: byte-equal."""
    from minigraph.backends.cpu import ffi, lib
    K, M, N, (a2, a3), (b2, b3), la, lb = shape
    rng = np.random.default_rng(K * M + N)
    b = Built(Context())
    b.out(mg.mul_mat(_tensor(b, rng.uniform(-1, 1, (a3, a2, M, K)).astype(np.float32), la),
                     _tensor(b, rng.uniform(-1, 1, (b3, b2, N, K)).astype(np.float32), lb)))
    be = _backend(n_threads)
    graphs = []
    packed = run_built(b, be, graph_hook=graphs.append)[0]
    plan = be.get_plan(graphs[0].nodes, graphs[0].cache)
    names = [ffi.string(lib.mg_op_name(plan.records[i].op)).decode() for i in range(plan.n)]
    assert names == ["MUL_MAT:pack_src1", "MUL_MAT"]
    assert plan.records[1].src[2].data == plan.records[0].dst.data != ffi.NULL
    plan.records[1].src[2].data = ffi.NULL
    be.graph_compute(graphs[0])
    direct = b.outs[0].numpy()
    if not np.array_equal(packed.view(np.uint32), direct.view(np.uint32)):
        pytest.fail(f"{int(np.sum(packed != direct))} elements differ between b packed and b in place")


def test_mul_mat_packs_b_only_for_the_packed_path():
    """Fewer columns than the packed path takes, or weights that are not f32: no packing record."""
    from minigraph.backends.cpu import ffi, lib
    rng = np.random.default_rng(5)
    for t, N in ((mg.f32, 23), (mg.f16, 64), (mg.q8_0, 64)):
        b = Built(Context())
        w = b.leaf(t, (64, 16), data=random_data(rng, t, (64, 16)).reshape(16, -1))
        b.out(mg.mul_mat(w, b.leaf(mg.f32, (64, N), rng=rng)))
        be = _backend(1)
        graphs = []
        run_built(b, be, graph_hook=graphs.append)
        plan = be.get_plan(graphs[0].nodes, graphs[0].cache)
        names = [ffi.string(lib.mg_op_name(plan.records[i].op)).decode() for i in range(plan.n)]
        assert "MUL_MAT:pack_src1" not in names, (t.name, N, names)


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


# -- the grid: every per-token op, N = 1..64 tokens, 1 and 2 threads -------------------------
# A pool of 64 tokens; for each N of NS, N of them (a seeded random draw, so each token lands at
# several positions) go through the op as one batch, with 1 thread (the default chunking) and
# with 2 threads and every node split into 4 chunks per thread (mg_set_chunking(0, 0)); each
# token's result must equal, byte for byte, its result computed alone (N = 1, 1 thread).

POOL_T = 64
NS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32, 33, 64)
NE0 = 45          # a row: vector chunks and a tail on AVX2 (8) and AVX-512 (16)


def _check_grid(name, run, pool=POOL_T):
    """run(sel, be) -> an array whose leading axis is the tokens of sel (a list of pool indices)."""
    be1 = _backend(1)
    cpu.lib.mg_set_chunking(-1, -1)
    alone = [run([i], be1)[0] for i in range(pool)]
    rng = np.random.default_rng(len(name))
    try:
        for n_threads in (1, 2):
            be = _backend(n_threads)
            cpu.lib.mg_set_chunking(*((0, 0) if n_threads > 1 else (-1, -1)))
            for N in NS:
                sel = [int(i) for i in rng.permutation(pool)[:N]]
                got = run(sel, be)
                for pos, i in enumerate(sel):
                    if not np.array_equal(np.ascontiguousarray(got[pos]).view(np.uint8),
                                          np.ascontiguousarray(alone[i]).view(np.uint8)):
                        bad = int(np.sum(got[pos] != alone[i]))
                        pytest.fail(f"{name}: token {i} at position {pos} of N={N} ({n_threads} threads): "
                                    f"{bad} elements differ from its result alone")
    finally:
        cpu.lib.mg_set_chunking(-1, -1)


_rng0 = np.random.default_rng(12)
X = _rng0.uniform(-2, 2, (POOL_T, NE0)).astype(np.float32)          # token rows
Y = _rng0.uniform(0.5, 2, (POOL_T, NE0)).astype(np.float32)         # a second per-token operand (no zeros)
W = _rng0.uniform(-1, 1, (1, NE0)).astype(np.float32)               # a weight row, broadcast
MASK = np.where(_rng0.uniform(0, 1, (POOL_T, NE0)) < 0.2, -np.inf, 0).astype(np.float32)


def _rows(f, *, second=None, mask=None):
    def run(sel, be):
        b = Built(Context())
        x = b.leaf(mg.f32, (NE0, len(sel)), data=X[sel])
        args = [x]
        if second is not None:
            args.append(b.leaf(mg.f32, (NE0, len(sel) if second is Y else 1), data=second[sel] if second is Y else second))
        if mask is not None:
            args.append(b.leaf(mg.f32, (NE0, len(sel)), data=MASK[sel]))
        b.out(f(*args))
        return run_built(b, be)[0].reshape(len(sel), -1)
    return run


ROW_OPS = {
    "rms_norm": _rows(lambda x: mg.rms_norm(x, 1e-6)),
    "norm": _rows(lambda x: mg.norm(x, 1e-5)),
    "l2_norm": _rows(lambda x: mg.l2_norm(x, 1e-6)),
    "sum_rows": _rows(mg.sum_rows),
    "soft_max": _rows(mg.soft_max),
    "soft_max_ext_mask": _rows(lambda x, m: mg.soft_max_ext(x, m, 0.7), mask=True),
    "silu": _rows(mg.silu),
    "sigmoid": _rows(mg.sigmoid),
    "softplus": _rows(lambda x: mg.softplus(mg.scale(x, 15.0))),     # past the x > 20 branch too
    "exp": _rows(lambda x: mg.exp(mg.scale(x, 50.0))),               # the slow (|n| > 125) path too
    "neg": _rows(mg.neg),
    "sqrt": _rows(lambda x: mg.sqrt(mg.mul(x, x))),
    "gelu": _rows(lambda x: mg.gelu(mg.scale(x, 6.0))),
    "add": _rows(mg.add, second=Y),
    "sub_bcast": _rows(mg.sub, second=W),
    "mul_bcast": _rows(mg.mul, second=W),
    "div": _rows(mg.div, second=Y),
    "scale": _rows(lambda x: mg.scale(x, 0.3)),
    "scale_bias": _rows(lambda x: mg.scale_bias(x, 0.3, -1.25)),
}


@pytest.mark.parametrize("op", list(ROW_OPS))
def test_row_op_token_is_independent_of_the_batch(op):
    _check_grid(op, ROW_OPS[op])


MM_K, MM_M = 1035, 37     # past the k block, odd rows
MM_A = _rng0.uniform(-1, 1, (MM_M, MM_K)).astype(np.float32)
MM_B = _rng0.uniform(-1, 1, (POOL_T, MM_K)).astype(np.float32)


def test_mul_mat_grid_up_to_64_columns():
    def run(sel, be):
        return _mul_mat(MM_A[None, None], MM_B[sel][None, None], "contig", "contig", be)[0, 0]
    _check_grid("mul_mat", run)


ROPE_D, ROPE_H = 24, 3
ROPE_X = _rng0.uniform(-1, 1, (POOL_T, ROPE_H, ROPE_D)).astype(np.float32)
ROPE_POS = _rng0.integers(0, 4000, POOL_T).astype(np.int32)


@pytest.mark.parametrize("mode", ["normal", "neox_yarn", "imrope"])
def test_rope_token_is_independent_of_the_batch(mode):
    def run(sel, be):
        b = Built(Context())
        n = len(sel)
        a = b.leaf(mg.f32, (ROPE_D, ROPE_H, n), data=ROPE_X[sel])
        if mode == "normal":
            y = mg.rope(a, b.leaf(mg.i32, (n,), data=ROPE_POS[sel]), 16, 0)
        elif mode == "neox_yarn":
            y = mg.rope_ext(a, b.leaf(mg.i32, (n,), data=ROPE_POS[sel]), None, 20, 2, 512, 10000.0, 0.25,
                            1.0, 1.0, 32.0, 1.0)
        else:
            pos = np.concatenate([ROPE_POS[sel], ROPE_POS[sel] // 2, ROPE_POS[sel] // 3, np.zeros(n, np.int32)])
            y = mg.rope_multi(a, b.leaf(mg.i32, (4 * n,), data=pos), None, 24, [4, 4, 4, 0], 40, 4096,
                              10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
        b.out(y)
        return run_built(b, be)[0].reshape(n, ROPE_H, ROPE_D)
    _check_grid(f"rope {mode}", run)


FA_D, FA_H, FA_HKV, FA_KV = 16, 4, 2, 40
FA_Q = _rng0.uniform(-1, 1, (FA_H, POOL_T, FA_D)).astype(np.float32)
FA_K = _rng0.uniform(-1, 1, (FA_HKV, FA_KV, FA_D)).astype(np.float32)
FA_V = _rng0.uniform(-1, 1, (FA_HKV, FA_KV, FA_D)).astype(np.float32)
FA_MASK = np.where(_rng0.uniform(0, 1, (POOL_T, FA_KV)) < 0.3, -np.inf, 0).astype(np.float16)


def test_flash_attn_ext_query_is_independent_of_the_batch():
    def run(sel, be):
        b = Built(Context())
        n = len(sel)
        q = b.leaf(mg.f32, (FA_D, n, FA_H), data=FA_Q[:, sel])
        k = b.leaf(mg.f32, (FA_D, FA_KV, FA_HKV), data=FA_K)
        v = b.leaf(mg.f32, (FA_D, FA_KV, FA_HKV), data=FA_V)
        m = b.leaf(mg.f16, (FA_KV, n), data=FA_MASK[sel])
        b.out(mg.flash_attn_ext(q, k, v, m, 0.25, 0.0, 0.0))
        return run_built(b, be)[0].reshape(n, FA_H, FA_D)        # [n_q, n_head, D_v]
    _check_grid("flash_attn_ext", run)


# -- sequence ops: per sequence, whatever the number of sequences and tokens in the batch ------
# A pool of 3 sequences of 64 tokens. The reference is each sequence alone, token by token (T = 1,
# the state carried from one call to the next through slot 0). A batch holds 1 to 3 of the
# sequences (in a drawn order) and T tokens from t0 (0, or 64 - T, starting from the reference's
# state there); every token's output and every written snapshot slot must equal the reference.

N_SEQ = 3
SCAN_K = 4


def _check_seq_grid(name, step):
    """step(seqs, t0, T, states, K, be) -> (y [ns, T, ...], snaps [K, ns, ...]): states is the
    list of per-sequence states at t0."""
    be1 = _backend(1)
    cpu.lib.mg_set_chunking(-1, -1)
    ref_y, ref_s = {}, {}     # (q, t) -> output of token t; state after token t
    for q in range(N_SEQ):
        st = None
        for t in range(POOL_T):
            y, sn = step([q], t, 1, [st], 1, be1)
            ref_y[q, t], st = y[0, 0], sn[0, 0]
            ref_s[q, t] = st
    init = {q: None for q in range(N_SEQ)}
    rng = np.random.default_rng(len(name))
    try:
        for n_threads in (1, 2):
            be = _backend(n_threads)
            cpu.lib.mg_set_chunking(*((0, 0) if n_threads > 1 else (-1, -1)))
            for T in NS:
                seqs = [int(s) for s in rng.permutation(N_SEQ)[:1 + T % N_SEQ]]
                for t0 in sorted({0, POOL_T - T}):
                    states = [init[q] if t0 == 0 else ref_s[q, t0 - 1] for q in seqs]
                    y, sn = step(seqs, t0, T, states, SCAN_K, be)
                    where = f"{name}: seqs {seqs}, tokens {t0}..{t0 + T - 1} ({n_threads} threads)"
                    for iq, q in enumerate(seqs):
                        for t in range(T):
                            if not np.array_equal(y[iq, t].view(np.uint8), ref_y[q, t0 + t].view(np.uint8)):
                                pytest.fail(f"{where}: output of seq {q} token {t0 + t} differs from token by token")
                        for j in range(min(T, SCAN_K)):
                            if not np.array_equal(sn[j, iq].view(np.uint8), ref_s[q, t0 + T - 1 - j].view(np.uint8)):
                                pytest.fail(f"{where}: snapshot slot {j} of seq {q} differs from token by token")
    finally:
        cpu.lib.mg_set_chunking(-1, -1)


@pytest.mark.parametrize("d_inner,d_conv", [(37, 4), (64, 4), (21, 3)])   # 64: blocks start on output lines
def test_ssm_conv_grid_up_to_64_tokens_and_3_sequences(d_inner, d_conv):
    rng = np.random.default_rng(5)
    xs = rng.uniform(-1, 1, (N_SEQ, d_inner, d_conv - 1 + POOL_T)).astype(np.float32)
    c = rng.uniform(-1, 1, (d_inner, d_conv)).astype(np.float32)
    singles = {}
    for q in range(N_SEQ):
        for t in range(POOL_T):
            singles[q, t] = _ssm_conv_tokens(xs[q:q + 1], c, 1, t, 1)[0, 0]
    for n_threads in (1, 2):
        cpu.lib.mg_set_chunking(*((0, 0) if n_threads > 1 else (-1, -1)))
        try:
            for T in NS:
                seqs = [int(s) for s in rng.permutation(N_SEQ)[:1 + T % N_SEQ]]
                for t0 in sorted({0, POOL_T - T}):
                    got = _ssm_conv_tokens(xs[seqs], c, T, t0, n_threads)
                    for iq, q in enumerate(seqs):
                        for t in range(T):
                            assert np.array_equal(got[iq, t].view(np.uint8), singles[q, t0 + t].view(np.uint8)), \
                                (seqs, T, t0, t, n_threads)
        finally:
            cpu.lib.mg_set_chunking(-1, -1)


def _scan_data(seed, ds, hd, nh, ng):
    rng = np.random.default_rng(seed)
    return dict(
        s0=rng.uniform(-1, 1, (N_SEQ, nh, hd, ds)).astype(np.float32),
        x=rng.uniform(-1, 1, (N_SEQ, POOL_T, nh, hd)).astype(np.float32),
        dt=rng.uniform(-2, 1, (N_SEQ, POOL_T, nh)).astype(np.float32),
        A=-rng.uniform(0.2, 2, (nh, 1)).astype(np.float32),
        B=rng.uniform(-1, 1, (N_SEQ, POOL_T, ng, ds)).astype(np.float32),
        C=rng.uniform(-1, 1, (N_SEQ, POOL_T, ng, ds)).astype(np.float32))


def test_ssm_scan_grid_per_sequence():
    ds, hd, nh, ng = 16, 5, 4, 2
    D = _scan_data(9, ds, hd, nh, ng)

    def step(seqs, t0, T, states, K, be):
        ns = len(seqs)
        st = np.stack([D["s0"][q] if s is None else s for q, s in zip(seqs, states)])   # [ns, nh, hd, ds]
        rows = st[::-1].copy()                                   # rows reversed: ids pick them back
        ids = np.arange(ns, dtype=np.int32)[::-1].copy()
        sl = slice(t0, t0 + T)
        b = Built(Context())
        y = mg.ssm_scan(b.leaf(mg.f32, (ds, hd, nh, ns), data=rows),
                        b.leaf(mg.f32, (hd, nh, T, ns), data=D["x"][seqs, sl]),
                        b.leaf(mg.f32, (nh, T, ns), data=D["dt"][seqs, sl]),
                        b.leaf(mg.f32, (1, nh), data=D["A"]),
                        b.leaf(mg.f32, (ds, ng, T, ns), data=D["B"][seqs, sl]),
                        b.leaf(mg.f32, (ds, ng, T, ns), data=D["C"][seqs, sl]),
                        b.leaf(mg.i32, (ns,), data=ids), K=K)
        b.out(y)
        flat = run_built(b, be)[0].reshape(-1)
        ny = hd * nh * T * ns
        return flat[:ny].reshape(ns, T, nh, hd), flat[ny:].reshape(K, ns, nh, hd, ds)
    _check_seq_grid("ssm_scan", step)


@pytest.mark.parametrize("gate", ["scalar", "kda"])
def test_gated_delta_net_grid_per_sequence(gate):
    S, H, Hk = 8, 4, 2
    rng = np.random.default_rng(11)
    gw = S if gate == "kda" else 1
    q_ = rng.uniform(-0.4, 0.4, (N_SEQ, POOL_T, Hk, S)).astype(np.float32)
    k_ = rng.uniform(-0.4, 0.4, (N_SEQ, POOL_T, Hk, S)).astype(np.float32)
    v_ = rng.uniform(-1, 1, (N_SEQ, POOL_T, H, S)).astype(np.float32)
    g_ = rng.uniform(-0.5, -0.01, (N_SEQ, POOL_T, H, gw)).astype(np.float32)
    b_ = rng.uniform(0.1, 0.9, (N_SEQ, POOL_T, H, 1)).astype(np.float32)
    s0 = rng.uniform(-0.5, 0.5, (N_SEQ, H, S, S)).astype(np.float32)

    def step(seqs, t0, T, states, K, be):
        ns = len(seqs)
        st = np.stack([s0[q] if s is None else s for q, s in zip(seqs, states)])
        sl = slice(t0, t0 + T)
        b = Built(Context())
        y = mg.gated_delta_net(b.leaf(mg.f32, (S, Hk, T, ns), data=q_[seqs, sl]),
                               b.leaf(mg.f32, (S, Hk, T, ns), data=k_[seqs, sl]),
                               b.leaf(mg.f32, (S, H, T, ns), data=v_[seqs, sl]),
                               b.leaf(mg.f32, (gw, H, T, ns), data=g_[seqs, sl]),
                               b.leaf(mg.f32, (1, H, T, ns), data=b_[seqs, sl]),
                               b.leaf(mg.f32, (S, S, H, ns), data=st), K=K)
        b.out(y)
        flat = run_built(b, be)[0].reshape(-1)
        n_o = S * H * T * ns
        return flat[:n_o].reshape(ns, T, H, S), flat[n_o:].reshape(K, ns, H, S, S)
    _check_seq_grid(f"gated_delta_net {gate}", step)
