"""The hybrid memory and the toy-hybrid model (conv layers + attention over the KV cache) in the
runner: logits against the sequential NumPy reference (prefill, decode, two sequences in one
batch), drafts rolled back, sequence operations over both memories (a refusal changes neither),
state save/load, failure atomicity across both memories, graph reuse under the validator,
placement over two devices and the command line."""
import json
import subprocess
import sys

import numpy as np
import pytest

import minigraph as mg
from minigraph.models.hybrid_memory import HybridMemory
from minigraph.models.runner import DecodeError, Runner
from minigraph.models.toy_hybrid import ToyHybridModel

from refs.toy_hybrid_ref import ToyHybridRef

TOL = 2e-5


def model(devices=None, n_layer=3, seed=0):
    return ToyHybridModel(n_vocab=24, n_embd=8, n_layer=n_layer, d_conv=4, n_head=2, devices=devices, seed=seed)


def runner(m=None, **kw):
    kw.setdefault("mem_size", 4)
    kw.setdefault("n_rs_seq", 3)
    kw.setdefault("n_ubatch", 8)
    kw.setdefault("kv_size", 64)
    return Runner(m or model(), **kw)


def close(a, b):
    assert np.max(np.abs(np.asarray(a) - np.asarray(b))) < TOL


def whole_memory(r):
    """Both memories' metadata and every byte of every r/s/K/V tensor (the K/V entries of cells
    that hold no position, which attention masks out and the undo journal zeroes, as zeros)."""
    m = r.memory
    kv = m.kv
    kv_meta = (list(kv.cells.pos), [sorted(s) for s in kv.cells.seq], list(kv.cells.shift), kv.head)
    kv_tensors = kv.tensors()
    return m.recurrent.meta_copy(), kv_meta, {
        t.name: kv.observable_bytes(t) if any(t is u for u in kv_tensors) else t.numpy().tobytes()
        for t in m.tensors()}


def test_runner_gives_a_hybrid_model_a_hybrid_memory_on_its_layer_devices():
    cpu0, cpu1 = mg.backend("cpu:0"), mg.backend("cpu:1")
    r = runner(model([cpu0, cpu1, cpu1]))
    assert isinstance(r.memory, HybridMemory)
    assert r.memory.recurrent.layers == [0, 2] and r.memory.kv.layers == [1]
    assert r.memory.kv.k_l[1].backend is cpu1 and r.memory.kv.v_l[1].backend is cpu1
    assert r.memory.r_l[0].backend is cpu0


def test_prefill_decode_and_two_sequences_in_one_batch_match_the_reference():
    r = runner()
    ref = ToyHybridRef(r.model)
    out = r.decode_seq_tokens({0: [1, 2, 3, 4, 5], 1: [7, 8, 9]})
    close(out[0], ref.run(0, [1, 2, 3, 4, 5]))
    close(out[1], ref.run(1, [7, 8, 9]))
    for step in ([6], [10]), ([11, 12], [13, 14]), ([15], [16]):
        out = r.decode_seq_tokens({0: step[0], 1: step[1]})
        close(out[0], ref.run(0, step[0]))
        close(out[1], ref.run(1, step[1]))
    assert r.memory.kv.seq_pos_max(0) == r.memory.recurrent.seq_pos_max(0) == 8


def test_long_prefill_over_several_ubatches_matches_the_reference():
    r = runner(n_ubatch=5)
    ref = ToyHybridRef(r.model)
    toks = [int(t) for t in np.arange(17) % 24]
    close(r.decode_seq_tokens({0: toks})[0], ref.run(0, toks))


def test_drafts_rolled_back_remove_their_kv_positions_and_restore_the_planes():
    r = runner()
    ref = ToyHybridRef(r.model)
    close(r.decode_seq_tokens({0: [1, 2, 3, 4]})[0], ref.run(0, [1, 2, 3, 4]))
    for draft, n_accept in (([5, 6, 7], 1), ([8, 9], 2), ([10, 11, 12, 13], 2), ([14], 1)):
        got = r.speculative_step(0, draft, n_accept)
        close(got, ref.run(0, draft[:n_accept]))
        assert r.memory.kv.seq_pos_max(0) == r.memory.recurrent.seq_pos_max(0)
    assert r.stats.rollbacks == 2
    close(r.decode_seq_tokens({0: [3]})[0], ref.run(0, [3]))
    assert r.memory.kv.cells.used() == 4 + 1 + 2 + 2 + 1 + 1


