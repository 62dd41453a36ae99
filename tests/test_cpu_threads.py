"""The CPU executor's threads (backends/cpu/plan.c): results bit-identical whatever the thread
count and the chunking (every op case, every node split into many chunks that threads claim
dynamically), index checks that stop a split run before the node writes, the pool surviving
errors, alternating thread counts and concurrent callers; set_n_threads' bad input."""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import CASES, Built, missing_types, run_built
from minigraph.testing.other_load import OtherLoad
from minigraph.tensor import Context

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)


@pytest.fixture
def split_everything():
    """Every node split into 4 chunks per thread (the op table's shapes are below the default
    threshold, where nodes run on one thread)."""
    cpu.lib.mg_set_chunking(0, 0)
    yield
    cpu.lib.mg_set_chunking(-1, -1)


def _bits(arrs):
    return [np.ascontiguousarray(a).view(np.uint8).tobytes() for a in arrs]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_case_is_bit_identical_at_any_thread_count(case, split_everything):
    if missing_types(case, cpu.CpuBackend):
        pytest.skip(missing_types(case, cpu.CpuBackend))
    want = _bits(run_built(case.make(np.random.default_rng(5)), cpu.CpuBackend(300).set_n_threads(1)))
    for n in (2, 3, 5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # 3 and 5 may exceed the cores
            be = cpu.CpuBackend(300 + n).set_n_threads(n)
        got = _bits(run_built(case.make(np.random.default_rng(5)), be))
        assert got == want, f"{case.id}: {n} threads differ from 1"


def _chain(ctx, n=4096):
    """big elementwise nodes (split across threads) around a GET_ROWS with checked indices"""
    a = ctx.new_tensor_2d(mg.f32, n, 8).set_name("a")
    ids = ctx.new_tensor_1d(mg.i32, 4).set_name("ids")
    h = mg.scale(mg.silu(a), 0.5)
    rows = mg.get_rows(h, ids)
    out = mg.add(mg.exp(rows), rows).set_name("out")
    return a, ids, out


@pytest.mark.parametrize("n_threads", [2, 4])
def test_a_failed_index_check_stops_a_split_run_and_the_pool_keeps_working(n_threads, split_everything):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        be = cpu.CpuBackend(310 + n_threads).set_n_threads(n_threads)
    ctx = Context()
    a, ids, out = _chain(ctx)
    mg.alloc_ctx_tensors(ctx, be)
    x = np.random.default_rng(0).standard_normal((8, 4096)).astype(np.float32)
    a.set(x)
    gf = mg.Graph().build_forward_expand(out.set_output())
    for bad in (8, -1, 100):
        ids.set(np.array([0, bad, 2, 3], np.int32))
        with pytest.raises(mg.OpError, match=rf"GET_ROWS .*index {bad} in 'ids' is out of range \[0, 8\)"):
            be.graph_compute(gf)
    ids.set(np.array([7, 0, 3, 3], np.int32))
    be.graph_compute(gf)
    want = run_built_like(x, [7, 0, 3, 3])
    assert np.array_equal(out.numpy(), want)


def _long_chain(n_nodes, x, backends):
    """A chain of n_nodes split nodes (adds and scales over [16, 4096] from x), built, allocated and
    run once on each backend: [(backend, graph, out)]."""
    runs = []
    for be in backends:
        ctx = Context()
        a = ctx.new_tensor_2d(mg.f32, 4096, 16).set_name("a")
        h = a
        for i in range(n_nodes):
            h = mg.scale(h, 1.0 + 1e-4 * (i % 7)) if i % 2 else mg.add(h, a)
        mg.alloc_ctx_tensors(ctx, be)
        a.set(x)
        gf = mg.Graph().build_forward_expand(h.set_output())
        be.graph_compute(gf)
        runs.append((be, gf, h))
    return runs


def _chain_1t_2t(n_nodes, seed, backend_id):
    """_long_chain from a seeded x on a 1-thread backend (the expected result) and a 2-thread one:
    (want, the 2-thread backend, its graph, its out)."""
    x = np.random.default_rng(seed).standard_normal((16, 4096)).astype(np.float32)
    runs = _long_chain(n_nodes, x, [cpu.CpuBackend(backend_id).set_n_threads(1),
                                    cpu.CpuBackend(backend_id + 1).set_n_threads(2)])
    return (runs[0][2].numpy(), *runs[1])


def _pool_stats() -> list:
    st = cpu.ffi.new("int64_t[6]")
    cpu.lib.mg_pool_stats(st)
    return list(st)


def run_built_like(x, ids):
    be = cpu.CpuBackend(320).set_n_threads(1)
    ctx = Context()
    a, i, out = _chain(ctx)
    mg.alloc_ctx_tensors(ctx, be)
    a.set(x)
    i.set(np.array(ids, np.int32))
    be.graph_compute(mg.Graph().build_forward_expand(out.set_output()))
    return out.numpy()


def test_alternating_thread_counts_and_graphs_stay_exact():
    """Many short runs, thread counts switching between runs (workers late for one run must not
    touch the next), two graphs of different sizes, default chunking (large nodes split)."""
    x = np.random.default_rng(1).standard_normal((8, 4096)).astype(np.float32)
    want = run_built_like(x, [1, 2, 3, 4])
    bes = [cpu.CpuBackend(330 + n).set_n_threads(n) for n in (1, 2)]
    graphs = []
    for be in bes:
        ctx = Context()
        a, ids, out = _chain(ctx)
        mg.alloc_ctx_tensors(ctx, be)
        a.set(x)
        ids.set(np.array([1, 2, 3, 4], np.int32))
        graphs.append((be, mg.Graph().build_forward_expand(out.set_output()), out))
    for i in range(300):
        be, gf, out = graphs[i % 3 % 2]
        be.graph_compute(gf)
        assert np.array_equal(out.numpy(), want), i


def test_concurrent_callers_get_exact_results():
    """Two Python threads computing at once (cffi releases the GIL): one holds the pool, the other
    runs on its own thread; both exact."""
    x = np.random.default_rng(2).standard_normal((8, 4096)).astype(np.float32)
    want = run_built_like(x, [5, 6, 7, 0])
    errors = []

    def worker(k):
        try:
            be = cpu.CpuBackend(340 + k).set_n_threads(2)
            ctx = Context()
            a, ids, out = _chain(ctx)
            mg.alloc_ctx_tensors(ctx, be)
            a.set(x)
            ids.set(np.array([5, 6, 7, 0], np.int32))
            gf = mg.Graph().build_forward_expand(out.set_output())
            for _ in range(200):
                be.graph_compute(gf)
                if not np.array_equal(out.numpy(), want):
                    errors.append(k)
                    return
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


# -- set_n_threads -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, -8, 2.5, "2", None, True])
def test_set_n_threads_refuses_non_positive_and_non_integers_in_one_line(bad):
    with pytest.raises(ValueError) as ei:
        cpu.CpuBackend(350).set_n_threads(bad)
    msg = str(ei.value)
    assert "\n" not in msg and "n_threads" in msg


def test_more_threads_than_cores_is_allowed_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu, "_oversubscribed_warned", False)
    cores = cpu._cores()
    be = cpu.CpuBackend(351)
    with pytest.warns(RuntimeWarning, match=rf"n_threads {cores + 1} is more than the {cores} cores"):
        be.set_n_threads(cores + 1)
    assert be.n_threads == cores + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu.CpuBackend(352).set_n_threads(cores + 3)   # once per process
        be.set_n_threads(cores)


