"""Placement on cpu:1 + cpu:0 (cpu:0 last = host) with hand-computed expectations (ggml's scheduler passes)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import minigraph as mg

T = 3   # tokens
D = 8   # width


@pytest.fixture
def devs():
    return mg.backend("cpu:1"), mg.backend("cpu:0")


class Net:
    """Weights on given devices, an input x on the host; builds the same graph twice so a
    scheduled run can be compared with a single-device run."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.data = {}

    def weight(self, ctx, name, ne):
        t = ctx.new_tensor(mg.f32, ne).set_name(name)
        self.data.setdefault(name, self.rng.standard_normal(tuple(reversed(t.ne))).astype(np.float32))
        return t

    def fill(self, tensors):
        for t in tensors:
            t.set(self.data[t.name])


def chain(net, with_reuse=False, cache=False):
    w1, w0, inp = mg.Context(), mg.Context(), mg.Context()
    W1 = net.weight(w1, "W1", (D, D))
    W0 = net.weight(w0, "W0", (D, D))
    x = net.weight(inp, "x", (D, T)).set_input()
    leaves = [W1, W0, x]
    a = mg.mul_mat(W1, x).set_name("a")
    if with_reuse:
        W1b = net.weight(w1, "W1b", (D, D))
        leaves.append(W1b)
        b = mg.mul_mat(W0, a).set_name("b")
        c = mg.mul_mat(W1b, b).set_name("c")
        out = mg.add(c, x).set_name("out")
    else:
        s = mg.silu(a).set_name("s")
        m = mg.mul_mat(W0, s).set_name("m")
        out = mg.add(m, m).set_name("out")
    out.set_output()
    gf = mg.Graph().build_forward_expand(out)
    extra = {}
    if cache:
        cc = mg.Context()
        kv = net.weight(cc, "cache", (D, 6))
        idx = inp.new_tensor_1d(mg.i32, T).set_name("idx").set_input()
        net.data["idx"] = np.array([5, 0, 3], np.int32)
        store = mg.set_rows(kv, out, idx).set_name("store")
        gf.build_forward_expand(store)
        extra = {"cache_ctx": cc, "cache": kv, "idx": idx}
        leaves += [idx]
    return gf, (w1, w0, inp), leaves, out, extra


def run_scheduled(devs, build, pins=()):
    net = Net()
    gf, (w1, w0, inp), leaves, out, extra = build(net)
    mg.alloc_ctx_tensors(w1, devs[0])
    mg.alloc_ctx_tensors(w0, devs[1])
    if extra:
        mg.alloc_ctx_tensors(extra["cache_ctx"], devs[0], usage="any")
    sched = mg.Scheduler(list(devs))
    for name, d in pins:
        t = next(n for n in gf.nodes if n.name == name)
        sched.set_tensor_backend(t, d)
    sched.alloc_graph(gf)
    net.fill(leaves + ([extra["cache"]] if extra else []))
    sched.graph_compute(gf)
    result = [out.numpy()] + ([extra["cache"].numpy()] if extra else [])

    net2 = Net()
    gf2, ctxs2, leaves2, out2, extra2 = build(net2)
    one = mg.backend("cpu:0")          # the same kernels on one device: bit for bit
    for c in ctxs2 + ((extra2["cache_ctx"],) if extra2 else ()):
        mg.alloc_ctx_tensors(c, one)
    net2.fill(leaves2 + ([extra2["cache"]] if extra2 else []))
    one.graph_compute(gf2)
    expected = [out2.numpy()] + ([extra2["cache"].numpy()] if extra2 else [])
    return sched, gf, result, expected


def placement(rep):
    return {n.name: (n.device, n.cause) for n in rep.nodes if not n.is_view}


def test_chain_split_across_two_devices(devs):
    sched, gf, result, expected = run_scheduled(devs, lambda n: chain(n))
    rep = sched.placement_report()
    assert placement(rep) == {"a": ("cpu:1", "1.wgt0"), "s": ("cpu:1", "2.sup"),
                              "m": ("cpu:0", "1.wgt0"), "out": ("cpu:0", "2.sup")}
    assert rep.device_of("x") == "cpu:0"                      # graph inputs start on the host
    assert [(s.device, s.nodes, s.inputs) for s in rep.splits] == [
        ("cpu:1", ["a", "s"], ["x"]), ("cpu:0", ["m", "out"], ["s"])]
    assert [(c.tensor, c.src_device, c.dst_device, c.nbytes) for c in rep.copies] == [
        ("x", "cpu:0", "cpu:1", D * T * 4), ("s", "cpu:1", "cpu:0", D * T * 4)]
    for r, e in zip(result, expected):
        assert np.array_equal(r, e)


