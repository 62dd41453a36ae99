"""The CPU backend (C kernels through cffi) against the NumPy reference: every op case, several
seeds, 1 and 2 threads; guard bytes; index errors that leave the destination untouched; plan
reuse; f16 rounding; the fast paths at shapes larger than the op table's."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import CASES, Built, Case, compare, missing_types, run_built
from minigraph.registry import OPS
from minigraph.tensor import Context

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)

SEEDS = range(4)
REF = mg.backend("ref")


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}thr")
def be(request):
    b = mg.backend("cpu")
    old = b.n_threads
    b.set_n_threads(request.param)
    yield b
    b.n_threads = old


def _pair(make, seed):
    return make(np.random.default_rng(seed)), make(np.random.default_rng(seed))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case_matches_reference(case, be):
    if missing_types(case, be):
        pytest.skip(missing_types(case, be))
    for seed in SEEDS:
        b_cpu, b_ref = _pair(case.make, seed)
        out_cpu = run_built(b_cpu, be)
        out_ref = run_built(b_ref, REF)
        err = compare(case, b_cpu, out_cpu, out_ref)
        assert err is None, f"{case.id} seed {seed} ({be.n_threads} threads): {err}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_guard_bytes_intact(case):
    be = cpu.CpuBackend(7)
    if missing_types(case, be):
        pytest.skip(missing_types(case, be))
    be.guard = 64
    be.set_n_threads(2)
    graphs = []
    b = case.make(np.random.default_rng(123))
    run_built(b, be, graph_hook=graphs.append)
    assert be.guards_intact(graphs[0]), f"{case.id}: a kernel wrote outside its tensor"


def test_every_registered_op_has_a_kernel():
    compute_ops = {name for name, d in OPS.items() if not d.is_view}
    assert compute_ops == set(cpu.OP_CODES), compute_ops ^ set(cpu.OP_CODES)
    codes = {name: cpu.CpuBackend.op_code(name) for name in cpu.OP_CODES}
    assert len(set(codes.values())) == len(codes)


def test_missing_extension_says_how_to_rebuild(monkeypatch):
    monkeypatch.setattr(cpu, "lib", None)
    monkeypatch.setattr(cpu, "_IMPORT_ERROR", ImportError("no module named _kernels"))
    with pytest.raises(RuntimeError, match=r"pip install -e \."):
        cpu.CpuBackend(5)


def test_n_threads_setting(monkeypatch):
    import os
    import warnings
    b = cpu.CpuBackend(9)
    assert b.n_threads >= 1
    monkeypatch.setattr(cpu, "_oversubscribed_warned", False)
    with warnings.catch_warnings(record=True) as caught:     # more threads than cores: one warning
        warnings.simplefilter("always")
        assert b.set_n_threads(3).n_threads == 3
    assert len(caught) == (1 if len(os.sched_getaffinity(0)) < 3 else 0), [str(w.message) for w in caught]
    with pytest.raises(ValueError):
        b.set_n_threads(0)


# -- index errors ------------------------------------------------------------------------------

def _bytes_of(t):
    buf, offs = t.storage()
    return buf.mem.copy()


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("bad", [-1, 6, 1000])
def test_set_rows_bad_index_leaves_destination_untouched(n_threads, bad):
    be = cpu.CpuBackend(11).set_n_threads(n_threads)
    ctx = Context()
    dst = ctx.new_tensor_2d(mg.f32, 5, 6).set_name("slots")
    src = ctx.new_tensor_2d(mg.f32, 5, 3)
    idx = ctx.new_tensor_1d(mg.i64, 3).set_name("slot_order")
    out = mg.set_rows(dst, src, idx).set_name("store")
    mg.alloc_ctx_tensors(ctx, be)
    dst.set(np.arange(30, dtype=np.float32).reshape(6, 5))
    src.set(np.ones((3, 5), np.float32))
    idx.set(np.array([0, bad, 2], np.int64))
    before = _bytes_of(dst)
    gf = mg.Graph().build_forward_expand(out)
    with pytest.raises(mg.OpError, match=rf"SET_ROWS 'store': index {bad} in 'slot_order' is out of range \[0, 6\)"):
        be.graph_compute(gf)
    assert np.array_equal(_bytes_of(dst), before)
    # the same graph computes after the inputs are fixed
    idx.set(np.array([0, 4, 2], np.int64))
    be.graph_compute(gf)
    assert np.array_equal(dst.numpy()[4], np.ones(5, np.float32))


def test_get_rows_bad_index_raises_before_writing():
    be = cpu.CpuBackend(12)
    ctx = Context()
    a = ctx.new_tensor_2d(mg.f32, 4, 3)
    ids = ctx.new_tensor_1d(mg.i32, 2).set_name("ids")
    y = mg.get_rows(a, ids)
    z = mg.scale(y, 2.0).set_name("after")
    mg.alloc_ctx_tensors(ctx, be)
    a.set(np.ones((3, 4), np.float32))
    ids.set(np.array([1, 3], np.int32))
    gf = mg.Graph().build_forward_expand(z)
    with pytest.raises(mg.OpError, match=r"GET_ROWS .*index 3 in 'ids' is out of range \[0, 3\)"):
        be.graph_compute(gf)


def test_ssm_scan_bad_id_raises():
    be = cpu.CpuBackend(13)
    case = next(c for c in CASES if c.op == "SSM_SCAN")
    b = case.make(np.random.default_rng(0))
    out = b.outs[0]
    ids = out.srcs["ids"]
    rows = out.srcs["s"].ne[3]
    b.data[ids] = np.full_like(b.data[ids], rows)
    with pytest.raises(mg.OpError, match=rf"SSM_SCAN .*index {rows} in .* is out of range \[0, {rows}\)"):
        run_built(b, be)


# -- plans --------------------------------------------------------------------------------------

def test_plan_is_built_once_and_reused_with_new_inputs():
    be = cpu.CpuBackend(14).set_n_threads(2)
    ctx = Context()
    x = ctx.new_tensor_2d(mg.f32, 8, 3)
    w = ctx.new_tensor_2d(mg.f32, 8, 5)
    y = mg.silu(mg.mul_mat(w, x))
    y.set_output()
    mg.alloc_ctx_tensors(ctx, be)
    rng = np.random.default_rng(0)
    gf = mg.Graph().build_forward_expand(y)
    results = []
    for _ in range(3):
        xv = rng.uniform(-1, 1, (3, 8)).astype(np.float32)
        wv = rng.uniform(-1, 1, (5, 8)).astype(np.float32)
        x.set(xv)
        w.set(wv)
        be.graph_compute(gf)
        expect = (xv.astype(np.float64) @ wv.T.astype(np.float64)).astype(np.float32)
        expect = expect / (1 + np.exp(-expect))
        np.testing.assert_allclose(y.numpy(), expect, rtol=1e-5, atol=1e-6)
        results.append(y.numpy())
    assert be.plans_built == 1
    plan = be.get_plan(gf.nodes, gf.cache)   # the plan lives in the graph's cache
    assert plan.runs == 3
    assert not np.array_equal(results[0], results[1])
    # a new graph (new node list) gets its own plan
    gf2 = mg.Graph().build_forward_expand(y)
    be.graph_compute(gf2)
    assert be.plans_built == 2


def test_a_graph_computed_again_takes_the_fast_path_until_memory_or_outputs_change():
    """graph_compute's fast path reruns the last records; a re-bound tensor or a newly flagged
    output sends it through the full path again, and an error on it reads as on the full path."""
    be = cpu.CpuBackend(14)
    ctx = Context()
    a = ctx.new_tensor_2d(mg.f32, 4, 3)
    ids = ctx.new_tensor_1d(mg.i32, 2).set_name("ids")
    y = mg.scale(mg.get_rows(a, ids), 2.0).set_name("y")
    z = mg.add(y, y).set_name("z").set_output()
    mg.alloc_ctx_tensors(ctx, be)
    a.set(np.arange(12, dtype=np.float32).reshape(3, 4))
    ids.set(np.array([2, 0], np.int32))
    gf = mg.Graph().build_forward_expand(z)
    be.graph_compute(gf)
    plan = be.get_plan(gf.nodes, gf.cache)
    assert ("rerun", be.name) in gf.cache
    ids.set(np.array([1, 1], np.int32))
    be.graph_compute(gf)                      # fast: the same plan ran again
    assert plan.runs == 2 and be.plans_built == 1
    np.testing.assert_array_equal(z.numpy(), 4 * np.arange(4, 8, dtype=np.float32)[None].repeat(2, 0))
    ids.set(np.array([1, 3], np.int32))
    with pytest.raises(mg.OpError, match=r"GET_ROWS .*index 3 in 'ids' is out of range \[0, 3\)"):
        be.graph_compute(gf)
    ids.set(np.array([0, 2], np.int32))
    y.set_output()                            # y must keep its memory now: planned again
    be.graph_compute(gf)
    np.testing.assert_array_equal(y.numpy(), 2 * np.arange(12, dtype=np.float32).reshape(3, 4)[[0, 2]])
    np.testing.assert_array_equal(z.numpy(), 2 * y.numpy())
    gf2 = mg.Graph().build_forward_expand(z)   # another graph binds y and z into its own buffer
    be.graph_compute(gf2)
    ids.set(np.array([1, 0], np.int32))
    be.graph_compute(gf)                      # so gf binds them back before it runs
    np.testing.assert_array_equal(z.numpy(), 4 * np.arange(12, dtype=np.float32).reshape(3, 4)[[1, 0]])


# -- conversions and fast paths at larger shapes ---------------------------------------------

def _run_pair(make):
    be = mg.backend("cpu")
    for n in (1, 2):
        be.set_n_threads(n)
        b1, b2 = make(), make()
        o1, o2 = run_built(b1, be), run_built(b2, REF)
        yield b1, o1, o2
    be.n_threads = type(be).n_threads


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_f32_to_f16_rounds_like_numpy():
    rng = np.random.default_rng(1)
    bits = np.concatenate([
        rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32),
        # every f16 rounding boundary region: halfway points and their neighbours
        ((np.arange(1 << 16, dtype=np.uint32) << 13)[:, None] + np.array([0, 1, 0xfff, 0x1000, 0x1001, 0x1fff], np.uint32)).ravel(),
        np.arange(0x33000000 - 4, 0x38800000 + 4, 97, dtype=np.uint32),   # the subnormal range
    ])
    vals = bits.view(np.float32)
    vals = vals[~np.isnan(vals)]

    def make():
        b = Built(Context())
        x = b.leaf(mg.f32, (vals.size,), data=vals)
        b.out(mg.cast(x, mg.f16))
        b.out(mg.cast(mg.cast(x, mg.f16), mg.f32))
        return b

    for b1, o1, o2 in _run_pair(make):
        assert np.array_equal(o1[0].view(np.uint16), o2[0].view(np.uint16))
        assert np.array_equal(o1[1].view(np.uint32), o2[1].view(np.uint32))


BIG = {
    "mul_mat_kblocks": (lambda rng, b: mg.mul_mat(b.input(rng, mg.f32, (1100, 37, 2)), b.input(rng, mg.f32, (1100, 9, 4))), 1e-10),
    "mul_mat_tiles": (lambda rng, b: mg.mul_mat(b.input(rng, mg.f32, (133, 70, 1)), b.input(rng, mg.f32, (133, 67, 1), "strided")), 1e-10),
    "mul_mat_vec": (lambda rng, b: mg.mul_mat(b.input(rng, mg.f32, (257, 130)), b.input(rng, mg.f32, (257, 1))), 1e-10),
    "ssm_conv_blocks": (lambda rng, b: mg.ssm_conv(b.input(rng, mg.f32, (3 + 150, 37, 2)), b.input(rng, mg.f32, (4, 37))), None),
    "ssm_conv_decode": (lambda rng, b: mg.ssm_conv(b.input(rng, mg.f32, (4, 4096, 4)), b.input(rng, mg.f32, (4, 4096))), None),
    # n_t <= 8 (8x8 tiles, masked tail) with partial channel blocks; an output of >= 4 MiB
    # (non-temporal stores, line-aligned channel blocks) with a time tail
    "ssm_conv_short": (lambda rng, b: mg.ssm_conv(b.input(rng, mg.f32, (3 + 7, 45, 3)), b.input(rng, mg.f32, (4, 45))), None),
    "ssm_conv_streamed": (lambda rng, b: mg.ssm_conv(b.input(rng, mg.f32, (3 + 300, 4096, 1)), b.input(rng, mg.f32, (4, 4096))), None),
    "cont_transposed": (lambda rng, b: mg.cont(b.input(rng, mg.f32, (130, 70, 2), "transposed")), None),
    "cont_transposed_f16": (lambda rng, b: mg.cont(b.input(rng, mg.f16, (65, 33), "transposed")), None),
    "cont_permuted": (lambda rng, b: mg.cont(b.input(rng, mg.f32, (20, 7, 6, 5), "permuted")), None),
    "cpy_contig_big": (lambda rng, b: mg.cast(b.input(rng, mg.f32, (50000, 3)), mg.f16), None),
    "concat_dim0": (lambda rng, b: mg.concat(b.input(rng, mg.f32, (3, 4096, 4)), b.input(rng, mg.f32, (5, 4096, 4)), 0), None),
    "rms_norm_wide": (lambda rng, b: mg.rms_norm(b.input(rng, mg.f32, (4096, 3)), 1e-5), 1e-12),
}


@pytest.mark.parametrize("name", sorted(BIG))
def test_fast_paths_at_larger_shapes(name):
    fn, tol = BIG[name]

    def make():
        b = Built(Context())
        b.out(fn(np.random.default_rng(5), b))
        return b

    case = Case("BIG", name, make, exact=tol is None, nmse=tol or 0.0)
    for b1, o1, o2 in _run_pair(make):
        err = compare(case, b1, o1, o2)
        assert err is None, f"{name}: {err}"


def test_an_input_written_again_after_a_new_allocation_lands_in_its_new_memory():
    # host backends keep an input's view between writes: it must follow the tensor's memory
    be = cpu.CpuBackend(15)
    ctx = Context()
    x = ctx.new_tensor_1d(mg.f32, 4).set_name("x").set_input()
    first = mg.alloc_ctx_tensors(ctx, be)
    x.set(np.arange(4, dtype=np.float32))
    other = be.alloc_buffer(128, "any")
    for buf, offs in ((other, 0), (other, 64)):
        x.buffer, x.offs = buf, offs
        x.set(np.full(4, offs + 7, np.float32))
        assert np.array_equal(buf.mem[offs:offs + 16].view(np.float32), np.full(4, offs + 7, np.float32))
    assert np.array_equal(first.mem[:16].view(np.float32), np.arange(4, dtype=np.float32))