def test_default_is_every_core_this_process_may_use():
    import os
    assert cpu.CpuBackend.n_threads == len(os.sched_getaffinity(0))
    assert cpu.CpuBackend(353).set_n_threads(np.int64(2)).n_threads == 2


def _one_node_run(make, n_threads, backend_id):
    """the graph make(built, rng) -> out (leaves: seeded random data) run by run_built on a backend of
    n_threads: (its result, the pool's parallel-run count that the compute added)."""
    b = Built(Context())
    b.out(make(b, np.random.default_rng(7)))
    before = _pool_stats()[0]
    got = run_built(b, cpu.CpuBackend(backend_id).set_n_threads(n_threads))
    return got[0], _pool_stats()[0] - before


def _silu_run(n_cols, n_threads, backend_id):
    """silu over [n_cols, 8] floats (cost 64 bytes a column: read and written)"""
    return _one_node_run(lambda b, rng: mg.silu(b.leaf(mg.f32, (n_cols, 8), rng=rng)), n_threads, backend_id)


def test_a_plan_with_little_split_work_runs_on_the_callers_thread():
    """A node above the split threshold is split, but a plan whose split nodes add up to less than
    1.5 x that threshold runs on one thread: a parallel run would cost more than it saves. With the
    threshold at 100,000 bytes-equivalent: 128,000 (one node) stays serial, 256,000 goes parallel,
    and both give the 1-thread bits."""
    cpu.lib.mg_set_chunking(100_000, 16 << 10)
    try:
        for n_cols, parallel in ((2000, 0), (4000, 1)):
            want, _ = _silu_run(n_cols, 1, 380)
            got, runs = _silu_run(n_cols, 2, 381)
            assert runs == parallel, (n_cols, runs)
            assert np.array_equal(got, want)
    finally:
        cpu.lib.mg_set_chunking(-1, -1)