def test_refused_rollback_undoes_the_draft_in_both_memories():
    r = runner(n_rs_seq=1)
    r.decode_seq_tokens({0: [1, 2, 3]})
    before = whole_memory(r)
    with pytest.raises(DecodeError, match="rollback of 3 tokens on seq 0 refused"):
        r.speculative_step(0, [4, 5, 6, 7], 1)
    assert whole_memory(r) == before


def test_refused_seq_rm_changes_neither_memory():
    r = runner()
    r.decode_seq_tokens({0: [1, 2, 3, 4, 5]})
    before = whole_memory(r)
    assert not r.memory.seq_rm(0, 1, -1)                 # 4 tokens back: deeper than the 3 planes
    assert "k <= n_rs_seq" in r.memory.last_refusal
    assert whole_memory(r) == before
    assert r.memory.seq_rm(0, -1, -1)
    assert r.memory.kv.cells.used() == 0 and r.memory.recurrent.seq_pos_max(0) == -1


def test_seq_cp_and_seq_keep_apply_to_both_memories():
    r = runner()
    ref = ToyHybridRef(r.model)
    r.decode_seq_tokens({0: [1, 2, 3]})
    ref.run(0, [1, 2, 3])
    r.memory.seq_cp(0, 2)
    ref.copy_seq(0, 2)
    assert r.memory.kv.seq_pos_max(2) == 2
    out = r.decode_seq_tokens({0: [4], 2: [9]})
    close(out[0], ref.run(0, [4]))
    close(out[2], ref.run(2, [9]))                       # seq 2 sees the shared prefix
    r.memory.seq_keep(2)
    assert r.memory.kv.seq_pos_max(0) == -1 and r.memory.recurrent.seq_pos_max(0) == -1
    close(r.decode_seq_tokens({2: [5]})[2], ref.run(2, [5]))


def test_state_save_load_round_trip(tmp_path):
    a = runner()
    a.decode_seq_tokens({0: [1, 2, 3, 4], 1: [5, 6, 7, 8]})
    path = tmp_path / "seq1.state"
    a.memory.state_write(1, path)
    b = runner(a.model)
    b.decode_seq_tokens({0: [9, 9]})
    assert b.memory.state_read(1, path) == 1
    assert b.memory.kv.seq_pos_max(1) == 3
    close(b.decode_seq_tokens({1: [10, 11]})[1], a.decode_seq_tokens({1: [10, 11]})[1])


def test_state_read_of_a_bad_file_changes_nothing(tmp_path):
    r = runner()
    r.decode_seq_tokens({0: [1, 2]})
    bad = tmp_path / "bad.state"
    bad.write_bytes(b"MGHY" + (3).to_bytes(8, "little") + b"abcMGKVjunk")
    before = whole_memory(r)
    with pytest.raises(ValueError):
        r.memory.state_read(0, bad)
    assert whole_memory(r) == before


class Injected(RuntimeError):
    pass


@pytest.mark.parametrize("atomic", [True, "full"])
def test_a_failed_step_leaves_both_memories_byte_identical(monkeypatch, atomic):
    r = runner(n_ubatch=5, atomic=atomic)
    r.decode_seq_tokens({0: [1, 2, 3, 4, 5], 1: [7, 8, 9, 10, 11]})
    assert r.rollback(0, 1)
    before = whole_memory(r)
    real = mg.Scheduler.graph_compute
    calls = []

    def graph_compute(sched, gf):
        out = real(sched, gf)
        calls.append(1)
        if len(calls) == 2:                              # the 2nd ubatch of the step fails
            raise Injected("injected failure")
        return out
    monkeypatch.setattr(mg.Scheduler, "graph_compute", graph_compute)
    with pytest.raises(Injected):
        r.decode_seq_tokens({0: [12, 13, 14, 15, 16, 17], 1: [18, 19, 20, 21, 22, 23]})
    assert whole_memory(r) == before
    monkeypatch.setattr(mg.Scheduler, "graph_compute", real)
    ref = runner(r.model, n_ubatch=5)
    ref.decode_seq_tokens({0: [1, 2, 3, 4, 5], 1: [7, 8, 9, 10, 11]})
    assert ref.rollback(0, 1)
    close(r.decode_seq_tokens({0: [12]})[0], ref.decode_seq_tokens({0: [12]})[0])


