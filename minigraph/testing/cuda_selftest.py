"""Checks of the CUDA backend against the reference, shared by the GPU tests
(tests/test_cuda_backend.py, real device) and the emulator tests (tests/test_cuda_compile.py,
the same kernels on the CPU). Each takes ``make_backend``: a function returning a fresh backend.

Beyond the op table (minigraph.testing.op_cases.CASES), EXTRA_CASES reach the code paths the table's small
shapes do not: state dims that need 4 or 32 values per lane, the any-width conv kernel, tiled
transposes with partial tiles, and write-through ops whose source overlaps their destination."""
from __future__ import annotations

import re

import numpy as np

import minigraph as mg
from minigraph.errors import OpError
from minigraph.testing.op_cases import Built, Case, compare, run_built
from minigraph.tensor import Context
from minigraph.types import f16, f32, i32, i64

SEEDS = (0, 1, 2)


def ref_backend():
    return type(mg.backend("ref"))()


def run_case(case: Case, seed: int, make_backend) -> str | None:
    """None when the backend agrees with the reference (and wrote nothing outside its tensors)."""
    be = make_backend()
    be.guard = 64
    graphs = []
    built = case.make(np.random.default_rng(seed))
    actual = run_built(built, be, graph_hook=graphs.append)
    if not be.guards_intact(graphs[0]):
        return f"{case.id} seed {seed}: a kernel wrote outside its tensor"
    expected = run_built(case.make(np.random.default_rng(seed)), ref_backend())
    err = compare(case, built, actual, expected)
    return None if err is None else f"{case.id} seed {seed} on {be.name}: {err}"


# ---------------------------------------------------------------------------------------------
# extra cases

EXTRA_CASES: list[Case] = []


def _extra(op, name, exact=False, nmse=1e-7):
    def deco(fn):
        EXTRA_CASES.append(Case(op, name, fn, exact, nmse, ggml=False))
        return fn
    return deco


def _scan(rng, d_state, K, n_t):
    b = Built(Context())
    head_dim, n_group, n_head, n_seqs = 2, 1, 2, 2
    rows = n_seqs + 1
    s = b.leaf(f32, (d_state, head_dim, n_head, rows), rng=rng)
    x = b.leaf(f32, (head_dim, n_head, n_t, n_seqs), rng=rng)
    dt = b.leaf(f32, (n_head, n_t, n_seqs), data=rng.uniform(-3, 3, (n_seqs, n_t, n_head)))
    A = b.leaf(f32, (1, n_head), data=-rng.uniform(0.1, 1.0, (n_head, 1)))
    B = b.leaf(f32, (d_state, n_group, n_t, n_seqs), rng=rng)
    C = b.leaf(f32, (d_state, n_group, n_t, n_seqs), rng=rng)
    ids = b.leaf(i32, (n_seqs,), data=rng.permutation(rows)[:n_seqs])
    b.out(mg.ssm_scan(s, x, dt, A, B, C, ids, K))   # K > n_t: the unwritten slots must read 0
    return b


@_extra("SSM_SCAN", "d_state_100_4_per_lane", nmse=1e-10)
def _(rng):
    return _scan(rng, 100, 3, 2)


@_extra("SSM_SCAN", "d_state_300_32_per_lane", nmse=1e-10)
def _(rng):
    return _scan(rng, 300, 1, 2)


def _gdn(rng, S, K, T):
    b = Built(Context())
    H, n_seqs = 2, 1

    def unit_rows(shape):
        v = rng.uniform(-1, 1, shape)
        return v / np.linalg.norm(v, axis=-1, keepdims=True)
    q = b.leaf(f32, (S, 1, T, n_seqs), data=unit_rows((n_seqs, T, 1, S)))
    k = b.leaf(f32, (S, 1, T, n_seqs), data=unit_rows((n_seqs, T, 1, S)))
    v = b.leaf(f32, (S, H, T, n_seqs), rng=rng)
    g = b.leaf(f32, (S, H, T, n_seqs), data=-rng.uniform(0.01, 1.0, (n_seqs, T, H, S)))
    beta = b.leaf(f32, (1, H, T, n_seqs), data=rng.uniform(0.1, 0.9, (n_seqs, T, H, 1)))
    st = b.leaf(f32, (S, S, H, n_seqs), rng=rng)
    b.out(mg.gated_delta_net(q, k, v, g, beta, st, K))
    return b


@_extra("GATED_DELTA_NET", "S_40_4_per_lane", nmse=1e-10)
def _(rng):
    return _gdn(rng, 40, 3, 2)


@_extra("GATED_DELTA_NET", "S_130_32_per_lane", nmse=1e-10)
def _(rng):
    return _gdn(rng, 130, 1, 2)


