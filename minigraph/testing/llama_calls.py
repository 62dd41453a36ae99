"""The same decode calls on llama.cpp and on a minigraph runner, and how far apart the logits
are: what the llama.cpp oracle tests (tests/test_llama_oracle_*.py) and the agreement table
(bench/llama_agreement.py) share.

A call list is a sequence of
    ("decode", {seq: [token ids]})             -> {seq: logits [n, n_vocab]}
    ("draft", seq, [draft tokens], n_accept)    -> {seq: the draft's logits}, rejected tokens rolled back
    ("seq_add", seq, p0, p1, delta) / ("seq_div", seq, p0, p1, d)   -> {} (positions moved)
llama.cpp's side runs in a worker process (LlamaOracleProcess); when its context has no rollback
snapshots (n_rs_seq 0: llama.cpp clamps it for mamba2 and kimi-linear) a draft is rolled back
through a checkpoint in a spare sequence, asked for only when the calls hold a draft (an unused
extra sequence makes llama.cpp 0.3.36 abort on kimi-linear batches of two sequences whose MLA
block precedes a KDA block: GGML_ASSERT(ggml_can_repeat(b, a)) in ggml_add)."""
from __future__ import annotations

import numpy as np

from . import llama_oracle as lo

N_UBATCH = 8
N_RS_SEQ = 3
PROMPT = [3, 17, 5, 40, 11, 2, 29, 8, 33, 14, 6]       # 11 tokens: ubatches of 8 and 3
# (name, n_seq_max, calls)
SCENARIOS = [
    ("prefill", 1, [("decode", {0: PROMPT})]),
    ("decode", 1, [("decode", {0: PROMPT[:5]})] + [("decode", {0: [t]}) for t in [9, 21, 1, 47, 0, 30]]),
    ("two sequences", 2, [("decode", {0: PROMPT[:6], 1: PROMPT[5:]})]
     + [("decode", {0: [i + 1], 1: [40 - i]}) for i in range(4)]
     + [("decode", {1: [7, 8, 9]}), ("decode", {0: [12], 1: [13]})]),
    ("draft rolled back", 1, [("decode", {0: PROMPT[:6]}), ("draft", 0, [19, 23, 29, 31], 2),
                              ("decode", {0: [2]}), ("decode", {0: [4]})]),
]
# positions moved by seq_add / seq_div, then decoded on: a rope model's cached keys are re-rotated
# by the distance before the next graph (llama.cpp's K shift)
K_SHIFT_SCENARIOS = [
    ("seq_add whole sequence", 1, [("decode", {0: PROMPT}), ("seq_add", 0, 0, -1, 7), ("decode", {0: [4]}),
                                   ("decode", {0: [9, 1]})]),
    ("seq_add one of two", 2, [("decode", {0: PROMPT[:6], 1: PROMPT[5:]}), ("seq_add", 1, 0, -1, 5),
                               ("decode", {0: [1], 1: [2]}), ("seq_add", 0, 0, -1, -3), ("decode", {0: [3], 1: [4]})]),
    ("seq_add a gap", 1, [("decode", {0: PROMPT}), ("seq_add", 0, 4, -1, 3), ("decode", {0: [4, 5]})]),
    ("seq_div", 1, [("decode", {0: PROMPT}), ("seq_div", 0, 0, -1, 2), ("decode", {0: [4]})]),
]


def has_draft(calls) -> bool:
    return any(c[0] == "draft" for c in calls)


def llama_side(path, n_seq: int, calls, *, kv_f32: bool = True, n_rs_seq: int = N_RS_SEQ,
               n_ubatch: int = N_UBATCH) -> list:
    """llama.cpp's results for the calls (one dict per call). kv_f32: an f32 K/V cache (else
    llama.cpp's default f16). n_rs_seq 0: drafts roll back through a checkpoint. Raises
    lo.LlamaOracleError (one line) when llama.cpp refuses or dies."""
    spare = n_seq if (n_rs_seq == 0 and has_draft(calls)) else None
    res = []
    with lo.LlamaOracleProcess(path, n_ubatch=n_ubatch, n_seq_max=n_seq + (spare is not None), n_rs_seq=n_rs_seq,
                               n_threads=1, kv_f32=kv_f32) as ll:
        if ll.n_rs_seq != n_rs_seq:
            raise lo.LlamaOracleError(f"llama.cpp gave the context n_rs_seq {ll.n_rs_seq}, asked {n_rs_seq}")
        for c in calls:
            if c[0] == "decode":
                res.append(ll.decode(c[1]))
            elif c[0] in ("seq_add", "seq_div"):
                getattr(ll, c[0])(*c[1:])
                res.append({})
            else:
                res.append({c[1]: ll.speculative_step(c[1], c[2], c[3], spare=spare)})
    return res


def runner_side(runner, calls) -> list:
    """The same calls on a minigraph Runner (models/runner.py); a draft returns all its logits
    (as llama.cpp's speculative_step does), then the rejected tokens are rolled back."""
    res = []
    for c in calls:
        if c[0] == "decode":
            res.append(runner.decode_seq_tokens(c[1]))
        elif c[0] in ("seq_add", "seq_div"):
            getattr(runner, c[0])(*c[1:])
            res.append({})
        else:
            _, seq, draft, n_accept = c
            res.append({seq: runner.decode_seq_tokens({seq: draft})[seq]})
            if not runner.rollback(seq, len(draft) - n_accept):
                raise RuntimeError(f"minigraph refused to roll back {len(draft) - n_accept} tokens of seq {seq}")
    return res


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (float64)."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"logits of shape {a.shape} against {b.shape}")
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def call_errors(got: list, want: list):
    """(call index, seq, relative error) of every logits pair of two result lists."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} results against {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if set(g) != set(w):
            raise ValueError(f"call {i}: sequences {sorted(g)} against {sorted(w)}")
        for s in w:
            yield i, s, rel_err(g[s], w[s])
