"""Failure atomicity of the runner's steps (models/step_journal.py).

A step that raises — a bad token id caught by get_rows, an out-of-range index at the end of the
graph after every layer wrote its state, a compute that writes garbage into the cache and then
raises (RuntimeError or KeyboardInterrupt) — leaves every cell's metadata and every byte of the
whole cache as they were before the step, for single-ubatch decodes, multi-ubatch batches (a
failure in the 2nd ubatch undoes the 1st: nothing of the step remains) and speculative steps with
rollback planes. The journal copies only the spans the step's ubatches may write: that set covers
every byte a real step changes, and its size does not grow with mem_size.

Every scenario also runs on hybrid models (HybridMemory: a KV cache for the attention blocks):
`lfm` (LFM2 as llama.cpp's files are, short conv + attention; `lfm-hybrid` is its alias) and
`toy-hybrid`; `lfm-conv` is the conv-only LFM2 (head_count_kv all zeros). There a failed step
also leaves the KV cells, and every K/V byte, as they were."""
import dataclasses

import numpy as np
import pytest

import minigraph as mg
from minigraph.models import step_journal
from minigraph.models.batch import Ubatch
from minigraph.models.graph import GraphInput
from minigraph.models.kv_cache import KVCells
from minigraph.models.memory import coalesce_rows, run_spans
from minigraph.models.runner import DecodeError, Runner, atomic_mode
from minigraph.models.zoo import make_model, recurrent_only

MODELS = ("toy", "mamba2", "delta-net", "lfm", "lfm-conv", "kda", "toy-hybrid")
HYBRIDS = ("lfm", "toy-hybrid")
DEVICES = ("ref", "cpu")


class Injected(RuntimeError):
    """The failure the tests inject."""


def zoo_model(name, devices):
    """A zoo model; "lfm-conv": LFM2 with short-conv blocks only."""
    if name == "lfm-conv":
        return make_model("lfm", devices, n_layer=3, **recurrent_only("lfm", 3))
    return make_model(name, devices)


def make_runner(name, device, model=None, **kw):
    model = model or zoo_model(name, [mg.backend(device)])
    kw.setdefault("mem_size", 4)
    kw.setdefault("n_rs_seq", 2)
    kw.setdefault("n_ubatch", 8)
    return Runner(model, **kw)


def whole_memory(r):
    """Every observable of the memory: metadata (cells, head, n, used, rs_z, rs_idx, n_last; a
    hybrid's KV cells too) and the raw bytes of every r/s (and K/V) tensor, plus the printed
    cell table. The r/s rows of cells that hold no sequence are not observable (a cell that
    takes a sequence reads its state from the zeroed rs_z row, never its own bytes: the journal
    does not save them, and continue_like_a_twin shows nothing reads them): they read as zeros;
    so do a hybrid's K/V entries of KV cells that hold no position (KVCache.observable_bytes)."""
    m = r.memory
    return comparable(m.meta_copy()), {t.name: live_bytes(r, t) for t in m.tensors()}, str(m)


def live_bytes(r, t) -> bytes:
    """The raw bytes of cache tensor t, the r/s rows of empty cells zeroed."""
    kv = getattr(r.memory, "kv", None)
    if kv is not None and any(t is u for u in kv.tensors()):
        return kv.observable_bytes(t)
    raw = t.numpy().tobytes()
    rec = getattr(r.memory, "recurrent", r.memory)
    dead = empty_cells(rec)
    if not dead or not any(t is u for u in rec.tensors()):
        return raw
    rows = np.frombuffer(raw, np.uint8).reshape(rec.K * rec.size, -1).copy()
    rows[cell_rows(rec, dead)] = 0
    return rows.tobytes()


def empty_cells(rec) -> list:
    """The recurrent memory's cells that hold no sequence."""
    live = rec.live_cells()
    return [c for c in range(rec.size) if c not in live]


def cell_rows(rec, cells) -> list:
    """The cache rows of the cells, every rollback plane."""
    return [rec.row_index(c, p) for c in cells for p in range(rec.K)]


