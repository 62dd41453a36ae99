"""LFM2 short-conv model (models/lfm.py, conv-only: head_count_kv all zeros) against the independent sequential reference
(tests/refs/lfm_ref.py): logits, every block's mixer output and every written rollback slot of the
r cache, for prefill, token-by-token decode, two-sequence ubatches, split batches and
n_rs_seq in {0, 1, 3}, on `ref` and `cpu`; rollback integrity (one device, and layers split over
cpu:1 / cpu:0 under each slot order); graph reuse.

The helpers here (Shadow, check_step, run_stream, rollback_trial, ...) are model-agnostic;
tests/test_model_kda.py imports them."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.models.graph import SLOT_ORDERS, GraphContext
from minigraph.models.lfm import LFM2Model
from minigraph.models.runner import Runner
from refs.lfm_ref import LfmRef

TOL = 1e-5
MAX_ERR: dict = {}          # what the tests saw, by kind (printed by the last test with -s)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    return float(np.abs(got - want).max(initial=0.0)) / scale


def expect_close(kind: str, got, want, what: str):
    e = rel_err(got, want)
    MAX_ERR[kind] = max(MAX_ERR.get(kind, 0.0), e)
    assert e <= TOL, f"{what}: relative error {e:.3g} > {TOL}"


def weights_of(model) -> dict:
    """GGUF name -> NumPy array (what the reference reads)."""
    return {name: t.numpy() for name, t in model.gguf_tensors().items()}


class Shadow:
    """The reference's own state per sequence, with the state after every token (for slots)."""

    def __init__(self, ref):
        self.ref = ref
        self.hist: dict[int, list] = {}
        self.mixers: dict[tuple, np.ndarray] = {}      # (seq, pos) -> [n_layer, n_embd]

    def feed(self, seq: int, tokens) -> np.ndarray:
        h = self.hist.setdefault(seq, [self.ref.new_state()])
        out = []
        for tok in tokens:
            logits, st, mix = self.ref.token(int(tok), h[-1])
            self.mixers[(seq, len(h) - 1)] = mix
            h.append(st)
            out.append(logits)
        return np.array(out)

    def rollback(self, seq: int, k: int):
        del self.hist[seq][-k:]

    def back(self, seq: int, j: int):
        """The state j tokens before the last one fed."""
        return self.hist[seq][-1 - j]


def cache_rows(runner, il: int):
    """(r rows, s rows or None) of layer il, NumPy [mem_size*K, n_embd_*]."""
    r, s = runner.memory.r_l[il], runner.memory.s_l.get(il)
    return r.numpy().reshape(r.ne[1], r.ne[0]), (None if s is None else s.numpy().reshape(s.ne[1], s.ne[0]))