@pytest.mark.parametrize("k, m, n, parallel", [(64, 128, 64, 0), (64, 64, 64, 0), (512, 512, 64, 1), (4096, 256, 1, 1)])
def test_small_products_stay_whole_and_matrix_by_vector_splits(k, m, n, parallel):
    """Default chunking: a product of more than 4 columns counts its multiply-adds at 1/8 (they
    are the work, and its operands sit in the caller's cache), so 64 x 128 by 64 runs whole;
    512 x 512 by 64 splits, and so does a matrix of 4 MiB by one vector (the weights stream from
    memory). Each gives the 1-thread bits."""
    def make(b, rng):
        return mg.mul_mat(b.leaf(mg.f32, (k, m), rng=rng), b.leaf(mg.f32, (k, n), rng=rng))
    want, _ = _one_node_run(make, 1, 382)
    got, runs = _one_node_run(make, 2, 383)
    assert runs == parallel, runs
    assert np.array_equal(got, want)


def test_split_nodes_between_one_chunk_nodes_stay_exact():
    """Default chunking: split nodes ([16, 4096] adds and scales) with one-chunk nodes (a [16, 64]
    slice's exp and a sum of its rows) between them, each reading the one before. The workers skip
    the one-chunk nodes and wait only for the node before the next split one; the results stay
    those of one thread, run after run."""
    x = np.random.default_rng(11).standard_normal((16, 4096)).astype(np.float32)
    outs = []
    for n, bid in ((1, 390), (2, 391)):
        be = cpu.CpuBackend(bid).set_n_threads(n)
        ctx = Context()
        a = ctx.new_tensor_2d(mg.f32, 4096, 16).set_name("a")
        h = a
        for i in range(12):
            h = mg.add(h, a) if i % 2 else mg.scale(h, 1.0 + 1e-3 * i)          # split
            small = mg.exp(mg.view_2d(h, 64, 16, h.nb[1], 4 * 64 * (i % 8)))     # one chunk
            h = mg.add(h, mg.sum_rows(mg.scale(small, 1e-3)))                     # split, after them
        mg.alloc_ctx_tensors(ctx, be)
        a.set(x)
        gf = mg.Graph().build_forward_expand(h.set_output())
        got = []
        for _ in range(30):
            be.graph_compute(gf)
            got.append(h.numpy().tobytes())
        outs.append(got)
    assert all(g == outs[0][0] for g in outs[0])
    assert all(g == outs[0][0] for g in outs[1])