@_extra("SSM_CONV", "d_conv_40_any_width", nmse=1e-12)
def _(rng):
    b = Built(Context())
    d_conv, d_inner, n_t, n_s = 40, 5, 3, 2
    x = b.leaf(f32, (d_conv - 1 + n_t, d_inner, n_s), rng=rng)
    c = b.leaf(f32, (d_conv, d_inner), rng=rng)
    b.out(mg.ssm_conv(x, c))
    return b


@_extra("SSM_CONV", "partial_tiles", nmse=1e-12)
def _(rng):
    b = Built(Context())
    d_conv, d_inner, n_t, n_s = 4, 70, 37, 2
    x = b.leaf(f32, (d_conv - 1 + n_t, d_inner, n_s), rng=rng)
    c = b.leaf(f32, (d_conv, d_inner), rng=rng)
    b.out(mg.ssm_conv(x, c))
    return b


for _t in (f16, f32, i64):
    @_extra("CONT", f"transposed_partial_tiles_{_t.name}", exact=True)
    def _(rng, _t=_t):
        b = Built(Context())
        x = b.leaf(_t, (45, 70, 2), rng=rng)
        b.out(mg.cont(mg.transpose(x)))
        b.out(mg.cont(mg.permute(x, 1, 2, 0, 3)))
        return b


@_extra("MUL_MAT", "partial_tiles_k_40", nmse=1e-10)
def _(rng):
    b = Built(Context())
    a = b.leaf(f32, (40, 19, 2, 1), rng=rng)
    x = b.leaf(f32, (40, 21, 4, 2), rng=rng)
    b.out(mg.mul_mat(a, x))
    return b


@_extra("CPY", "source_overlaps_destination", exact=True)
def _(rng):
    b = Built(Context())
    x = b.leaf(f32, (10, 3), rng=rng)
    src = mg.view_2d(x, 6, 3, x.nb[1], 0)
    dst = mg.view_2d(x, 6, 3, x.nb[1], 2 * 4)          # shifted by two elements: overlaps src
    b.out(mg.cpy(src, dst))
    b.out(x)
    return b


@_extra("ADD", "inplace_b_overlaps_a", exact=True)
def _(rng):
    b = Built(Context())
    x = b.leaf(f32, (8, 3), rng=rng)
    rows01 = mg.view_2d(x, 8, 2, x.nb[1], 0)
    rows12 = mg.view_2d(x, 8, 2, x.nb[1], x.nb[1])
    b.out(mg.add(rows01, rows12, inplace=True))
    b.out(x)
    return b


@_extra("SET_ROWS", "source_rows_of_the_destination", exact=True)
def _(rng):
    b = Built(Context())
    s = b.leaf(f32, (4, 6), rng=rng)
    src = mg.view_2d(s, 4, 2, s.nb[1], 0)                # rows 0 and 1 of s ...
    c = b.leaf(i64, (2,), data=[3, 0])                   # ... written to rows 3 and 0
    b.out(mg.set_rows(s, src, c))
    b.out(s)
    return b


@_extra("CPY", "transposed_source_strided_destination_f32_to_i32", exact=True)
def _(rng):
    b = Built(Context())
    src = b.leaf(f32, (5, 4), data=rng.uniform(-40, 40, (4, 5)))
    dst = b.leaf(i32, (7, 6), rng=rng)
    b.out(mg.cpy(mg.transpose(src), mg.view_2d(dst, 4, 5, dst.nb[1], 4)))
    b.out(dst)
    return b


# ---------------------------------------------------------------------------------------------
# errors and the scheduler

def _error_of(build, be):
    """(the OpError message or None, the arrays of the outs) after computing on be."""
    bt = build()
    try:
        run_built(bt, be)
        msg = None
    except OpError as e:
        msg = re.sub(r"#\d+", "#", str(e))   # tensor ids differ between builds
    return msg, [o.numpy() for o in bt.outs[1:]]