def check_step(runner, shadow, step: dict, tag: str = ""):
    """Decode one step {seq: tokens} on the runner and on the reference; compare logits, mixer
    outputs of the last ubatch, every written slot, and that unwritten slots kept their bytes."""
    mem, model, K = runner.memory, runner.model, runner.K
    size = mem.get_size()
    before = {il: cache_rows(runner, il) for il in model.layers}
    cells_before = {seq: mem.cells[seq].tail for seq in step}
    n_ub = runner.stats.ubatches
    got = runner.decode_seq_tokens(step)
    single_ubatch = runner.stats.ubatches == n_ub + 1
    for seq, toks in step.items():
        want = shadow.feed(seq, toks)
        expect_close("logits", got[seq], want, f"{tag} logits of seq {seq}")
    # mixer outputs of the last ubatch, matched by (seq, pos)
    ub = runner.prev.params.ubatch
    for il in model.layers:
        key = f"mixer.{il}"
        if key not in runner.prev.outputs:
            continue
        arr = runner.prev.outputs[key].numpy().reshape(ub.n_tokens, -1)
        for j in range(ub.n_tokens):
            want = shadow.mixers[(ub.seq_id[j][0], ub.pos[j])][il]
            expect_close("mixer", arr[j], want, f"{tag} layer {il} mixer output, token {j} of the ubatch")
    # rollback slots: slot j of the seq's cell = the reference's state j tokens back
    for seq, toks in step.items():
        cell = mem.cells[seq].tail
        n_valid = min(len(toks), K)
        for il in model.layers:
            r_rows, s_rows = cache_rows(runner, il)
            for j in range(n_valid):
                st = shadow.back(seq, j)
                expect_close("r_slot", r_rows[j * size + cell], shadow.ref.r_row(st, il),
                             f"{tag} r cache, layer {il}, seq {seq}, slot {j}")
                if s_rows is not None:
                    expect_close("s_slot", s_rows[j * size + cell], shadow.ref.s_row(st, il),
                                 f"{tag} s cache, layer {il}, seq {seq}, slot {j}")
            if single_ubatch and cells_before[seq] == cell:
                r0, s0 = before[il]
                for j in range(n_valid, K):      # slots the ubatch did not reach stay stale
                    assert np.array_equal(r_rows[j * size + cell], r0[j * size + cell]), \
                        f"{tag} r slot {j} of seq {seq} was written by a ubatch of {len(toks)} tokens"
                    if s_rows is not None:
                        assert np.array_equal(s_rows[j * size + cell], s0[j * size + cell])
    return got


def tokens(rng, n, n_vocab):
    return [int(x) for x in rng.integers(0, n_vocab, n)]


def make_stream(n_vocab, seed=0):
    rng = np.random.default_rng(seed)
    t = lambda n: tokens(rng, n, n_vocab)  # noqa: E731
    return [
        {0: t(6)},                  # prefill
        {0: t(1)}, {0: t(1)},       # token by token
        {0: t(4), 1: t(4)},         # two sequences in one ubatch (seq 1 starts from zero state)
        {0: t(1), 1: t(1)},         # two sequences, one token each
        {1: t(3)},
        {0: t(5), 1: t(5)},         # 10 tokens > n_ubatch 8: split into ubatches
        {0: t(2), 1: t(2)},
    ]


def run_stream(runner, ref, n_vocab, tag):
    shadow = Shadow(ref)
    for i, step in enumerate(make_stream(n_vocab)):
        check_step(runner, shadow, step, f"{tag} step {i}")
    return shadow


@pytest.fixture
def one_cpu_thread():
    """Run the cpu devices with one thread in the long multi-step tests: results are the same
    bits (mul_mat's tiles do not depend on the thread count) and the time stays small when other
    processes share the two cores (OpenMP barriers spin otherwise). The reference tests keep the
    default thread count."""
    devs = [mg.backend("cpu:0"), mg.backend("cpu:1")]
    saved = [d.n_threads for d in devs]
    for d in devs:
        d.set_n_threads(1)
    yield
    for d, n in zip(devs, saved):
        d.n_threads = n


# -- model factory ----------------------------------------------------------------------------

CFG = dict(n_vocab=64, n_embd=64, n_layer=2, l_cache=3, n_ff=96)


def lfm(devices, seed=0, **kw):
    """A conv-only LFM2 (head_count_kv all zeros: LFM2Model's default has attention blocks,
    tested in tests/test_model_lfm_hybrid.py), what the short-conv reference computes."""
    kw = {**CFG, **kw}
    kw.setdefault("head_count_kv", [0] * kw["n_layer"])
    return LFM2Model(**kw, devices=devices, seed=seed, layer_outputs=True)


def lfm_ref(model):
    return LfmRef(weights_of(model), model.n_layer, model.n_embd, model.l_cache, model.eps)


# -- tests ------------------------------------------------------------------------------------