def test_a_forked_child_starts_its_own_workers():
    """the pool's threads do not survive fork(): the child must start new ones, not wait on ghosts"""
    import os
    x = np.random.default_rng(3).standard_normal((8, 4096)).astype(np.float32)
    want = run_built_like(x, [0, 1, 2, 3])
    be = cpu.CpuBackend(360).set_n_threads(2)
    ctx = Context()
    a, ids, out = _chain(ctx)
    mg.alloc_ctx_tensors(ctx, be)
    a.set(x)
    ids.set(np.array([0, 1, 2, 3], np.int32))
    gf = mg.Graph().build_forward_expand(out.set_output())
    be.graph_compute(gf)               # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            cpu.lib.mg_set_chunking(0, 0)
            for _ in range(20):
                be.graph_compute(gf)
            code = 0 if np.array_equal(out.numpy(), want) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_worker_descheduled_holding_a_chunk_is_a_stall_and_results_stay_exact(split_everything):
    """A worker that sleeps 20 ms in every chunk it claims: the caller detects the stall, finishes
    the run alone, keeps the next runs on its own thread for a while (backoff), and every result is
    exact. (Skipped when the worker never takes a chunk: on a loaded machine it may not get a CPU
    in time.)"""
    x = np.random.default_rng(4).standard_normal((8, 4096)).astype(np.float32)
    want = run_built_like(x, [3, 1, 4, 1])
    be = cpu.CpuBackend(370).set_n_threads(2)
    ctx = Context()
    a, ids, out = _chain(ctx)
    mg.alloc_ctx_tensors(ctx, be)
    a.set(x)
    ids.set(np.array([3, 1, 4, 1], np.int32))
    gf = mg.Graph().build_forward_expand(out.set_output())
    be.graph_compute(gf)
    st = cpu.ffi.new("int64_t[6]")
    cpu.lib.mg_pool_stats(st)
    before = list(st)
    import time
    cpu.lib.mg_debug_worker_delay(20_000_000)
    try:
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end:
            be.graph_compute(gf)
            assert np.array_equal(out.numpy(), want)
            cpu.lib.mg_pool_stats(st)
            if st[2] > before[2] and st[1] > before[1]:
                break
    finally:
        cpu.lib.mg_debug_worker_delay(0)
    parallel, serial, stalls, _, worker_chunks, _ = (y - x for x, y in zip(before, st))
    if worker_chunks == 0:  # pragma: no cover - the worker never got a chunk (a loaded machine)
        pytest.skip("the worker took no chunk in 3 s")
    assert stalls >= 1 and serial >= 1, (parallel, serial, stalls)
    be.graph_compute(gf)
    assert np.array_equal(out.numpy(), want)


def test_a_long_run_that_went_solo_takes_its_workers_back_after_the_backoff(split_everything):
    """One long run (a chain of 1500 split nodes): a worker sleeps 20 ms in the first chunks it
    claims, the caller detects the stall and runs alone, and once the backoff (a few ms) is over
    the nodes left are published again and the worker, no longer delayed, takes chunks in the same
    run; the result stays exact. (Skipped when the worker takes no chunk: on a loaded machine it
    may not get a CPU in time.)"""
    import threading
    import time
    want, be2, gf, out = _chain_1t_2t(1500, 9, 380)      # the plan is built outside the timing
    for _ in range(10):                                   # a run with no stall first: no backoff left
        be2.graph_compute(gf)
    st = cpu.ffi.new("int64_t[6]")
    cpu.lib.mg_pool_stats(st)
    before = list(st)
    cpu.lib.mg_debug_worker_delay(20_000_000)
    stop = threading.Timer(0.01, lambda: cpu.lib.mg_debug_worker_delay(0))   # only the run's start
    stop.start()
    try:
        t0 = time.perf_counter()
        be2.graph_compute(gf)
        wall = time.perf_counter() - t0
    finally:
        stop.cancel()
        cpu.lib.mg_debug_worker_delay(0)
    cpu.lib.mg_pool_stats(st)
    parallel, serial, stalls, _, worker_chunks, _ = (y - x for x, y in zip(before, st))
    assert np.array_equal(out.numpy(), want)
    if worker_chunks == 0:  # pragma: no cover - the worker never got a chunk (a loaded machine)
        pytest.skip("the worker took no chunk")
    # the stall ended a segment and the rest was published again (two or more segments counted
    # as parallel runs), and the worker came back for more than its delayed chunks
    assert stalls >= 1 and parallel >= 2 and worker_chunks > 2, (parallel, serial, stalls, worker_chunks, wall)


