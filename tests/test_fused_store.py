"""A state store fused into its scan (cpu backend): the CPY of a scan's packed state slots into a
cache (Tensor.set_state_store, as build_state_store makes it) is taken by the scan itself, which
writes the slots into the cache rows directly and leaves the copy nothing to do. Every byte of the
cache and of the outputs equals the unfused graph's, whether the states are updated in place,
come from other cells, come through a gather, or are swapped between two sequences (the scan then
falls back to writing after its output and the copy runs); with K slots over several tokens; on 1
thread and on 2 with every node split into every chunk it allows. A node between the scan and the
store that touches the cache keeps them apart."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph.tensor import Context
from minigraph.testing.op_cases import Built, run_built

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)


def ssm_scan_store(b, rng, ns, T, K, ids, head, rows, between=False):
    """Mamba-2's scan reading its states from the cache rows ids (in place) and the store of its
    last min(T, K) states into rows head.. of each of the K planes; outs: y, the stored rows."""
    ds, hd, nh, ng = 16, 8, 4, 2
    D = ds * hd * nh
    cache = b.leaf(mg.f32, (D, rows * K), rng=rng)
    s4 = mg.reshape_4d(cache, ds, hd, nh, rows * K)
    x = b.leaf(mg.f32, (hd, nh, T, ns), rng=rng)
    dt = b.leaf(mg.f32, (nh, T, ns), rng=rng)
    A = b.leaf(mg.f32, (1, nh), data=-rng.uniform(0.5, 2.0, (nh, 1)).astype(np.float32))
    B = b.leaf(mg.f32, (ds, ng, T, ns), rng=rng)
    C = b.leaf(mg.f32, (ds, ng, T, ns), rng=rng)
    idx = b.leaf(mg.i32, (ns,), data=np.asarray(ids, np.int32))
    scan = mg.ssm_scan(s4, x, dt, A, B, C, idx, K)
    return cache, scan, _store(b, cache, scan, D, ns, T, K, head, rows, hd * nh * T * ns * 4, between)


def gdn_store(b, rng, ns, T, K, ids, head, rows, between=False, gathered=False):
    """gated_delta_net on states read in place from rows ids (contiguous from ids[0]) or through
    a gather of them, and the store of its slots into rows head.. of each plane."""
    S, H = 8, 2
    D = S * S * H
    cache = b.leaf(mg.f32, (D, rows * K), rng=rng)
    if gathered:
        idx = b.leaf(mg.i32, (ns,), data=np.asarray(ids, np.int32))
        state = mg.reshape_4d(mg.get_rows(cache, idx), S, S, H, ns)
    else:
        assert list(ids) == list(range(ids[0], ids[0] + ns))
        state = mg.view_4d(cache, S, S, H, ns, S * 4, S * S * 4, cache.nb[1], ids[0] * cache.nb[1])
    q, k, v = (b.leaf(mg.f32, (S, H, T, ns), rng=rng) for _ in range(3))
    g = b.leaf(mg.f32, (1, H, T, ns), data=-rng.uniform(0.0, 1.0, (ns, T, H, 1)).astype(np.float32))
    beta = b.leaf(mg.f32, (1, H, T, ns), data=rng.uniform(0.0, 1.0, (ns, T, H, 1)).astype(np.float32))
    scan = mg.gated_delta_net(q, k, v, g, beta, state, K)
    return cache, scan, _store(b, cache, scan, D, ns, T, K, head, rows, S * H * T * ns * 4, between)


def _store(b, cache, scan, D, ns, T, K, head, rows, offs, between):
    n = min(T, K)
    b.out(mg.view_1d(scan, offs // 4, 0))                      # y: the main output
    if between:                                                # a node that reads the cache
        b.out(mg.get_rows(cache, b.leaf(mg.i32, (1,), data=np.array([head], np.int32))))
    src = mg.view_3d(scan, D, ns, n, D * 4, D * 4 * ns, offs)
    dst = mg.view_3d(cache, D, ns, n, cache.nb[1], rows * cache.nb[1], head * cache.nb[1])
    return mg.cpy(src, dst)


def run(build, flag: bool, n_threads: int):
    """(bytes of every out and of the whole cache, fused stores in the plan, the stored words)."""
    b = Built(Context())
    cache, scan, store = build(b, np.random.default_rng(7))
    if flag:
        store.set_state_store()
    b.out(store)
    be = cpu.CpuBackend(600 + n_threads).set_n_threads(n_threads)
    graphs = []
    outs = run_built(b, be, graph_hook=graphs.append)
    plan = be.get_plan(graphs[0].nodes, graphs[0].cache)
    stored = [int(plan.stored[i]) for i in range(plan.fused_stores)]
    return [o.tobytes() for o in outs] + [cache.numpy().tobytes()], plan.fused_stores, stored


CASES = {
    # name: (builder, ns, T, K, ids, head, rows, fused this run)
    "scan in place": (ssm_scan_store, 2, 1, 1, [0, 1], 0, 2, True),
    "scan from other cells": (ssm_scan_store, 2, 1, 1, [3, 2], 0, 4, True),
    "scan, two sequences swap cells": (ssm_scan_store, 2, 1, 1, [1, 0], 0, 2, False),
    "scan, K slots over 3 tokens": (ssm_scan_store, 2, 3, 2, [0, 1], 0, 2, True),
    "scan reads a slot another sequence's state goes to": (ssm_scan_store, 2, 3, 2, [0, 3], 0, 2, False),
    "gdn in place": (gdn_store, 2, 1, 1, [1, 2], 1, 3, True),
    "gdn gathered, K slots over 2 tokens": (lambda *a: gdn_store(*a, gathered=True), 3, 2, 2, [2, 0, 1], 0, 3, True),
    "gdn gathered, swapped": (lambda *a: gdn_store(*a, gathered=True), 2, 1, 1, [1, 0], 0, 2, True),
}


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_store_writes_what_the_copy_would(case, n_threads, request):
    fn, ns, T, K, ids, head, rows, fused = CASES[case]
    if n_threads > 1:                                  # every node split into every chunk it allows
        cpu.lib.mg_set_chunking(0, 0)
        request.addfinalizer(lambda: cpu.lib.mg_set_chunking(-1, -1))

    def build(b, rng):
        return fn(b, rng, ns, T, K, ids, head, rows)
    want, n_plain, _ = run(build, False, n_threads)
    got, n_fused, stored = run(build, True, n_threads)
    assert (n_plain, n_fused) == (0, 1)
    assert stored == [int(fused)]                      # the scan wrote the cache itself, or fell back
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{case}: out {i} differs from the unfused graph's"


@pytest.mark.parametrize("fn", [ssm_scan_store, gdn_store])
@pytest.mark.parametrize("ns,T,K", [(1, 1, 1), (2, 3, 2), (3, 2, 4)])
def test_the_declared_state_slots_end_the_scans_output(fn, ns, T, K):
    """registry.state_slots, which the fused stores follow, says where the shape rule puts the
    slots: [D, n_seqs, K] floats ending the output, D the per-sequence state."""
    b = Built(Context())
    cache, scan, _ = fn(b, np.random.default_rng(1), ns, T, K, list(range(ns)), 0, ns)
    offs, D, n, k = mg.OPS[scan.op].state_slots(scan)
    assert (D, n, k) == (cache.ne[0], ns, K)
    assert offs + D * n * k * 4 == scan.nbytes()


@pytest.mark.parametrize("fn", [ssm_scan_store, gdn_store])
def test_a_node_between_that_reads_the_cache_keeps_the_store_a_copy(fn):
    def build(b, rng):
        return fn(b, rng, 2, 1, 1, [0, 1], 0, 2, between=True)
    want, _, _ = run(build, False, 1)
    got, n_fused, _ = run(build, True, 1)
    assert n_fused == 0
    assert got == want


@pytest.mark.parametrize("n_rs_seq", [0, 2])
@pytest.mark.parametrize("name", ["mamba2", "delta-net", "kda"])
def test_model_steps_with_fused_stores_equal_the_unfused_ones(name, n_rs_seq, monkeypatch):
    """A zoo model's prompt, decode, draft-and-rollback and a sequence that moves cells: the
    logits and every cache byte equal those of the same steps with fusion turned off, and the
    plans did fuse every recurrent layer's store."""
    from minigraph.models.runner import Runner
    from minigraph.models.zoo import make_model
    fused = []
    real = cpu.CpuBackend._fused_stores

    def spy(compute):
        out = real(compute)
        fused.append(len(out))
        return out

    def steps(fuse: bool):
        monkeypatch.setattr(cpu.CpuBackend, "_fused_stores", staticmethod(spy if fuse else lambda compute: {}))
        r = Runner(make_model(name, [mg.backend("cpu")]), mem_size=4, n_rs_seq=n_rs_seq, n_ubatch=8)
        logits = [r.decode_seq_tokens({0: [1, 2, 3, 4, 5], 1: [7, 8, 9]}),
                  r.decode_seq_tokens({0: [6], 1: [10]}),
                  r.decode_seq_tokens({0: [11, 12, 13], 1: [14]})]
        if n_rs_seq:
            assert r.rollback(0, 2)
            logits.append(r.decode_seq_tokens({0: [15], 1: [16]}))
        r.memory.seq_rm(0, -1, -1)                          # seq 0 leaves its cell ...
        logits.append(r.decode_seq_tokens({2: [17, 18], 1: [19]}))   # ... and seq 2 takes one
        got = [np.concatenate([np.asarray(v).ravel() for v in step.values()]).tobytes() for step in logits]
        return got, {t.name: t.numpy().tobytes() for t in r.memory.tensors()}
    want = steps(False)
    got = steps(True)
    assert fused and max(fused) > 0
    assert got[0] == want[0]
    assert got[1] == want[1]
