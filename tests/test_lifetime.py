"""Lifetime: graphs own their nodes. Rebuilding a graph 1,000 times leaves the number of live
tensors, live buffers and the process's resident memory flat, and dropping a graph frees its
nodes and its compute memory at once (no reference cycle waits for the garbage collector)."""
import gc
import os
import weakref

import numpy as np
import pytest

import minigraph as mg
from minigraph.backend import Buffer
from minigraph.models.runner import Runner
from minigraph.models.zoo import make_model

N_REBUILDS = 1000
WARM_UP = 100          # settle allocator pools and first-use caches
RSS_SLACK_MB = 8.0     # allocator noise; a leaking build grows by tens of MB over 900 rebuilds


def rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:       # not Linux: tensors and buffers are still counted
        return None


def census() -> dict:
    """Live minigraph tensors and buffers (after a full collection) and the resident set."""
    gc.collect()
    objs = gc.get_objects()
    return {"tensors": sum(isinstance(o, mg.Tensor) for o in objs),
            "buffers": sum(isinstance(o, Buffer) for o in objs), "rss_mb": rss_mb()}


def assert_flat(step, n: int, what: str):
    for _ in range(WARM_UP):
        step()
    before = census()
    for _ in range(n - WARM_UP):
        step()
    after = census()
    report = f"{what}: after {WARM_UP} rebuilds {before}, after {n} {after}"
    print(report)
    assert after["tensors"] <= before["tensors"] + 10, report
    assert after["buffers"] <= before["buffers"] + 2, report
    if before["rss_mb"] is not None:
        assert after["rss_mb"] <= before["rss_mb"] + RSS_SLACK_MB, report


@pytest.fixture
def cpus():
    """Two CPU devices of their own (one thread each: the machine is shared)."""
    devs = [mg.backend("cpu:6"), mg.backend("cpu:7")]
    threads = [d.n_threads for d in devs]
    for d in devs:
        d.set_n_threads(1)
    yield devs
    for d, n in zip(devs, threads):
        d.set_n_threads(n)


def test_delta_net_decoding_with_graph_reuse_off_stays_flat(cpus):
    # the model on one device, the inputs on a second (the host): every step also schedules
    # and copies the inputs across
    model = make_model("delta-net", cpus[:1], n_vocab=16, n_embd=16, n_layer=1, head_dim=8,
                       num_k_heads=1, num_v_heads=2, n_ff=16)
    runner = Runner(model, mem_size=1, reuse=False, backends=cpus)
    tokens = iter(range(10**9))

    def step():
        runner.decode_seq_tokens({0: [next(tokens) % 16]})

    assert_flat(step, N_REBUILDS, "delta-net decode, graph reuse off")
    assert runner.stats.builds == N_REBUILDS and runner.stats.reuses == 0
    assert runner.stats.copies[-1][0] > 0, "the inputs were expected to cross devices"
    # nodes never join the weights' or the memory's context
    assert all(t.op == "NONE" for t in model._named.values())
    assert all(t.ctx is None or all(u.op == "NONE" for u in t.ctx.tensors) for t in runner.memory.tensors())


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_plain_op_graph_rebuilds_stay_flat(device, cpus):
    be = cpus[0] if device == "cpu" else mg.backend("ref")
    ctx = mg.Context()
    w = ctx.new_tensor_2d(mg.f32, 8, 8).set_name("w")
    x = ctx.new_tensor_2d(mg.f32, 8, 3).set_name("x")
    mg.alloc_ctx_tensors(ctx, be)
    w.set(np.full((8, 8), 0.125, np.float32))
    x.set(np.ones((3, 8), np.float32))

    def step():
        y = mg.sum_rows(mg.silu(mg.scale(mg.mul_mat(w, x), 0.5))).set_output()
        gf = mg.Graph().build_forward_expand(y)
        be.graph_compute(gf)
        np.testing.assert_allclose(y.numpy().ravel(), np.full(3, 8 * 0.5 / (1 + np.exp(-0.5)), np.float32), rtol=1e-6)

    assert_flat(step, N_REBUILDS, f"plain graph on {device}")
    assert ctx.tensors == [w, x]


def _fresh_device(kind: str):
    """A device of its own, so that no other test's graph shares it."""
    if kind == "ref":
        return type(mg.backend("ref"))()
    if kind == "cpu":
        return type(mg.backend("cpu"))(11)
    from minigraph.backends.meta import MetaBackend
    return MetaBackend([type(mg.backend("cpu"))(12), type(mg.backend("cpu"))(13)])


@pytest.mark.parametrize("kind", ["ref", "cpu", "meta"])
def test_dropping_a_graph_frees_its_nodes_and_compute_memory_at_once(kind):
    # the CPU plan and the meta expansion live in the graph's cache, not in the device
    be = _fresh_device(kind)
    ctx = mg.Context()
    x = ctx.new_tensor_1d(mg.f32, 16)
    mg.alloc_ctx_tensors(ctx, be)
    x.set(np.arange(16, dtype=np.float32))
    h = mg.silu(mg.scale(x, 2.0))
    y = mg.sum_rows(mg.exp(h)).set_output()
    gf = mg.Graph().build_forward_expand(y)
    be.graph_compute(gf)
    refs = [weakref.ref(o) for o in (gf, h, y, y.buffer)]
    gc.disable()                          # freed by reference counting alone: no cycles
    try:
        del gf, h, y
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
    assert x.numpy()[3] == 3.0            # the leaf and its context live on


def test_a_scheduled_graph_is_freed_with_its_scheduler():
    devs = [type(mg.backend("ref"))(), type(mg.backend("ref"))()]
    devs[0].name, devs[1].name = "ref:a", "ref:b"
    w_ctx, x_ctx = mg.Context(), mg.Context()
    w = w_ctx.new_tensor_2d(mg.f32, 4, 4)
    x = x_ctx.new_tensor_2d(mg.f32, 4, 2).set_input()
    mg.alloc_ctx_tensors(w_ctx, devs[0])
    w.set(np.eye(4, dtype=np.float32))
    y = mg.silu(mg.mul_mat(w, x)).set_output()
    gf = mg.Graph().build_forward_expand(mg.scale(y, 1.0))
    sched = mg.Scheduler(devs)
    sg = sched.alloc_graph(gf)
    x.set(np.ones((2, 4), np.float32))
    sched.graph_compute(gf)
    assert sg.copies, "the test needs a cross-device copy"
    refs = [weakref.ref(o) for o in (gf, sg, y, next(iter(sg.copies.values())))]
    gc.disable()
    try:
        del gf, sg, y, sched
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