def test_model_shape_and_memory_sizes():
    m = lfm(mg.backend("ref"))
    assert m.arch == "lfm2" and m.supports_rollback and m.causal
    assert m.n_embd_r(0) == (3 - 1) * 64 and m.n_embd_s(0) == 0
    r = Runner(m, mem_size=2, n_rs_seq=2)
    assert r.memory.s_l[0] is None and r.memory.r_l[0].ne[:2] == (128, 2 * 3)
    names = set(m.gguf_tensors())
    assert {"token_embd.weight", "token_embd_norm.weight", "output.weight",
            "blk.1.shortconv.in_proj.weight", "blk.1.shortconv.conv.weight", "blk.1.shortconv.out_proj.weight",
            "blk.1.attn_norm.weight", "blk.1.ffn_norm.weight", "blk.1.ffn_gate.weight"} <= names
    assert m.gguf_tensors()["blk.0.shortconv.in_proj.weight"].ne[:2] == (64, 3 * 64)


def test_weights_live_on_their_layer_device():
    d1, d0 = mg.backend("cpu:1"), mg.backend("cpu:0")
    m = lfm([d1, d0])
    assert m.host is d0
    for name, t in m.gguf_tensors().items():
        want = d1 if name.startswith("blk.0.") else d0
        assert t.backend is want, name


def test_conv_history_is_stored_only_through_build_conv_state_store(monkeypatch):
    calls = []
    orig = GraphContext.build_conv_state_store

    def spy(self, inp, s, conv_x, n_cols, offs=0):
        calls.append((s.name, n_cols, offs))
        return orig(self, inp, s, conv_x, n_cols, offs)
    monkeypatch.setattr(GraphContext, "build_conv_state_store", spy)
    r = Runner(lfm(mg.backend("ref")), mem_size=2, n_rs_seq=1)
    r.decode_seq_tokens({0: [1, 2, 3]})
    assert calls == [("cache_r_l0", 2, 0), ("cache_r_l1", 2, 0)]


@pytest.mark.parametrize("n_rs_seq", [0, 1, 3])
@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_matches_reference(device, n_rs_seq):
    m = lfm(mg.backend(device))
    r = Runner(m, mem_size=2, n_rs_seq=n_rs_seq, n_ubatch=8)
    run_stream(r, lfm_ref(m), CFG["n_vocab"], f"[{device} n_rs_seq={n_rs_seq}]")


# -- rollback integrity -----------------------------------------------------------------------

def live_rows(runner, seq):
    cell = runner.memory.cells[seq].tail
    out = []
    for il in runner.model.layers:
        r, s = cache_rows(runner, il)
        out.append(r[cell].copy())
        if s is not None:
            out.append(s[cell].copy())
    return out