def comparable(meta):
    """The metadata with a hybrid's KV cell table (KVCells, no __eq__) as a dict of its fields, and
    the KV cache's last placed Ubatch (numpy fields) as a dict of plain values."""
    if isinstance(meta, KVCells):
        return vars(meta)
    if isinstance(meta, Ubatch):
        return {f.name: comparable(getattr(meta, f.name)) for f in dataclasses.fields(meta)}
    if isinstance(meta, np.ndarray):
        return (meta.dtype.str, meta.shape, meta.tolist())
    if isinstance(meta, list):
        return [comparable(v) for v in meta]
    if isinstance(meta, dict):
        return {k: comparable(v) for k, v in meta.items()}
    if isinstance(meta, tuple):
        return tuple(comparable(v) for v in meta)
    return meta


def assert_same_memory(got, want):
    assert got[2] == want[2]
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert got[1][name] == want[1][name], f"{name} differs after the failed step"


def prime(r):
    """Two sequences with history and a pending rollback on seq 0 (the failed step would consume
    it through s_copy: the undo must bring it back)."""
    r.decode_seq_tokens({0: [1, 2, 3, 4, 5], 1: [7, 8, 9, 10, 11]})
    r.decode_seq_tokens({0: [6, 7, 8], 1: [12, 13, 14]})
    assert r.rollback(0, 1)


class ComputeFails:
    """Scheduler.graph_compute patched: the `fail_at`-th compute (0-based) of the runner runs the
    real graph, then writes garbage into every span its ubatch may write, then raises."""

    def __init__(self, monkeypatch, runner, fail_at=0, exc=Injected):
        self.calls, self.fail_at, self.exc, self.runner = 0, fail_at, exc, runner
        self.last_spans = None
        real_runs = step_journal.runs_written_by

        def spy_runs(memory, ub, live=None, kv_cells=None):
            # garbage goes into every byte the graph may write, the KV cells the journal does not
            # save (they held no position) included
            self.last_spans = run_spans(real_runs(memory, ub, live))
            return real_runs(memory, ub, live, kv_cells)
        monkeypatch.setattr(step_journal, "runs_written_by", spy_runs)
        real = mg.Scheduler.graph_compute
        hook = self

        def graph_compute(sched, gf):
            out = real(sched, gf)
            i, hook.calls = hook.calls, hook.calls + 1
            if i == hook.fail_at:
                hook.scribble()
                raise hook.exc(f"injected failure in compute {i}")
            return out
        monkeypatch.setattr(mg.Scheduler, "graph_compute", graph_compute)

    def scribble(self):
        mem = self.runner.memory
        rng = np.random.default_rng(self.calls)
        # without a journal nothing asked for the spans: the graph that ran has changed them anyway
        for t, offs, n in self.last_spans or ():
            step_journal.write_span(mem, t, offs, rng.integers(0, 256, n, dtype=np.uint8))


class MaybeBadIndex(GraphInput):
    """An I32 input of one index: 10_000 (out of range for any tensor here) when fail() says so."""

    def __init__(self, ids, fail):
        self.ids, self.fail = ids, fail

    def set_input(self, ubatch):
        self.ids.set(np.array([10_000 if self.fail() else 0], np.int32))

    def can_reuse(self, params):
        return True


def fail_at_graph_end(model, fail):
    """model.build plus a get_rows of the logits after everything else: index 10_000 (out of
    range, caught by the kernel's index check) when fail() says so, else 0."""
    build = model.build

    def build_with_bad_index(g):
        out = build(g)
        ids = g.ctx0.new_tensor_1d(mg.i32, 1).set_name("maybe_bad_ids").set_input()
        g.res.inputs.append(MaybeBadIndex(ids, fail))
        g.gf.build_forward_expand(mg.get_rows(out["logits"], ids).set_output())
        return out
    model.build = build_with_bad_index
    return model


