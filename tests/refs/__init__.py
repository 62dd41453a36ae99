"""Independent sequential NumPy references for the model graphs in models/.

Written from the math of each architecture, not from the graph code: one token at a time, float64,
explicit loops/einsums, each sequence with its own conv window and recurrent state. Weights are
read by their GGUF names, as NumPy arrays (reversed ggml ne), so W @ x applies a [n_in, n_out]
(ne) matrix to a vector of n_in.

Both references share this small base: per-sequence state, a history of the cache rows after every
token (for the rollback-slot checks), snapshot/restore."""
from __future__ import annotations

import copy

import numpy as np


def weights_of(model) -> dict:
    """{GGUF name: NumPy array} read back from the model's weight tensors."""
    return {name: t.numpy() for name, t in model.gguf_tensors().items()}


def rms_norm(x, eps):
    """x / sqrt(mean(x^2) + eps) over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


class SeqRef:
    """Per-sequence bookkeeping shared by the references.

    Subclasses define new_state() -> per-layer state list, mix(il, st, x) -> mixer output (and
    update st in place), block(il, st, h) -> h after the whole block, and rows(st) ->
    {il: (r_row, s_row)} in the cache's layout."""

    def __init__(self, W: dict, eps: float):
        self.W = {k: np.asarray(v, np.float64) for k, v in W.items()}
        self.eps = eps
        self.seqs: dict = {}        # seq -> per-layer state
        self.history: dict = {}     # seq -> list of rows() after each token (newest last)
        self.last_layer_out: dict = {}   # seq -> list of residual outputs per layer (last token)

    def state(self, seq):
        if seq not in self.seqs:
            self.seqs[seq] = self.new_state()
            self.history[seq] = []
        return self.seqs[seq]

    def step(self, seq, token) -> np.ndarray:
        """Feed one token of seq; returns the logits [n_vocab]."""
        st = self.state(seq)
        h = self.W["token_embd.weight"][token].copy()              # [n_embd]
        outs = []
        for il in range(self.n_layer):
            h = self.block(il, st[il], h)
            outs.append(h.copy())
        self.last_layer_out[seq] = outs
        h = rms_norm(h, self.eps) * self.W["output_norm.weight"]
        out_w = self.W.get("output.weight", self.W["token_embd.weight"])   # tied when absent
        self.history[seq].append(self.rows(st))
        return out_w @ h

    def run(self, seq, tokens):
        """Feed tokens; returns (logits [n, n_vocab], layer outputs [n_layer, n, n_embd])."""
        logits, louts = [], []
        for t in tokens:
            logits.append(self.step(seq, t))
            louts.append(self.last_layer_out[seq])
        return np.array(logits), np.array(louts).transpose(1, 0, 2)

    def rows_back(self, seq, j):
        """{il: (r_row, s_row)}: the cache rows as they were j tokens ago (j=0: now)."""
        return self.history[seq][-1 - j]

    def snapshot(self):
        return copy.deepcopy((self.seqs, self.history))

    def restore(self, snap):
        self.seqs, self.history = copy.deepcopy(snap)


# -- comparison harness shared by tests/test_model_*.py --------------------------------------------
TOL = 1e-5          # the bar: f32 relative error per layer and per model

MAX_ERR: dict = {}  # what the tests measured, by (model arch, what): the largest relative error