def test_pinned_node_stays_pinned(devs):
    sched, gf, result, expected = run_scheduled(devs, lambda n: chain(n), pins=[("s", devs[1])])
    rep = sched.placement_report()
    assert placement(rep)["s"] == ("cpu:0", "usr")
    assert [(s.device, s.nodes, s.inputs) for s in rep.splits] == [
        ("cpu:1", ["a"], ["x"]), ("cpu:0", ["s", "m", "out"], ["a"])]
    assert np.array_equal(result[0], expected[0])


def test_set_rows_into_cache_runs_where_the_cache_lives(devs):
    sched, gf, result, expected = run_scheduled(devs, lambda n: chain(n, cache=True))
    rep = sched.placement_report()
    assert placement(rep)["store"] == ("cpu:1", "1.dst")
    # the GPU-up sweep of pass 2 spreads store's (non-host) device back onto out
    assert placement(rep)["out"] == ("cpu:1", "2.sup")
    assert [(s.device, s.nodes, s.inputs) for s in rep.splits] == [
        ("cpu:1", ["a", "s"], ["x"]), ("cpu:0", ["m"], ["s"]), ("cpu:1", ["out", "store"], ["m", "idx"])]
    for r, e in zip(result, expected):
        assert np.array_equal(r, e)


def test_tensor_used_by_two_splits_on_one_device_is_copied_once(devs):
    sched, gf, result, expected = run_scheduled(devs, lambda n: chain(n, with_reuse=True))
    rep = sched.placement_report()
    assert [(s.device, s.nodes, s.inputs) for s in rep.splits] == [
        ("cpu:1", ["a"], ["x"]), ("cpu:0", ["b"], ["a"]), ("cpu:1", ["c", "out"], ["b"])]
    x_copy = next(c for c in rep.copies if c.tensor == "x")
    assert x_copy.used_by_splits == [0, 2] and x_copy.reused
    assert rep.n_copies == 3
    assert sched.scheduled.copy_stats() == (rep.n_copies, rep.copy_bytes) and rep.copy_bytes > 0
    assert "copied once, reused" in str(rep)
    assert np.array_equal(result[0], expected[0])


def test_report_json_networkx_and_dot(devs, tmp_path):
    sched, gf, _, _ = run_scheduled(devs, lambda n: chain(n))
    d = sched.placement_report().to_dict()
    json.dumps(d)
    assert {"nodes", "splits", "copies"} <= set(d)
    assert all({"name", "op", "device", "cause"} <= set(n) for n in d["nodes"])
    assert all({"tensor", "src_device", "dst_device", "nbytes"} <= set(c) for c in d["copies"])
    g = gf.to_networkx()
    assert all(attrs.get("device") for _, attrs in g.nodes(data=True))
    copy_edges = [e for e in g.edges(data=True) if e[2].get("copy")]
    assert len(copy_edges) == 2
    path = tmp_path / "g.dot"
    mg.draw(gf, str(path))
    text = path.read_text()
    assert "cpu:1" in text and "style=dashed" in text