def check_bad_index_leaves_destination(make_backend):
    """A bad index raises mg.OpError with the reference's message, before anything is written."""
    rng = np.random.default_rng(0)
    dst0 = rng.uniform(-1, 1, (6, 4)).astype(np.float32)
    src0 = rng.uniform(-1, 1, (3, 4)).astype(np.float32)

    def set_rows(bad, itype):
        def build():
            b = Built(Context())
            dst = b.leaf(f32, (4, 6), data=dst0)
            src = b.leaf(f32, (4, 3), data=src0)
            c = b.leaf(itype, (3,), data=[1, bad, 2])
            b.out(mg.set_rows(dst, src, c))
            b.out(dst)
            return b
        return build

    def get_rows(bad):
        def build():
            b = Built(Context())
            a = b.leaf(f32, (4, 6), data=dst0)
            ids = b.leaf(i32, (3,), data=[0, bad, 5])
            b.out(mg.get_rows(a, ids))
            b.out(a)
            return b
        return build

    def ssm_scan(bad):
        def build():
            rng = np.random.default_rng(5)
            b = Built(Context())
            ds, hd, nh, nt, ns = 3, 2, 1, 2, 2
            s = b.leaf(f32, (ds, hd, nh, ns + 1), rng=rng)
            x = b.leaf(f32, (hd, nh, nt, ns), rng=rng)
            dt = b.leaf(f32, (nh, nt, ns), rng=rng)
            A = b.leaf(f32, (1, nh), data=[[-0.5]])
            B = b.leaf(f32, (ds, 1, nt, ns), rng=rng)
            C = b.leaf(f32, (ds, 1, nt, ns), rng=rng)
            ids = b.leaf(i32, (ns,), data=[0, bad])
            b.out(mg.ssm_scan(s, x, dt, A, B, C, ids, 1))
            b.out(s)
            return b
        return build

    problems = []
    builds = [(f"SET_ROWS {t.name} index {bad}", set_rows(bad, t)) for t in (i32, i64) for bad in (6, -1, 2 ** 40 if t == i64 else 7)]
    builds += [(f"GET_ROWS index {bad}", get_rows(bad)) for bad in (6, -3)]
    builds += [(f"SSM_SCAN ids {bad}", ssm_scan(bad)) for bad in (3, -1)]
    for what, build in builds:
        want, _ = _error_of(build, ref_backend())
        got, after = _error_of(build, make_backend())
        if want is None:
            problems.append(f"{what}: the reference raised nothing")
        elif got != want:
            problems.append(f"{what}: raised {got!r}, the reference {want!r}")
        for a, r in zip(after, _error_of(build, ref_backend())[1]):
            if not np.array_equal(a, r):
                problems.append(f"{what}: the destination changed although the op raised")
    return problems


def check_scheduler_copies(make_backend):
    """Weights on the device, an input on the host: the scheduler copies through get_bytes and
    set_bytes, and the result equals the reference's."""
    rng = np.random.default_rng(1)
    w_np = rng.uniform(-1, 1, (5, 8)).astype(np.float32)
    x_np = rng.uniform(-1, 1, (3, 8)).astype(np.float32)
    outs = []
    for on_device in (True, False):
        dev, host = (make_backend(), ref_backend()) if on_device else (ref_backend(), None)
        ctx = mg.Context()
        w = ctx.new_tensor_2d(f32, 8, 5)
        mg.alloc_ctx_tensors(ctx, dev)
        w.set(w_np)
        ctx2 = mg.Context()
        x = ctx2.new_tensor_2d(f32, 8, 3).set_input()
        z = mg.sum_rows(mg.silu(mg.mul_mat(w, x)))
        z.set_output()
        gf = mg.Graph()
        gf.build_forward_expand(z)
        if on_device:
            runner = mg.Scheduler([dev, host])
            runner.alloc_graph(gf)
        else:
            runner = dev
            mg.alloc_ctx_tensors(ctx2, dev)
        x.set(x_np)
        runner.graph_compute(gf)
        first = z.numpy()
        x.set(x_np * 2)
        runner.graph_compute(gf)     # computed again after the input changed
        outs.append((first, z.numpy()))
    (a1, a2), (r1, r2) = outs
    problems = []
    for a, r, what in ((a1, r1, "first"), (a2, r2, "second")):
        err = float(np.sum((a.astype(np.float64) - r) ** 2) / np.sum(r.astype(np.float64) ** 2))
        if not err <= 1e-10:
            problems.append(f"scheduler {what} compute: NMSE {err:.3g} against the reference")
    return problems


def check_strided_write_read(make_backend):
    """Tensor.set and Tensor.numpy through a permuted (non-contiguous) view go through kernels."""
    be = make_backend()
    ctx = mg.Context()
    x = ctx.new_tensor_3d(f32, 7, 5, 3)
    mg.alloc_ctx_tensors(ctx, be)
    base = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)
    x.set(base)
    v = mg.permute(x, 2, 0, 1, 3)        # ne (5, 3, 7): v[i0, i2, i1] = x[i2, i1, i0] in NumPy order
    got = v.numpy()
    problems = []
    if not np.array_equal(got, np.transpose(base, (2, 0, 1))):
        problems.append("reading a permuted view")
    v.set(-got)
    if not np.array_equal(x.numpy(), -base):
        problems.append("writing a permuted view")
    w = mg.view_2d(x, 3, 4, x.nb[1], 4)   # padded rows
    w.set(np.full((4, 3), 9, np.float32))
    want = -base.copy()
    want[0, :4, 1:4] = 9
    if not np.array_equal(x.numpy(), want):
        problems.append("writing a padded-row view")
    return problems