def continue_like_a_twin(r, twin, steps=({0: [3], 1: [4]}, {0: [5, 6], 1: [7, 8]})):
    """After the failed step, r decodes exactly as a runner that never saw it."""
    for step in steps:
        a, b = r.decode_seq_tokens(step), twin.decode_seq_tokens(step)
        for s in step:
            assert np.array_equal(a[s], b[s])
    assert_same_memory(whole_memory(r), whole_memory(twin))


# -- the failures ---------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_compute_that_writes_garbage_then_raises_is_undone(monkeypatch, name, device):
    r = make_runner(name, device)
    twin = make_runner(name, device, model=r.model)
    prime(r), prime(twin)
    before = whole_memory(r)
    hook = ComputeFails(monkeypatch, r)
    with pytest.raises(Injected):
        r.decode_seq_tokens({0: [9], 1: [10]})
    assert hook.calls == 1
    assert_same_memory(whole_memory(r), before)
    monkeypatch.undo()
    continue_like_a_twin(r, twin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_failure_in_the_second_ubatch_undoes_the_whole_step(monkeypatch, name, device):
    """n_ubatch 4 splits 2 x 6 tokens into several ubatches; the 2nd fails after the 1st wrote
    its states and moved its cells: nothing of the step remains."""
    r = make_runner(name, device, n_ubatch=4)
    twin = make_runner(name, device, model=r.model, n_ubatch=4)
    prime(r), prime(twin)
    before = whole_memory(r)
    hook = ComputeFails(monkeypatch, r, fail_at=1, exc=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        r.decode_seq_tokens({0: [1, 2, 3, 4, 5, 6], 1: [7, 8, 9, 10, 11, 12]})
    assert hook.calls == 2                       # the 1st ubatch did compute and write
    assert_same_memory(whole_memory(r), before)
    monkeypatch.undo()
    continue_like_a_twin(r, twin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_failure_while_the_journal_saves_the_second_ubatch_undoes_the_step(monkeypatch, name, device):
    """The journal's copy for the 2nd ubatch fails halfway through its spans (after the 1st ubatch
    wrote its states): the spans it never saved must not be put back (they would write stale
    journal bytes over the cache), and nothing of the step remains."""
    from minigraph.backend import HostBackend
    r = make_runner(name, device, n_ubatch=4)
    twin = make_runner(name, device, model=r.model, n_ubatch=4)
    prime(r), prime(twin)
    before = whole_memory(r)
    from minigraph.backends.cpu import CpuBackend
    calls = []
    for cls in (HostBackend, CpuBackend):                # the two save_rows there are
        real = vars(cls)["save_rows"]

        def save_rows(self, pairs, real=real):
            calls.append(len(pairs))
            if len(calls) == 2:
                real(self, pairs[:len(pairs) // 2])
                raise KeyboardInterrupt
            real(self, pairs)
        monkeypatch.setattr(cls, "save_rows", save_rows)
    with pytest.raises(KeyboardInterrupt):
        r.decode_seq_tokens({0: [1, 2, 3, 4, 5, 6], 1: [7, 8, 9, 10, 11, 12]})
    assert len(calls) == 2
    assert_same_memory(whole_memory(r), before)
    monkeypatch.undo()
    continue_like_a_twin(r, twin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_bad_token_id_changes_nothing(name, device):
    r = make_runner(name, device)
    twin = make_runner(name, device, model=r.model)
    prime(r), prime(twin)
    before = whole_memory(r)
    with pytest.raises(mg.OpError, match="out of range"):
        r.decode_seq_tokens({0: [r.model.n_vocab + 5], 1: [3]})
    assert_same_memory(whole_memory(r), before)
    continue_like_a_twin(r, twin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["toy", "mamba2", "kda", *HYBRIDS])
def test_index_error_after_the_state_writes_is_undone(name, device):
    """The bad index sits after every layer's state store: without atomicity the failed step
    leaves written states behind (so the check below is not vacuous); with it, nothing."""
    armed = [False]
    for atomic in (False, True):
        model = fail_at_graph_end(zoo_model(name, [mg.backend(device)]), lambda: armed[0])
        r = make_runner(name, device, model=model, atomic=atomic)
        armed[0] = False
        prime(r)
        before = whole_memory(r)
        armed[0] = True
        with pytest.raises(mg.OpError, match="out of range"):
            r.decode_seq_tokens({0: [9], 1: [10]})
        after = whole_memory(r)
        if atomic:
            assert_same_memory(after, before)
        else:
            assert after[1] != before[1] and after[0] != before[0]


def fail_between_layers(model, fail):
    """model.build with a get_rows of a cache (index 10_000 when fail() says so) placed just before
    the first gather of the second recurrent layer: when it fails, the layers before it have read
    and written their states and the layers after it have not even read theirs."""
    build = model.build

    def build_failing_midway(g):
        real_build_rs, first = g.build_rs, []

        def build_rs(inp, s, *a, **k):
            layer = s.name.rsplit("_l", 1)[-1]
            if not first:
                first.append(layer)
            elif layer != first[0] and len(first) == 1:
                first.append(layer)
                ids = g.ctx0.new_tensor_1d(mg.i32, 1).set_name("maybe_bad_ids").set_input()
                g.res.inputs.append(MaybeBadIndex(ids, fail))
                g.gf.build_forward_expand(mg.get_rows(s, ids).set_output())
            return real_build_rs(inp, s, *a, **k)
        g.build_rs = build_rs
        out = build(g)
        assert len(first) == 2, "the model needs two recurrent layers for this test"
        return out
    model.build = build_failing_midway
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("where", ["first node", "between layers", "graph end", "after compute", "2nd ubatch"])
def test_failure_with_rows_left_to_the_gathers_is_undone(monkeypatch, name, device, where):
    """n_rs_seq 0, sequences staying in their cells: the journal copies none of the rows build_rs
    gathers (the graph's gathers hold their old bytes) and still undoes a failure anywhere: before
    any gather ran (their stamps tell undo to leave those rows alone), between two layers (the
    first layer's rows come back from its gather, the second's were never touched), after every
    state store, after a compute that scribbled over every span, and in the 2nd ubatch (the 1st
    ubatch's gathers were copied before the 2nd graph reused their memory). Without atomicity
    the same failures do change the memory (so the check is not vacuous), except the first."""
    armed = [False]
    runners = {}
    for atomic in (False, True):
        # 4 blocks: at least two recurrent ones in every zoo model (delta-net's 2-block default has one)
        model = zoo_model(name, [mg.backend(device)]) if name == "lfm-conv" else \
            make_model(name, [mg.backend(device)], n_layer=4)
        if where == "between layers":
            model = fail_between_layers(model, lambda: armed[0])
        elif where == "graph end":
            model = fail_at_graph_end(model, lambda: armed[0])
        kw = dict(n_rs_seq=0, n_ubatch=4 if where == "2nd ubatch" else 8)
        r = make_runner(name, device, model=model, atomic=atomic, **kw)
        twin = make_runner(name, device, model=model, **kw)
        armed[0] = False
        for x in (r, twin):
            x.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
            x.decode_seq_tokens({0: [7], 1: [8]})
        before, w0 = whole_memory(r), r.stats.witnessed_bytes
        step = {0: [9, 10, 11, 12], 1: [13, 14, 15, 16]} if where == "2nd ubatch" else {0: [9], 1: [10]}
        if where == "first node":
            step, exc = {0: [r.model.n_vocab + 5], 1: [3]}, mg.OpError
        elif where in ("after compute", "2nd ubatch"):
            ComputeFails(monkeypatch, r, fail_at=1 if where == "2nd ubatch" else 0, exc=KeyboardInterrupt)
            exc = KeyboardInterrupt
        else:
            exc = mg.OpError
        armed[0] = True
        with pytest.raises(exc):
            r.decode_seq_tokens(step)
        armed[0] = False
        monkeypatch.undo()
        runners[atomic] = (r, twin, before, w0)
    r, twin, before, w0 = runners[False]
    if where != "first node":
        assert whole_memory(r)[1] != before[1]
    r, twin, before, w0 = runners[True]
    assert r.stats.witnessed_bytes > w0            # the failed step did leave rows to the gathers
    assert_same_memory(whole_memory(r), before)
    continue_like_a_twin(r, twin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["toy", "delta-net", "lfm", "lfm-conv", "toy-hybrid"])
def test_failed_speculative_step_keeps_rollback_planes(monkeypatch, name, device):
    """n_rs_seq 3: a draft of 3 tokens writes three rollback planes per cell; the failure leaves
    the planes, the pending rollback (rs_idx) and n_last as they were, and the next speculative
    step rolls back exactly as a runner that never saw the failure."""
    r = make_runner(name, device, n_rs_seq=3)
    twin = make_runner(name, device, model=r.model, n_rs_seq=3)
    for x in (r, twin):
        x.decode_seq_tokens({0: [1, 2, 3, 4], 1: [5, 6, 7, 8]})
        x.speculative_step(0, [9, 10, 11], 1)                 # pending rollback of 2 on seq 0
    before = whole_memory(r)
    assert r.memory.pending_rollback(0) == 2
    ComputeFails(monkeypatch, r, exc=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        r.speculative_step(0, [12, 13, 14], 2)
    assert_same_memory(whole_memory(r), before)
    monkeypatch.undo()
    for x in (r, twin):
        x.speculative_step(0, [12, 13, 14], 2)
    got, want = r.speculative_step(0, [15, 16], 1), twin.speculative_step(0, [15, 16], 1)
    assert np.array_equal(got, want)
    assert_same_memory(whole_memory(r), whole_memory(twin))


def test_refused_rollback_undoes_the_draft():
    r = make_runner("toy", "ref", n_rs_seq=2)
    r.decode_seq_tokens({0: [1, 2, 3, 4]})
    before = whole_memory(r)
    with pytest.raises(DecodeError, match="rollback of 3 tokens on seq 0 refused.*k <= n_rs_seq"):
        r.speculative_step(0, [5, 6, 7, 8], 1)               # k = 3 > n_rs_seq
    assert_same_memory(whole_memory(r), before)


def test_meta_device_failure_is_undone(monkeypatch):
    """The cache split over two CPUs (meta device): get_bytes/set_bytes of row spans see the
    logical bytes, so the undo restores both slices."""
    from minigraph.models.toy_tp import ToyConvTPModel
    meta = mg.backend("meta(cpu:0,cpu:1)")

    def model():
        return ToyConvTPModel(n_vocab=24, n_embd=8, n_layer=2, d_conv=4, devices=meta, seed=0)
    r = make_runner("toy-tp", "cpu", model=model(), n_ubatch=4)
    twin = make_runner("toy-tp", "cpu", model=model(), n_ubatch=4)
    prime(r), prime(twin)
    before = whole_memory(r)
    ComputeFails(monkeypatch, r, fail_at=1)
    with pytest.raises(Injected):
        r.decode_seq_tokens({0: [1, 2, 3, 4, 5, 6], 1: [7, 8, 9, 10, 11, 12]})
    assert_same_memory(whole_memory(r), before)
    monkeypatch.undo()
    continue_like_a_twin(r, twin)


# -- what the journal copies -------------------------------------------------------------------
SCRIPT = [{0: [1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10], 2: [11, 12]},    # prefill: cells 0, 1, 2
          {0: [1], 1: [2], 2: [3]},
          {0: [4, 5, 6], 1: [7, 8, 9]},
          ("rollback", 0, 2),
          {0: [1]},                                                   # reads plane 2
          ("rm", 0), ("rm", 1),
          {1: [3, 4]},                                                # seq 1 anew in cell 0
          {1: [5], 2: [6]},                                           # cells 0, 2: a range of 3
          {0: [1, 2, 3, 4]},                                          # seq 0 anew
          {0: [9], 1: [9], 2: [9]}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_spans_written_by_cover_every_byte_a_step_changes(monkeypatch, name, device):
    """The journal's span set is not a guess: across prefills, decodes, a pending rollback, cells
    spread over the range (tail copies) and a new sequence, every byte a real step changes (r/s
    rows, and a hybrid's K rows and transposed V cells) lies in a span runs_written_by named for
    that step's ubatches."""
    r = make_runner(name, device, n_rs_seq=2, n_ubatch=64)
    named = []
    real_runs = step_journal.runs_written_by

    def spy(mem, ub, live=None, kv_cells=None):
        runs = real_runs(mem, ub, live, kv_cells)
        named.extend(run_spans(runs))
        if kv_cells is not None:   # a hybrid's KV cells that held no position: zeroed on undo, never saved
            named.extend(run_spans(mem.kv.byte_runs_written_by(ub, {c for c in mem.kv.idxs if c not in kv_cells})))
        return runs
    monkeypatch.setattr(step_journal, "runs_written_by", spy)
    rec = getattr(r.memory, "recurrent", r.memory)
    n_range_wider_than_ubatch = n_new_cells = 0
    for step in SCRIPT:
        if isinstance(step, tuple):
            op, seq, *k = step
            assert r.rollback(seq, *k) if op == "rollback" else r.memory.seq_rm(seq, -1, -1)
            continue
        before = {t.name: t.numpy().tobytes() for t in r.memory.tensors()}
        dead = empty_cells(rec)
        named.clear()
        r.decode_seq_tokens(step)
        n_range_wider_than_ubatch += rec.n > len(step)
        n_new_cells += len(set(dead) & rec.live_cells())
        allowed = {t.name: np.zeros(t.nbytes(), bool) for t in r.memory.tensors()}
        for t, offs, n in named:
            allowed[t.name][offs:offs + n] = True
        for t in rec.tensors():          # the rows of cells empty before the step: never saved
            for row in cell_rows(rec, dead):
                allowed[t.name][row * t.nb[1]:(row + 1) * t.nb[1]] = True
        for t in r.memory.tensors():
            old = np.frombuffer(before[t.name], np.uint8)
            changed = old != np.frombuffer(t.numpy().tobytes(), np.uint8)
            outside = np.flatnonzero(changed & ~allowed[t.name])
            assert not outside.size, f"{t.name}: step {step} changed bytes {outside[:8]} outside the named spans"
    assert n_range_wider_than_ubatch                     # the tail-copy case was exercised
    assert n_new_cells                                   # and sequences taking empty cells


# the r/s caches whose rows the graph copies itself: build_rs's gathers, and for mamba2's s rows,
# which ssm_scan reads in place, the side copy build_rs makes just before it
GATHERED = {"toy": ("cache_r",), "mamba2": ("cache_r", "cache_s")}


@pytest.mark.parametrize("name", ["toy", "mamba2"])
def test_snapshot_bytes_follow_the_ubatch_not_mem_size(name):
    """Per decode step the journal copies the ubatch's rows: the same bytes at mem_size 4 and 64
    (and exactly n_seqs rows of every r/s tensor for a 1-token decode), while the whole-cache copy
    grows with mem_size."""
    per_step = {}
    for mode in ("rows", "full"):
        for size in (4, 64):
            r = make_runner(name, "ref", mem_size=size, n_rs_seq=3, atomic=mode)
            r.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
            b0, w0, s0 = r.stats.snapshot_bytes, r.stats.witnessed_bytes, r.stats.steps
            for tok in range(3):
                r.decode_seq_tokens({0: [tok], 1: [tok + 1]})
            n = r.stats.steps - s0
            per_step[mode, size] = (r.stats.snapshot_bytes - b0) / n, (r.stats.witnessed_bytes - w0) / n
            row_bytes = sum(t.nb[1] for t in r.memory.tensors())
            gathered = sum(t.nb[1] for t in r.memory.tensors() if t.name.startswith(GATHERED[name]))
            cache_bytes = sum(t.nbytes() for t in r.memory.tensors())
    # the rows of states build_rs gathers are left to the gathers (copied only if a step fails)
    assert per_step["rows", 4] == per_step["rows", 64] == (2 * (row_bytes - gathered), 2 * gathered)
    assert per_step["full", 64] == (cache_bytes, 0) and per_step["full", 4] == (cache_bytes / 16, 0)


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_snapshot_bytes_follow_the_ubatch_not_the_cache_sizes(name):
    """A hybrid's journal copies, per 1-token decode of 2 sequences, the 2 recurrent cells' rows
    and nothing of the KV cache (the 2 cells the tokens take held no position: undo zeroes them
    rather than saving them): the same bytes at mem_size 4 and 64 and kv_size 64 and 1024, while
    the whole-cache copy grows with both."""
    per_step = {}
    for mode in ("rows", "full"):
        for size, kv_size in ((4, 64), (64, 1024)):
            r = make_runner(name, "ref", mem_size=size, n_rs_seq=3, atomic=mode, kv_size=kv_size)
            r.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
            b0, w0, s0 = r.stats.snapshot_bytes, r.stats.witnessed_bytes, r.stats.steps
            for tok in range(3):
                r.decode_seq_tokens({0: [tok], 1: [tok + 1]})
            n = r.stats.steps - s0
            per_step[mode, size] = (r.stats.snapshot_bytes - b0 + r.stats.witnessed_bytes - w0) / n
            rec = r.memory.recurrent
            row_bytes = sum(t.nb[1] for t in rec.tensors())
    # copied or left to the graph's gathers, the same rows
    assert per_step["rows", 4] == per_step["rows", 64] == 2 * row_bytes
    assert per_step["full", 64] > 10 * per_step["full", 4]


def test_atomic_off_copies_nothing_and_bad_modes_are_named():
    r = make_runner("toy", "ref", atomic=False)
    r.decode_seq_tokens({0: [1, 2]})
    assert r.stats.snapshot_bytes == 0
    assert atomic_mode(True) == "rows" and atomic_mode("full") == "full" and atomic_mode(False) is None
    with pytest.raises(ValueError, match="atomic='yes' is not one of"):
        make_runner("toy", "ref", atomic="yes")


def test_coalesce_rows():
    assert coalesce_rows([(8, 2), (0, 4), (4, 2), (12, 0), (9, 3)]) == [(0, 6), (8, 4)]
    assert coalesce_rows([]) == []


@pytest.mark.parametrize("device", DEVICES)
def test_decode_steps_drop_the_prompts_arena(monkeypatch, device):
    """A prompt's step saves every row of its new sequences in the journal's arena; the decode
    steps after it leave theirs to the graph's own copies, and the first of them drops the big
    arena instead of keeping its pages beside those copies. A step that needs much again makes a
    new one, and still undoes a failure."""
    monkeypatch.setattr(step_journal, "ARENA_KEEP_BYTES", 1 << 10)
    r = make_runner("mamba2", device, n_rs_seq=0, mem_size=2)
    r.decode_seq_tokens({0: [1], 1: [4]})          # new sequences: nothing of theirs is saved
    r.decode_seq_tokens({0: [2, 3], 1: [5, 6]})    # more of their prompt: every row they write
    prompt_arena = step_journal._ARENAS[r.memory].size
    assert prompt_arena >= 2 * sum(t.nb[1] for t in r.memory.tensors())
    r.decode_seq_tokens({0: [7], 1: [8]})
    assert step_journal._ARENAS.get(r.memory) is None or step_journal._ARENAS[r.memory].size < prompt_arena
    before = whole_memory(r)
    ComputeFails(monkeypatch, r, exc=KeyboardInterrupt)   # a prompt-sized step again, failing
    with pytest.raises(KeyboardInterrupt):
        r.decode_seq_tokens({0: [9, 10, 11], 1: [12, 13, 14]})
    assert_same_memory(whole_memory(r), before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_reused_graph_finds_its_witnesses_once(monkeypatch, device):
    """The journal looks up which of a graph's gathers holds each deferred row run (and where its
    bytes are) once per graph: the decode steps that reuse the graph stamp the same gathers without
    asking again, leave the same bytes to them, and a failure in one of them is still undone."""
    calls = []
    real = step_journal._witness_bytes
    monkeypatch.setattr(step_journal, "_witness_bytes", lambda res, run: calls.append(run) or real(res, run))
    r = make_runner("mamba2", device, n_rs_seq=0, mem_size=2)
    r.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
    r.decode_seq_tokens({0: [7], 1: [8]})                 # the decode graph: its lookups
    first, w = len(calls), r.stats.witnessed_bytes
    assert first > 0 and w > 0
    for i in range(3):
        r.decode_seq_tokens({0: [9 + i], 1: [12 + i]})
    assert len(calls) == first and r.stats.reuses >= 3
    assert r.stats.witnessed_bytes == 4 * w                # the same bytes left to the gathers each step
    before = whole_memory(r)
    ComputeFails(monkeypatch, r, exc=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        r.decode_seq_tokens({0: [20], 1: [21]})
    assert_same_memory(whole_memory(r), before)


def test_a_ubatch_grows_the_arena_once(monkeypatch):
    """The journal makes room for all of a ubatch's runs at once: one arena, sized for the step,
    not a chain of doublings whose older arenas the first runs' copies keep resident (the prompt
    of 4 new sequences saved ~1.3x its bytes that way)."""
    made = []
    real_empty = np.empty

    class CountingNp:
        def __getattr__(self, k):
            return getattr(np, k)

        @staticmethod
        def empty(shape, dtype=float, *a, **kw):
            out = real_empty(shape, dtype, *a, **kw)
            made.append(out.nbytes)
            return out
    monkeypatch.setattr(step_journal, "np", CountingNp())
    monkeypatch.setattr(step_journal, "_ARENAS", step_journal.weakref.WeakKeyDictionary())
    r = make_runner("mamba2", "cpu", n_ubatch=64)
    r.decode_seq_tokens({q: [1 + q] for q in range(4)})                     # new sequences: nothing saved
    assert r.stats.snapshot_bytes == 0 and made == []
    r.decode_seq_tokens({q: [2, 3, 4, 5, 6] for q in range(4)})             # one ubatch, all their rows
    assert r.stats.ubatches == 2 and r.stats.snapshot_bytes > 1 << 16       # past the smallest arena
    assert made == [r.stats.snapshot_bytes], made


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODELS)
def test_new_sequences_rows_are_not_saved_and_a_failure_is_undone(monkeypatch, name, device):
    """A step whose sequences take empty cells saves none of their rows (a prompt of 4 new
    sequences of mamba2-130m would copy 73 MiB), and a failure in it still leaves a memory that
    decodes exactly as one that never saw the step."""
    r = make_runner(name, device)
    twin = make_runner(name, device, model=r.model)
    r.decode_seq_tokens({0: [1, 2, 3]}), twin.decode_seq_tokens({0: [1, 2, 3]})
    saved = r.stats.snapshot_bytes + r.stats.witnessed_bytes
    assert saved == 0 or getattr(r.memory, "kv", None) is not None          # a hybrid's KV cells only
    before = whole_memory(r)
    ComputeFails(monkeypatch, r)
    with pytest.raises(Injected):
        r.decode_seq_tokens({0: [4], 1: [5, 6], 2: [7]})   # seqs 1 and 2 new: their cells were empty
    assert_same_memory(whole_memory(r), before)
    # the rows the failed step wrote in empty cells are zeroed (one may become the zero row, which
    # build_rs clears by scaling with 0: a NaN there would stay)
    rec = getattr(r.memory, "recurrent", r.memory)
    for t in rec.tensors():
        rows = t.numpy().reshape(rec.K * rec.size, -1)
        for c in empty_cells(rec):
            assert not rows[cell_rows(rec, [c])].any(), f"{t.name}: cell {c} not zeroed"
    monkeypatch.undo()
    continue_like_a_twin(r, twin, steps=({0: [8], 1: [5, 6], 2: [7]}, {0: [9], 1: [10], 2: [11]}))