def test_sched_debug_env_prints_splits():
    code = ("import minigraph as mg, numpy as np\n"
            "c=mg.Context(); w=c.new_tensor_2d(mg.f32,4,4); x=mg.Context(); xi=x.new_tensor_2d(mg.f32,4,2).set_input()\n"
            "mg.alloc_ctx_tensors(c, mg.backend('cpu:1'))\n"
            "y=mg.silu(mg.mul_mat(w, xi)); gf=mg.Graph().build_forward_expand(y)\n"
            "s=mg.Scheduler([mg.backend('cpu:1'), mg.backend('cpu:0')]); s.split_graph(gf)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "MINIGRAPH_SCHED_DEBUG": "2"})
    assert out.returncode == 0, out.stderr
    assert "## SPLIT #0: cpu:1 # 1 inputs" in out.stderr and "1.wgt0" in out.stderr


# -- a schedule is an object of its own: the graph is never patched ------------------------------

def silu_graph(be):
    ctx = mg.Context()
    a = ctx.new_tensor_1d(mg.f32, 4).set_name("a")
    dst = ctx.new_tensor_1d(mg.f32, 4).set_name("dst")
    mg.alloc_ctx_tensors(ctx, be, usage="any")
    a.set(np.array([-1, 0, 1, 2], np.float32))
    dst.set(np.zeros(4, np.float32))
    y = mg.silu(a).set_name("y")
    return ctx, a, dst, y, mg.Graph().build_forward_expand(y)


def silu_ref(x):
    return x / (1 + np.exp(-x))


def test_nodes_added_after_scheduling_are_computed(devs):
    _, a, dst, y, gf = silu_graph(devs[0])
    sched = mg.Scheduler(list(devs))
    first = sched.split_graph(gf)
    sched.graph_compute(gf)
    gf.build_forward_expand(mg.cpy(y, dst))       # the same graph grows after it was split
    assert not first.is_current
    second = sched.graph_compute(gf)              # scheduled again, not skipped
    assert second is not first and second.is_current and sched.scheduled is second
    np.testing.assert_allclose(dst.numpy(), silu_ref(a.numpy()), rtol=1e-6)
    assert [n.op for sp in second.splits for n in sp.nodes] == ["SILU", "CPY"]


def test_scheduling_leaves_the_graph_and_its_srcs_untouched(devs):
    net = Net()
    gf, (w1, w0, inp), leaves, out, _ = chain(net)
    mg.alloc_ctx_tensors(w1, devs[0])
    mg.alloc_ctx_tensors(w0, devs[1])
    attrs = dict(vars(gf))
    srcs = {n.id: dict(n.srcs) for n in gf.nodes}
    sched = mg.Scheduler(list(devs))
    sg = sched.alloc_graph(gf)
    net.fill(leaves)
    sched.graph_compute(gf)
    assert sg.copies, "the chain crosses devices"
    assert set(vars(gf)) == set(attrs) and not hasattr(gf, "sched") and not hasattr(gf, "redirects")
    assert {n.id: n.srcs for n in gf.nodes} == srcs
    redirected = [n for n in gf.nodes if sg.srcs_of(n) is not n.srcs]
    assert {n.name for n in redirected} == {"a", "m"}
    for n in redirected:       # the schedule's view: the copy on the node's own device
        read = [c for c, s in zip(sg.srcs_of(n).values(), n.srcs.values()) if c is not s]
        assert read and all(c.name.startswith(sg.backend_of(n).name + "#") for c in read)


def test_a_scheduled_graph_computes_again_on_one_device(devs):
    """A graph once scheduled over two devices computes on one device from its own sources."""
    def build_and_compute(net, x_data, sched_first):
        gf, ctxs, leaves, out, _ = chain(net)
        for c, d in zip(ctxs, (devs[0], devs[1], devs[1])):
            mg.alloc_ctx_tensors(c, d)
        net.fill(leaves)
        if sched_first:
            mg.Scheduler(list(devs)).graph_compute(gf)
        # move W1 to the host so that the whole graph can run there
        w1 = next(t for t in leaves if t.name == "W1")
        host = mg.Context()
        w1_host = host.new_tensor(mg.f32, w1.ne)
        mg.alloc_ctx_tensors(host, devs[1])
        w1.buffer, w1.offs = w1_host.buffer, w1_host.offs
        w1.set(net.data["W1"])
        next(t for t in leaves if t.name == "x").set(x_data)
        devs[1].graph_compute(gf)
        return out.numpy()

    x2 = np.random.default_rng(5).standard_normal((T, D)).astype(np.float32)
    np.testing.assert_array_equal(build_and_compute(Net(), x2, True), build_and_compute(Net(), x2, False))


def test_drawing_uses_the_schedule_given_or_the_graphs_newest(devs):
    sched, gf, _, _ = run_scheduled(devs, lambda n: chain(n))
    explicit = gf.to_networkx(sched.scheduled)
    assert {d["device"] for _, d in explicit.nodes(data=True)} == {"cpu:0", "cpu:1"}
    assert gf.to_networkx(sched).edges(data=True) is not None
    gf.build_forward_expand(mg.scale(gf.nodes[-1], 2.0))     # the schedule is stale now
    assert all(d.get("device") is None for _, d in gf.to_networkx().nodes(data=True))
    other = mg.Graph()
    with pytest.raises(ValueError, match="scheduled this graph"):
        other.to_networkx(sched)


def test_placement_report_before_any_schedule_says_so(devs):
    sched = mg.Scheduler(list(devs))
    with pytest.raises(mg.OpError, match="no graph has been scheduled"):
        sched.placement_report()
    with pytest.raises(mg.OpError, match="no graph has been scheduled yet, so it has no splits"):
        sched.splits