class PreNormFfnRef:
    """The whole-model loop LFM2 and KDA share (llama.cpp's layout): per block a pre-RMS-norm mixer and a
    SwiGLU feed-forward, each added to the residual; a final norm (named by ``final_norm``) and the
    output head. Subclasses provide ``mixer(il, u, state) -> (out, new state)``."""

    final_norm = "output_norm.weight"

    def ffn(self, il: int, x: np.ndarray):
        p = f"blk.{il}."
        u = rms_norm(x, self.eps) * self.w[p + "ffn_norm.weight"]
        return self.w[p + "ffn_down.weight"] @ (silu(self.w[p + "ffn_gate.weight"] @ u) * (self.w[p + "ffn_up.weight"] @ u))

    def token(self, tok: int, state: list):
        """Returns (logits [n_vocab], new state, per-block mixer outputs [n_layer, n_embd])."""
        x = self.w["token_embd.weight"][tok].copy()
        new, mixers = [], []
        for il in range(self.n_layer):
            u = rms_norm(x, self.eps) * self.w[f"blk.{il}.attn_norm.weight"]
            m, st = self.mixer(il, u, state[il])
            new.append(st)
            mixers.append(m)
            x = x + m
            x = x + self.ffn(il, x)
        y = rms_norm(x, self.eps) * self.w[self.final_norm]
        return self.w["output.weight"] @ y, new, np.array(mixers)


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (the reference's scale)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return float(np.max(np.abs(got - want))) / scale if scale > 0 else float(np.max(np.abs(got)))


def check(arch, what, got, want, tol=TOL):
    e = rel_err(got, want)
    MAX_ERR[(arch, what)] = max(MAX_ERR.get((arch, what), 0.0), e)
    assert e <= tol, f"{arch}: {what}: relative error {e:.3g} > {tol:g}"
    return e


def cache_arrays(runner) -> dict:
    """{(il, 'r'|'s'): the whole cache [mem_size*K, n_embd] as f32}"""
    out = {}
    for il in runner.model.layers:
        for kind, t in (("r", runner.memory.r_l.get(il)), ("s", runner.memory.s_l.get(il))):
            if t is not None:
                out[(il, kind)] = t.numpy().reshape(t.ne[1], t.ne[0]).copy()
    return out


def decode_and_check(runner, ref, step: dict, one_ubatch: bool = True) -> None:
    """Decode step = {seq: [tokens]} with the runner and the reference; check logits, every
    layer's residual output (models built with layer_outputs=True) and the cache: for each seq
    of the last ubatch, slot j < min(n, K) of the r and s rows of its cell = the reference's
    state j tokens back, slots j >= min(n, K) untouched by the step."""
    arch = runner.model.arch
    start = {s: runner.next_pos(s) for s in step}
    before = cache_arrays(runner)
    n_ub = runner.stats.ubatches
    out = runner.decode_seq_tokens(step)
    want = {s: ref.run(s, toks) for s, toks in step.items()}
    for s in step:
        check(arch, "logits", out[s], want[s][0])
    if one_ubatch:
        assert runner.stats.ubatches == n_ub + 1, "the step was meant to be one ubatch"
    res = runner.prev
    ub = res.params.ubatch
    for il in runner.model.layers:
        name = f"l_out.{il}"
        if name not in res.outputs:
            continue
        got = res.outputs[name].numpy().reshape(ub.n_tokens, -1)
        for j in range(ub.n_tokens):
            s = ub.seq_id[j][0]
            check(arch, f"layer {il} output", got[j], want[s][1][il][ub.pos[j] - start[s]])
    # state slots of the sequences in the last ubatch
    mem, K = runner.memory, runner.memory.K
    after = cache_arrays(runner)
    n = ub.n_seq_tokens
    for s in sorted({ids[0] for ids in ub.seq_id}):
        cell = mem.cells[s].tail
        for j in range(K):
            row = mem.row_index(cell, j)
            for il in runner.model.layers:
                r_want, s_want = ref.rows_back(s, j)[il] if j < min(n, K) else (None, None)
                for kind, w in (("r", r_want), ("s", s_want)):
                    if (il, kind) not in after:
                        continue
                    got = after[(il, kind)][row]
                    if w is not None:
                        check(arch, f"layer {il} {kind} state slot", got, w)
                    else:
                        assert np.array_equal(got.view(np.uint32), before[(il, kind)][row].view(np.uint32)), \
                            f"{arch}: layer {il} {kind} slot {j} of seq {s} was written by a {n}-token ubatch"


def run_slot_rows(runner, seq: int, n: int) -> dict:
    """{(il, kind, j): row} for the slots j < min(n, K) written for seq by its last ubatch of n tokens."""
    mem = runner.memory
    cell = mem.cells[seq].tail
    arrs = cache_arrays(runner)
    return {(il, kind, j): a[mem.row_index(cell, j)].copy()
            for (il, kind), a in arrs.items() for j in range(min(n, mem.K))}


def rollback_scenario(make_runner, ref, seed: int, n_vocab: int, n_rs_seq: int | None = None,
                      rounds: int = 3) -> None:
    """Speculative decoding on two sequences: each round, each sequence decodes a draft of
    d <= n_rs_seq + 1 tokens, keeps a random prefix (>= 1) and rolls back the rest, then both
    continue with one token in one ubatch. The logits and the written state slots must equal
    a runner that only saw the accepted tokens (bit for bit on `ref`, within TOL on cpu), and the
    reference (which also only sees them) within TOL. make_runner(n_rs_seq) -> a fresh Runner."""
    rng = np.random.default_rng(seed)
    if n_rs_seq is None:
        n_rs_seq = int(rng.integers(1, 4))
    spec, plain = make_runner(n_rs_seq), make_runner(n_rs_seq)
    arch = spec.model.arch
    toks = lambda n: [int(x) for x in rng.integers(0, n_vocab, n)]   # noqa: E731

    # bit for bit on `ref`; the cpu backend's mul_mat sums in a different order for a different
    # number of tokens (4x4 tiles vs leftover columns, as ggml's CPU kernels do), so the two runs,
    # which put the accepted tokens in ubatches of different sizes, agree to f32 rounding there
    # (within TOL; measured up to a few 1e-6 after several rounds on three layers)
    exact = all(d.name == "ref" for d in spec.model.layer_devices)

    def same(a, b, what):
        a, b = np.asarray(a), np.asarray(b)
        if exact:
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
                f"{arch} seed {seed}: {what}: the rolled-back run differs from the plain run"
        else:
            e = rel_err(a, b)
            MAX_ERR[(arch, "rollback vs plain run")] = max(MAX_ERR.get((arch, "rollback vs plain run"), 0.0), e)
            assert e <= TOL, f"{arch} seed {seed}: {what}: the rolled-back run differs from the plain run ({e:.3g})"

    def both(step):
        a, b = spec.decode_seq_tokens(step), plain.decode_seq_tokens(step)
        for s, t in step.items():
            same(a[s], b[s], f"logits of {t} on seq {s}")
            check(arch, "rollback logits", a[s], ref.run(s, t)[0])
        n = len(next(iter(step.values())))
        for s in step:
            ga, gb = run_slot_rows(spec, s, n), run_slot_rows(plain, s, n)
            for key in ga:
                same(ga[key], gb[key], f"state {key} of seq {s}")
                il, kind, j = key
                check(arch, "rollback state", ga[key], ref.rows_back(s, j)[il][0 if kind == "r" else 1])

    both({0: toks(5), 1: toks(5)})
    for rnd in range(rounds):
        for s in (0, 1):
            d = int(rng.integers(1, n_rs_seq + 2))           # up to n_rs_seq + 1 drafted
            n_accept = int(rng.integers(1, d + 1))           # keep >= 1: k = d - n_accept < d
            if rnd == 0 and s == 0:
                d, n_accept = n_rs_seq + 1, 1                # the deepest rollback, k = n_rs_seq
            draft = toks(d)
            got = spec.speculative_step(s, draft, n_accept)
            want = plain.decode_seq_tokens({s: draft[:n_accept]})[s]
            same(got, want, f"accepted logits of seq {s}")
            check(arch, "rollback logits", got, ref.run(s, draft[:n_accept])[0])
        both({0: toks(1), 1: toks(1)})
    both({0: toks(3), 1: toks(3)})
    assert spec.stats.rollbacks > 0 and spec.stats.rollbacks_refused == 0