def rollback_trial(make_model, n_vocab, seed, rounds=4, slot_order="per-layer", check_ref=None,
                   exact=True):
    """A speculative runner (drafts, random accepted prefix, rollback of the rest, continue)
    against a runner that only ever sees the accepted tokens: logits and live state equal.

    exact: bit for bit (the `ref` backend, whose kernels give every token column the same
    arithmetic whatever the ubatch size); otherwise within TOL (the `cpu` mul_mat tiles 4 token
    columns at a time, so a token's last bits depend on the ubatch's size, as in ggml; a wrong
    slot would be off by far more). Returns the final logits of the speculative runner."""
    def same(kind, x, y, what):
        if exact:
            assert np.array_equal(x, y), what
        else:
            expect_close(kind, x, y, what)

    rng = np.random.default_rng(seed)
    n_rs_seq = int(rng.integers(1, 4))
    spec = Runner(make_model(), mem_size=2, n_rs_seq=n_rs_seq, slot_order=slot_order, validate=exact)
    plain = Runner(make_model(), mem_size=2, n_rs_seq=n_rs_seq, slot_order=slot_order)
    prompt = tokens(rng, int(rng.integers(n_rs_seq + 1, 8)), n_vocab)
    a, b = spec.decode_seq_tokens({0: prompt})[0], plain.decode_seq_tokens({0: prompt})[0]
    assert np.array_equal(a, b)                                # same ubatches: same bits
    shadow = Shadow(check_ref) if check_ref is not None else None
    if shadow is not None:
        shadow.feed(0, prompt)
    last, n_rolled = None, 0
    for _ in range(rounds):
        d = int(rng.integers(1, n_rs_seq + 2))                 # up to n_rs_seq + 1 drafted
        draft = tokens(rng, d, n_vocab)
        n_accept = int(rng.integers(1, d + 1))                 # k = d - n_accept < d
        n_rolled += n_accept < d
        got = spec.speculative_step(0, draft, n_accept)
        want = plain.decode_seq_tokens({0: draft[:n_accept]})[0]
        same("spec_vs_plain", got, want, "accepted-token logits differ")
        nxt = tokens(rng, int(rng.integers(1, 3)), n_vocab)
        a, b = spec.decode_seq_tokens({0: nxt})[0], plain.decode_seq_tokens({0: nxt})[0]
        same("spec_vs_plain", a, b, "logits after the rollback differ")
        for x, y in zip(live_rows(spec, 0), live_rows(plain, 0)):
            same("spec_vs_plain", x, y, "live state after the rollback differs")
        if shadow is not None:
            shadow.feed(0, draft[:n_accept])
            expect_close("rollback_logits", a, shadow.feed(0, nxt), "logits after rollback vs reference")
        last = a
    assert spec.stats.rollbacks == n_rolled and spec.stats.rollbacks_refused == 0
    return last


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_rollback_integrity(device, one_cpu_thread):
    m0 = lfm(mg.backend(device))
    ref = lfm_ref(m0)
    for seed in range(6):
        rollback_trial(lambda: lfm(mg.backend(device)), CFG["n_vocab"], seed,
                       check_ref=ref if seed < 2 else None, exact=device == "ref")


@pytest.mark.parametrize("slot_order", SLOT_ORDERS)
def test_rollback_integrity_layers_on_two_devices(slot_order, one_cpu_thread):
    d1, d0 = mg.backend("cpu:1"), mg.backend("cpu:0")
    for seed in range(2):
        split = rollback_trial(lambda: lfm([d1, d0]), CFG["n_vocab"], seed, slot_order=slot_order, exact=False)
        single = rollback_trial(lambda: lfm(d0), CFG["n_vocab"], seed, slot_order=slot_order, exact=False)
        assert np.array_equal(split, single)                   # same kernels, same shapes: same bits


# -- graph reuse --------------------------------------------------------------------------------

def test_graph_reuse_rebuilds_only_on_shape_change_and_validates(one_cpu_thread):
    m = lfm(mg.backend("cpu"))
    r = Runner(m, mem_size=2, n_rs_seq=2, validate=True)
    r.decode_seq_tokens({0: [1, 2, 3, 4]})
    assert (r.stats.builds, r.stats.reuses) == (1, 0)
    for t in range(5, 9):
        r.decode_seq_tokens({0: [t]})
    assert (r.stats.builds, r.stats.reuses) == (2, 3)
    r.decode_seq_tokens({0: [9, 10]})              # new shape: rebuilt
    r.decode_seq_tokens({0: [11, 12]})             # same shape: reused
    assert (r.stats.builds, r.stats.reuses) == (3, 4)
    assert r.stats.validated == r.stats.reuses


@pytest.mark.parametrize("device", ["ref", "cpu"])
def test_reuse_on_equals_reuse_off(device, one_cpu_thread):
    outs = []
    for reuse in (True, False):
        r = Runner(lfm(mg.backend(device)), mem_size=2, n_rs_seq=1, reuse=reuse, validate=reuse)
        logits = [r.decode_seq_tokens(step) for step in make_stream(CFG["n_vocab"], seed=3)]
        outs.append((logits, [x for il in r.model.layers for x in cache_rows(r, il) if x is not None]))
    (l_on, s_on), (l_off, s_off) = outs
    for a, b in zip(l_on, l_off):
        for s in a:
            assert np.array_equal(a[s], b[s])
    for a, b in zip(s_on, s_off):
        assert np.array_equal(a, b)
