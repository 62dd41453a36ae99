"""The half-precision and block-type kernels against real ggml (libggml-python 0.20.2, its AVX2
CPU build): the cpu backend's (backends/cpu/quant_*.c) and the CUDA backend's (backends/cuda/
quant.cu, run on the CPU emulator): get_rows and cpy byte for byte, mul_mat within NMSE 1e-10
(cpu's block types bit for bit on AVX2 builds: same integer sums, same float lanes), over random
shapes, weight row views, strided and permuted src1 views and src1 column counts from 1 up;
results that do not depend on the batch or the thread count; the conversion of src1 that ggml's
x86 mul_mat does (not the file quantizer); the backend's type table."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import minigraph as mg
from minigraph.errors import OpError
from minigraph.testing.op_cases import CASES, Built, compare, nmse, run_built
from minigraph.tensor import Context
from minigraph.types import bf16, f16, f32, i32, q4_0, q4_k, q6_k, q8_0

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)
if importlib.util.find_spec("libggml") is None:
    pytest.skip("real ggml is not installed: pip install libggml-python==0.20.2.post1 "
                "(the 'test' extra) to run the oracle tests", allow_module_level=True)

from minigraph.testing.ggml_oracle import run_in_ggml  # noqa: E402

WEIGHTS = (f16, bf16, q8_0, q4_0, q4_k, q6_k)
BLOCKS = (q8_0, q4_0, q4_k, q6_k)


def _be(n_threads, idx=40):
    return cpu.CpuBackend(idx + n_threads).set_n_threads(n_threads)


_EMU = []


def _cuda_emu():
    """A CUDA backend on the CPU emulator (one per test process: it compiles the kernels once)."""
    from minigraph.backends.cuda import CudaBackend
    from minigraph.backends.cuda.emu import EmuDevice, compiler
    if compiler() is None:
        pytest.skip("no C++ compiler (g++) for the CUDA emulator")
    if not _EMU:
        _EMU.append(EmuDevice())
    return CudaBackend(0, device=_EMU[0])


def _typed_cases():
    return [c for c in CASES if c.types]


@pytest.mark.oracle
@pytest.mark.parametrize("case", _typed_cases(), ids=lambda c: c.id)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_typed_case_matches_ggml(case, n_threads):
    """Every case tagged with a wide type (minigraph/testing/quant_cases.py), cpu against ggml."""
    for seed in range(4):
        built = case.make(np.random.default_rng(seed))
        actual = run_built(built, _be(n_threads))
        expected = run_in_ggml(case.make(np.random.default_rng(seed)))
        why = compare(case, built, actual, expected, nmse_limit=None if case.exact else 1e-10)
        assert why is None, f"{case.id} seed {seed} ({n_threads} threads): cpu vs ggml: {why}"


def _mul_mat_built(rng, t, K, M, N, src1_layout="contig", batch=(1, 1), bcast=(1, 1)):
    """w [K, M, B2, B3] of type t (rows 1.. of a larger tensor: a view on a row boundary), x an
    f32 src1 [K, N, B2*r2, B3*r3] in the given layout."""
    b = Built(Context())
    B2, B3 = batch
    r2, r3 = bcast
    big = b.leaf(t, (K, M + 1, B2, B3), rng=rng)
    w = mg.view_4d(big, K, M, B2, B3, big.nb[1], big.nb[2], big.nb[3], big.nb[1])
    ne = (K, N, B2 * r2, B3 * r3)
    if src1_layout == "contig":
        x = b.leaf(f32, ne, rng=rng)
    elif src1_layout == "padded":       # rows and planes further apart than dense
        p = b.leaf(f32, (K + 7, N + 2, ne[2], ne[3]), rng=rng)
        x = mg.view_4d(p, *ne, p.nb[1], p.nb[2], p.nb[3], 0)
    else:                               # "permuted": dims 1 and 2 swapped in memory
        p = b.leaf(f32, (K, ne[2], N, ne[3]), rng=rng)
        x = mg.permute(p, 0, 2, 1, 3)
    b.out(mg.mul_mat(w, x))
    return b


def _ggml_mul_mat_check(rng_seed, t, K, M, N, layout, batch=(1, 1), bcast=(1, 1), n_threads=1, be=None):
    built = _mul_mat_built(np.random.default_rng(rng_seed), t, K, M, N, layout, batch, bcast)
    got = run_built(built, be if be is not None else _be(n_threads))[0]
    want = run_in_ggml(_mul_mat_built(np.random.default_rng(rng_seed), t, K, M, N, layout, batch, bcast))[0]
    return got, want


@pytest.mark.oracle
@pytest.mark.parametrize("t", WEIGHTS, ids=lambda t: t.name)
@pytest.mark.parametrize("layout", ["contig", "padded", "permuted"])
def test_mul_mat_matches_ggml_random_shapes(t, layout):
    rng = np.random.default_rng(hash((t.name, layout)) % 2**32)
    for trial in range(3):
        K = t.blck_size * int(rng.integers(1, 5)) if t.is_quantized else int(rng.integers(1, 300))
        M, N = int(rng.integers(1, 40)), int(rng.choice([1, 2, 3, 5, 8, 17]))
        batch = (int(rng.integers(1, 3)), 1)
        bcast = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        got, want = _ggml_mul_mat_check(100 * trial + 7, t, K, M, N, layout, batch, bcast, n_threads=1 + trial % 2)
        err = nmse(got, want)
        assert err <= 1e-10, f"{t.name} {layout} K={K} M={M} N={N}: NMSE {err:.3g} against ggml"


@pytest.mark.oracle
@pytest.mark.parametrize("t", WEIGHTS, ids=lambda t: t.name)
@pytest.mark.parametrize("layout", ["contig", "padded", "permuted"])
def test_cuda_emulated_mul_mat_matches_ggml(t, layout):
    rng = np.random.default_rng(hash((t.name, layout, "cuda")) % 2**32)
    for trial in range(2):
        K = t.blck_size * int(rng.integers(1, 3)) if t.is_quantized else int(rng.integers(1, 100))
        M, N = int(rng.integers(1, 12)), int(rng.choice([1, 2, 5]))
        batch, bcast = (int(rng.integers(1, 3)), 1), (int(rng.integers(1, 3)), 1)
        got, want = _ggml_mul_mat_check(50 * trial + 3, t, K, M, N, layout, batch, bcast, be=_cuda_emu())
        err = nmse(got, want)
        assert err <= 1e-10, f"cuda-emu {t.name} {layout} K={K} M={M} N={N}: NMSE {err:.3g} against ggml"


@pytest.mark.oracle
@pytest.mark.parametrize("t", BLOCKS, ids=lambda t: t.name)
def test_block_mul_mat_is_bit_exact_with_ggml_avx2(t):
    """Same integer sums, same scale products, same 8 float lanes and horizontal sum as ggml's
    AVX2 vec_dot: identical bits (the build here and the ggml wheel are both AVX2). Types whose
    kernels put 8 weight rows in the lanes instead (cpu.own_order_types(): q8_0, q4_K and q6_K on
    AVX-512 VNNI + VBMI builds, q8_0 and q4_K on the other AVX2 builds)
    sum each row's blocks in one chain: the same integer sums and scale products, another f32
    order."""
    if not cpu.lib.mg_quant_simd():
        pytest.skip("this build of the kernels has no AVX2 path (MINIGRAPH_PORTABLE or another ISA): "
                    "results agree with ggml to f32 rounding only, checked by the NMSE tests")
    got, want = _ggml_mul_mat_check(3, t, 4 * t.blck_size if t.blck_size == 256 else 1024, 37, 6, "padded")
    if t.name in cpu.own_order_types():
        # f32 rounding of sums of 4 (q8_0: 32) blocks: a few ulps of the largest partial sums
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel <= 1e-6, f"{t.name}: largest difference {rel:.3g} of the largest output against ggml"
        return
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.oracle
@pytest.mark.parametrize("t", (q8_0, q4_0))
@pytest.mark.parametrize("backend", ["cpu", "cuda-emu"])
def test_src1_is_converted_the_way_ggml_mul_mat_does(t, backend):
    """ggml's x86 mul_mat quantizes src1 to q8_0 by 127/amax with ties to even, not with the
    file quantizer (1/(amax/127), ties away from zero). Values placed on a tie tell them apart."""
    b = Built(Context())
    K, M = 64, 4
    w = b.leaf(t, (K, M), rng=np.random.default_rng(5))
    # amax 127 makes both scales 1: x * 1 = 2.5 rounds to 2 (ties to even) or 3 (away from zero)
    row = np.full(K, 2.5, np.float32)
    row[::2] = -0.5
    row[0] = 127.0
    row[32] = 127.0
    x = b.leaf(f32, (K, 1), data=row.reshape(1, K))
    b.out(mg.mul_mat(w, x))
    got = run_built(b, _be(1) if backend == "cpu" else _cuda_emu())[0]
    want = run_in_ggml(b)[0]
    if backend == "cpu" and t.name not in cpu.own_order_types():
        assert np.array_equal(got, want), (got, want)
    else:   # the same integer sums, summed in another order (cuda; 8-row kernels): f32 rounding apart
        assert nmse(got, want) <= 1e-12, (got, want)


@pytest.mark.parametrize("t", WEIGHTS, ids=lambda t: t.name)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_mul_mat_is_batch_invariant(t, n_threads):
    """A src1 column's result is the same bits alone as inside a batch of 1..33 columns, at any
    thread count (each output is one dot product computed one way; src1 rows convert alone)."""
    rng = np.random.default_rng(11)
    K = 2 * t.blck_size if t.is_quantized else 96
    M, N = 45, 33
    wdata = rng.standard_normal((M, K)).astype(np.float32)
    wdata = wdata.astype(np.float16) if t == f16 else np.asarray(mg.quantize(wdata, t)).view(t.np_dtype).reshape(M, -1)
    x = rng.standard_normal((N, K)).astype(np.float32)
    cpu.lib.mg_set_chunking(0, 0)   # split every node into as many chunks as possible
    try:
        outs = {}
        for n in (1, 2, 7, N):
            be = _be(n_threads, idx=60)
            c = Context()
            ww = c.new_tensor_2d(t, K, M)
            xx = c.new_tensor_2d(f32, K, n)
            y = mg.mul_mat(ww, xx)
            y.set_output()
            g = mg.Graph().build_forward_expand(y)
            mg.alloc_ctx_tensors(c, be)
            ww.set(wdata)
            res = []
            for j0 in range(0, N - n + 1, n):
                xx.set(x[j0:j0 + n])
                be.graph_compute(g)
                res.append(y.numpy().reshape(n, M))
            outs[n] = np.concatenate(res)
        for n, o in outs.items():
            assert np.array_equal(o, outs[1][: len(o)]), f"{t.name}: batch of {n} differs from one column at a time"
    finally:
        cpu.lib.mg_set_chunking(-1, -1)


@pytest.mark.parametrize("t", WEIGHTS, ids=lambda t: t.name)
def test_mul_mat_row_result_does_not_depend_on_its_tile(t):
    """A weight row's outputs are the same bits whichever kernel computes it: dropping the first
    rows moves every row to another place in the row tiles (q4_K, q6_K: from an 8-row tile or
    panel to the one-row kernel and back), by 1, 3, 6, 17 and 30 columns (on AVX2, the 8-row kernels
    of q8_0 and q4_K transpose each block on the way below 4 columns and read packed panels from 4
    on; with AVX-512 VNNI + VBMI, q4_K reads packed panels from 8 columns on, q6_K from 24)."""
    rng = np.random.default_rng(12)
    K = 3 * t.blck_size if t.is_quantized else 80
    M = 27
    wdata = rng.standard_normal((M, K)).astype(np.float32)
    wdata = wdata.astype(np.float16) if t == f16 else np.asarray(mg.quantize(wdata, t)).view(t.np_dtype).reshape(M, -1)
    for n in (1, 3, 6, 17, 30):
        x = rng.standard_normal((n, K)).astype(np.float32)
        outs = []
        for skip in (0, 1, 3, 5):
            c = Context()
            ww = c.new_tensor_2d(t, K, M - skip)
            xx = c.new_tensor_2d(f32, K, n)
            y = mg.mul_mat(ww, xx)
            y.set_output()
            g = mg.Graph().build_forward_expand(y)
            be = _be(1, idx=61)
            mg.alloc_ctx_tensors(c, be)
            ww.set(wdata[skip:])
            xx.set(x)
            be.graph_compute(g)
            outs.append((skip, y.numpy().reshape(n, M - skip)))
        for skip, o in outs[1:]:
            assert np.array_equal(o, outs[0][1][:, skip:]), f"{t.name} by {n}: rows moved by {skip} changed bits"


@pytest.mark.oracle
@pytest.mark.parametrize("t", WEIGHTS, ids=lambda t: t.name)
@pytest.mark.parametrize("backend", ["cpu", "cuda-emu"])
def test_get_rows_matches_ggml_bit_for_bit(t, backend):
    rng = np.random.default_rng(2)
    for trial in range(3):
        b = Built(Context())
        K = t.blck_size * int(rng.integers(1, 4)) if t.is_quantized else int(rng.integers(1, 200))
        R, n = int(rng.integers(2, 30)), int(rng.integers(1, 40))
        a = b.leaf(t, (K, R), rng=rng)
        ids = b.leaf(i32, (n,), data=rng.integers(0, R, n))
        b.out(mg.get_rows(a, ids))
        got = run_built(b, _be(2) if backend == "cpu" else _cuda_emu())[0]
        want = run_in_ggml(b)[0]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{t.name} K={K}"


@pytest.mark.oracle
@pytest.mark.parametrize("t", (bf16, q8_0, q4_0), ids=lambda t: t.name)
@pytest.mark.parametrize("backend", ["cpu", "cuda-emu"])
def test_cpy_from_f32_matches_ggml_bytes(t, backend):
    rng = np.random.default_rng(4)
    for trial in range(3):
        b = Built(Context())
        K = 32 * int(rng.integers(1, 9))
        shape = (K, int(rng.integers(1, 20)), int(rng.integers(1, 3)))
        x = b.input(rng, f32, shape, "strided" if trial % 2 else "contig")
        dst = b.leaf(t, shape, rng=rng)
        b.out(mg.cpy(x, dst))
        got = run_built(b, _be(2) if backend == "cpu" else _cuda_emu())[0]
        want = run_in_ggml(b)[0]
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), f"{t.name} {shape}"


def test_type_table_covers_the_typed_ops_and_refusals_name_op_and_type():
    """The cpu backend runs every wide-typed node the op rules accept; the rules refuse the rest
    at build time, naming the op and the tensor's type."""
    be = cpu.CpuBackend(70)
    ctx = Context()
    for t in WEIGHTS:
        w = ctx.new_tensor_2d(t, 256, 4)
        assert be.runs(mg.mul_mat(w, ctx.new_tensor_2d(f32, 256, 2))), t
        assert be.runs(mg.get_rows(w, ctx.new_tensor_1d(i32, 3))), t
    for t in (bf16, q8_0, q4_0):
        assert be.runs(mg.cpy(ctx.new_tensor_2d(f32, 64, 2), ctx.new_tensor_2d(t, 64, 2))), t
    assert be.runs(mg.cast(ctx.new_tensor_2d(bf16, 64, 2), f32))
    with pytest.raises(OpError, match="MUL_MAT.*f16"):
        mg.mul_mat(ctx.new_tensor_2d(q4_k, 256, 4), ctx.new_tensor_2d(f16, 256, 2))
    with pytest.raises(OpError, match="SSM_CONV"):
        mg.ssm_conv(ctx.new_tensor_3d(q4_0, 32, 8, 1), ctx.new_tensor_2d(f32, 4, 8))