def test_a_ubatch_too_large_for_the_kv_cache_is_refused_with_nothing_changed():
    r = runner(kv_size=8)
    r.decode_seq_tokens({0: [1, 2, 3, 4, 5]})
    before = whole_memory(r)
    with pytest.raises(DecodeError, match="hybrid memory: kv cache: find_slot: no 4 free cells"):
        r.decode_seq_tokens({1: [1, 2, 3, 4]})
    assert whole_memory(r) == before


def test_a_refused_decode_step_keeps_the_reusable_graph():
    # a lone ubatch goes straight to find_slot (no dry run): its refusal must still change
    # nothing, and the graph of the steps before it stays reusable
    r = runner(kv_size=8)
    r.decode_seq_tokens({0: [1, 2, 3, 4, 5]})
    r.decode_seq_tokens({0: [6]})
    before, builds, reuses = whole_memory(r), r.stats.builds, r.stats.reuses
    with pytest.raises(DecodeError, match="the batch does not fit in the hybrid memory: kv cache"):
        r.decode_seq_tokens({1: [1, 2, 3, 4]})
    assert whole_memory(r) == before
    r.decode_seq_tokens({0: [7]})
    assert (r.stats.builds, r.stats.reuses) == (builds, reuses + 1)


def test_graph_reuse_passes_the_validator():
    r = runner(validate=True)
    for step in ({0: [1, 2], 1: [3, 4]}, {0: [5], 1: [6]}, {0: [7], 1: [8]}, {0: [9], 1: [10]}):
        r.decode_seq_tokens(step)
    r.speculative_step(0, [1, 2, 3], 1)
    r.decode_seq_tokens({0: [4]})
    r.decode_seq_tokens({0: [5]})
    assert r.stats.reuses >= 3 and r.stats.validated == r.stats.reuses
    assert any(why.startswith("InputAttnKV") or "kq_mask" in why or "n_tokens" in why
               for why in r.stats.rebuild_reasons)


def test_n_kv_growth_past_the_pad_rebuilds_with_the_mask_rule():
    r = runner(n_rs_seq=0)
    r.memory.kv.n_pad = 4
    r.decode_seq_tokens({0: [1, 2, 3]})
    r.decode_seq_tokens({0: [4]})
    r.decode_seq_tokens({0: [5]})
    assert r.stats.rebuild_reasons[-1] == "kq_mask (n_kv): 4 -> 8"


def test_placement_over_two_devices_keeps_kv_writes_on_the_layer_device():
    cpu0, cpu1 = mg.backend("cpu:0"), mg.backend("cpu:1")
    r = runner(model([cpu0, cpu0, cpu1]), backends=[cpu0, cpu1])
    res = r.schedule_only({0: [1, 2, 3, 4]})
    rep = res.sched.placement_report()
    text = str(rep)
    assert "cache_k_l1_store" in text and "cache_v_l1_store" in text
    r = runner(r.model, backends=[cpu0, cpu1])               # schedule_only placed its ubatch
    ref = ToyHybridRef(r.model)
    close(r.decode_seq_tokens({0: [1, 2, 3]})[0], ref.run(0, [1, 2, 3]))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "minigraph", *args], capture_output=True, text=True, timeout=300)


def test_cli_placement_shows_the_kv_writes():
    p = cli("placement", "toy-hybrid", "--devices", "cpu:0,cpu:1")
    assert p.returncode == 0, p.stderr
    assert "cache_k_l1_store" in p.stdout and "cache_v_l1_store" in p.stdout