def test_a_worker_woken_on_the_callers_cpu_moves_off_it_and_runs_chunks(split_everything):
    """A futex wake puts a worker on the caller's CPU whenever the other CPU looks busy; the worker
    then moves to another CPU it may use and runs its share, instead of leaving the run to the
    caller. Simulated: the caller's thread pinned to one CPU, and each worker pinning itself to
    that same CPU as it joins a run (a run of 1000 split nodes, long enough for the scheduler to
    let the pinned worker in beside the caller). Results stay exact; the pool counts the moves."""
    import os
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:  # pragma: no cover - a one-CPU machine or cpuset
        pytest.skip(f"this process may use only CPU {cpus}: there is nowhere to move")
    want, be, gf, out = _chain_1t_2t(1000, 6, 390)       # run once: the workers exist, free to use every CPU
    before = _pool_stats()
    others = OtherLoad()
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})                    # this thread only
    cpu.lib.mg_debug_worker_cpu(cpus[0])
    try:
        # 5 runs show it on a quiet machine; while other processes hold the other CPUs the pool
        # may run solo for a while (its backoff), so up to 40 are given
        for i in range(40):
            be.graph_compute(gf)
            assert np.array_equal(out.numpy(), want)
            parallel, _, _, _, worker_chunks, moves = (y - x for x, y in zip(before, _pool_stats()))
            if i >= 4 and parallel >= 1 and moves >= 1 and worker_chunks >= 1:
                break
    finally:
        cpu.lib.mg_debug_worker_cpu(-1)
        os.sched_setaffinity(0, own)
    if parallel == 0:       # no run took a worker at all: a bug, or the other CPUs were not free
        busy = others.cores()
        if busy is not None and busy > 0.5 * (len(cpus) - 1):  # pragma: no cover - a loaded machine
            pytest.skip(f"other processes kept {busy:.1f} of the other {len(cpus) - 1} CPUs busy during the runs: "
                        f"no worker joined")
    assert parallel >= 1 and moves >= 1 and worker_chunks >= 1, (parallel, worker_chunks, moves)


def test_a_long_run_that_starts_inside_a_backoff_takes_its_workers_after_it(split_everything):
    """The last run ended solo and left 5 ms of its backoff: the next run, 1500 split nodes (tens of
    ms), runs alone only until the backoff has passed, then the workers join the nodes left (it
    once ran all of a 1.9 s prefill on one thread); the result stays exact."""
    want, be, gf, out = _chain_1t_2t(1500, 11, 395)
    before = _pool_stats()
    cpu.lib.mg_debug_backoff_left(5_000_000)
    be.graph_compute(gf)
    parallel, serial, _, _, worker_chunks, _ = (y - x for x, y in zip(before, _pool_stats()))
    assert np.array_equal(out.numpy(), want)
    assert serial == 1 and parallel >= 1, (parallel, serial, worker_chunks)
    if worker_chunks == 0:  # pragma: no cover - the worker never got a chunk (a loaded machine)
        pytest.skip("the worker took no chunk after the backoff")