def test_cpu_runs_every_typed_case():
    """No typed op case is skipped on cpu: a type or op added to the cases without a cpu kernel
    fails here instead of skipping quietly."""
    from minigraph.testing.op_cases import missing_types
    be = _be(1)
    for case in _typed_cases():
        assert missing_types(case, be) is None, missing_types(case, be)
        built = case.make(np.random.default_rng(0))
        g = mg.Graph()
        for o in built.outs:
            g.build_forward_expand(o)
        for node in g.nodes:
            assert be.supports_op(node), f"{case.id}: {node.op} {node.label} not supported by cpu"


# -- the portable build: the scalar code paths (MINIGRAPH_PORTABLE=1, or a CPU without AVX2) ------

PORTABLE_SOURCES = ("quant_codec.c", "quant_matmul.c", "copy.c", "matmul.c", "index.c", "plan.c")


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory):
    """The block-type kernels built without -march (no AVX2: the portable C), with the executor and
    the files they need, loaded through cffi's ABI mode; records are filled by hand below."""
    import os
    import shutil
    import subprocess
    from cffi import FFI
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the portable kernels")
    here = os.path.dirname(cpu.__file__)
    so = str(tmp_path_factory.mktemp("portable") / "libmg_portable.so")
    cmd = [cc, "-O2", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-shared", "-fPIC",
           "-Wl,--no-undefined", *[os.path.join(here, f) for f in PORTABLE_SOURCES], "-o", so, "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
    ffi = FFI()
    with open(os.path.join(here, "mg_api.h")) as f:
        ffi.cdef(f.read())
    lib = ffi.dlopen(so)
    assert lib.mg_quant_simd() == 0
    codes = {ffi.string(lib.mg_op_name(i)).decode(): i for i in range(lib.mg_op_count())}
    return ffi, lib, codes


def _fill(ffi, ct, arr, code, ne, nb):
    ct.data = ffi.cast("char *", arr.ctypes.data)
    ct.ne = list(ne)
    ct.nb = list(nb)
    ct.type = code


@pytest.mark.oracle
@pytest.mark.parametrize("N", [1, 3], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("t", WEIGHTS, ids=lambda t: t.name)
def test_portable_build_matches_ggml(portable_lib, t, N):
    """mul_mat (the src1 conversion record, then MUL_MAT) and get_rows of the portable C against
    ggml: NMSE 1e-10 and bit for bit. By 1 column and by 3: the half types' converted rows differ
    (mg_work_type: half rows for a matrix x vector, f32-held ones by several columns)."""
    ffi, lib, codes = portable_lib
    rng = np.random.default_rng(9)
    tc = cpu._TYPE_CODES[t]
    K = 2 * t.blck_size if t.is_quantized else 77
    M = 11
    b = Built(Context())
    w = b.leaf(t, (K, M), rng=rng)
    x = b.leaf(f32, (K, N), rng=rng)
    b.out(mg.mul_mat(w, x))
    want = run_in_ggml(b)[0].reshape(N, M)
    wraw = np.ascontiguousarray(b.data[w]).view(np.uint8).reshape(M, -1)
    xs = np.ascontiguousarray(b.data[x], np.float32).reshape(N, K)
    rs = wraw.shape[1]
    wt, wrow = lib.mg_work_type(tc, N), lib.mg_work_row_bytes(tc, K, N)
    work = np.zeros(N * wrow + 64, np.uint8)
    out = np.zeros((N, M), np.float32)
    recs = ffi.new("mg_node[2]")
    recs[0].op, recs[0].n_src = codes["MUL_MAT:src1_to_dot_type"], 1
    _fill(ffi, recs[0].src[0], xs, 0, (K, N, 1, 1), (4, 4 * K, 4 * K * N, 4 * K * N))
    _fill(ffi, recs[0].dst, work, wt, (K, N, 1, 1), (1, wrow, wrow * N, wrow * N))
    recs[1].op, recs[1].n_src = codes["MUL_MAT"], 2
    _fill(ffi, recs[1].src[0], wraw, tc, (K, M, 1, 1), (t.size, rs, rs * M, rs * M))
    recs[1].src[1] = recs[0].dst
    _fill(ffi, recs[1].dst, out, 0, (M, N, 1, 1), (4, 4 * M, 4 * M * N, 4 * M * N))
    err = ffi.new("mg_error *")
    assert lib.mg_plan_run(recs, 2, 2, err) == 0
    assert nmse(out, want) <= 1e-10, f"portable {t.name}: NMSE {nmse(out, want):.3g}"

    idx = np.array([M - 1, 0, 3], np.int32)
    rows = np.zeros((3, K), np.float32)
    g = ffi.new("mg_node[1]")
    g[0].op, g[0].n_src = codes["GET_ROWS"], 2
    _fill(ffi, g[0].src[0], wraw, tc, (K, M, 1, 1), (t.size, rs, rs * M, rs * M))
    _fill(ffi, g[0].src[1], idx, 2, (3, 1, 1, 1), (4, 12, 12, 12))
    _fill(ffi, g[0].dst, rows, 0, (K, 3, 1, 1), (4, 4 * K, 12 * K, 12 * K))
    assert lib.mg_plan_run(g, 1, 1, err) == 0
    gb = Built(Context())
    ga = gb.leaf(t, (K, M), data=b.data[w])
    gb.out(mg.get_rows(ga, gb.leaf(i32, (3,), data=idx)))
    assert np.array_equal(rows.view(np.uint32), run_in_ggml(gb)[0].reshape(3, K).view(np.uint32))