def test_cli_run_passes_its_state_check():
    p = cli("run", "toy-hybrid", "--steps", "20", "--n-rs-seq", "3", "--draft", "4", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    assert out["state_check"] == "pass" and out["rollbacks"] > 0


def test_the_journal_spans_cover_every_byte_a_step_changes():
    r = runner()
    r.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
    r.rollback(1, 1)
    before = {t.name: t.numpy().view(np.uint8).reshape(-1).copy() for t in r.memory.tensors()}
    r.decode_seq_tokens({0: [7, 8], 1: [9, 10]})
    spans = r.memory.byte_spans_written_by(r.memory.kv.ubatch)
    for t in r.memory.tensors():
        changed = np.flatnonzero(t.numpy().view(np.uint8).reshape(-1) != before[t.name])
        covered = np.zeros(t.nbytes(), bool)
        for tt, offs, n in spans:
            if tt is t:
                covered[offs:offs + n] = True
        assert changed.size and covered[changed].all(), f"{t.name}: a changed byte outside the spans"


def test_undo_puts_back_scribbled_spans_in_both_memories(monkeypatch):
    r = runner()
    r.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
    before = whole_memory(r)
    real = mg.Scheduler.graph_compute

    def graph_compute(sched, gf):
        real(sched, gf)
        mem = r.memory
        rng = np.random.default_rng(0)
        for t, offs, n in mem.byte_spans_written_by(mem.kv.ubatch):
            mem.write_span(t, offs, rng.integers(0, 256, n, dtype=np.uint8))
        raise Injected("injected after scribbling")
    monkeypatch.setattr(mg.Scheduler, "graph_compute", graph_compute)
    with pytest.raises(Injected):
        r.speculative_step(0, [7, 8, 9], 1)
    assert whole_memory(r) == before


def test_seq_add_and_seq_div_move_positions_in_both_memories():
    r = runner()
    ref = ToyHybridRef(r.model)
    r.decode_seq_tokens({0: [1, 2, 3]})
    ref.run(0, [1, 2, 3])
    r.memory.seq_add(0, 0, -1, 10)
    assert sorted(p for p in r.memory.kv.cells.pos if p >= 0) == [10, 11, 12]
    assert r.memory.recurrent.seq_pos_max(0) == 12 and r.next_pos(0) == 13
    close(r.decode_seq_tokens({0: [4]})[0], ref.run(0, [4]))    # no rope: only the order matters
    r.memory.seq_div(0, 0, -1, 2)
    assert sorted(p for p in r.memory.kv.cells.pos if p >= 0) == [5, 5, 6, 6]
    assert r.memory.kv.cells.has_shift


def test_a_failed_decode_zeroes_the_kv_cells_it_took_instead_of_saving_them(monkeypatch):
    """A decode step's new KV cells held no position, so the journal saves none of their bytes;
    when the step fails after its graph wrote NaN there, undo leaves those cells zero (a NaN in
    a masked cell would still reach the output: 0 * NaN), and the next steps match a runner that
    never failed."""
    r = runner()
    r.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
    saved0 = r.stats.snapshot_bytes
    r.decode_seq_tokens({0: [7], 1: [8]})
    rec_bytes = sum(t.nb[1] for t in r.memory.recurrent.tensors())
    assert r.stats.snapshot_bytes - saved0 <= 2 * rec_bytes      # no K/V bytes among them
    before = whole_memory(r)
    kv = r.memory.kv
    real = mg.Scheduler.graph_compute
    taken = []

    def graph_compute(sched, gf):
        out = real(sched, gf)
        taken.extend(kv.idxs)
        for il in kv.layers:                 # the graph "wrote" NaN into the cells it took
            kv.write_cells(il, list(kv.idxs), np.full((len(kv.idxs), kv.n_embd_k[il]), np.nan, np.float32),
                           np.full((len(kv.idxs), kv.n_embd_v[il]), np.nan, np.float32))
        raise Injected("injected failure")
    monkeypatch.setattr(mg.Scheduler, "graph_compute", graph_compute)
    with pytest.raises(Injected):
        r.decode_seq_tokens({0: [9], 1: [10]})
    monkeypatch.setattr(mg.Scheduler, "graph_compute", real)
    assert whole_memory(r) == before and taken
    for il in kv.layers:
        assert not np.any(kv.k_rows(il, taken)) and not np.any(kv.v_rows(il, taken))
    ref = runner(r.model)
    ref.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
    ref.decode_seq_tokens({0: [7], 1: [8]})
    for _ in range(2):
        got, want = r.decode_seq_tokens({0: [9], 1: [10]}), ref.decode_seq_tokens({0: [9], 1: [10]})
        assert np.all(np.isfinite(got[0])) and np.all(np.isfinite(got[1]))
        close(got[0], want[0])
        close(got[1], want[1])
