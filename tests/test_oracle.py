"""minigraph's reference backend against real ggml (libggml-python 0.20.2.post1, CPU).

Every op case of minigraph.testing.op_cases that ggml can run is built twice from the same seed, once
computed by minigraph's `ref` backend and once by ggml through minigraph/ggml_oracle.py, and the
outputs compared (bit for bit for copies and index ops). The conv-state store (the
n_rs_seq > 0 path: overlapping windows into rollback slots) is also run whole and every byte of the state buffer compared.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import CASES, Built, compare, run_built
from minigraph.tensor import Context

if importlib.util.find_spec("libggml") is None:
    pytest.skip("real ggml is not installed: pip install libggml-python==0.20.2.post1 "
                "(the 'test' extra) to run the oracle tests", allow_module_level=True)

from minigraph.testing.ggml_oracle import GgmlRefuses, run_in_ggml  # noqa: E402

pytestmark = pytest.mark.oracle

SEEDS = (0, 1, 2, 3, 4)

# Cases that minigraph accepts but real ggml aborts on: the oracle refuses them before ggml
# sees them (a failed GGML_ASSERT would kill the test process). Disagreements to fix in
# minigraph (see the report), not in the oracle.
# cases ggml cannot run (it would abort): id -> why. minigraph's shape rules refuse every such
# input, so this stays empty; an entry here is a rule gap to close.
KNOWN_REFUSED: dict = {}


def _params():
    for case in CASES:
        if not case.ggml:
            continue
        marks = ()
        if case.id in KNOWN_REFUSED:
            marks = pytest.mark.xfail(raises=GgmlRefuses, strict=True, reason=KNOWN_REFUSED[case.id])
        yield pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_case_matches_ggml(case):
    for seed in SEEDS:
        expected = run_built(case.make(np.random.default_rng(seed)), mg.backend("ref"))
        built = case.make(np.random.default_rng(seed))
        actual = run_in_ggml(built)
        why = compare(case, built, actual, expected,
                      nmse_limit=None if case.exact else max(case.nmse, 1e-10))
        assert why is None, f"seed {seed}: ggml vs minigraph ref: {why}"


def test_every_ggml_case_is_covered():
    """The oracle translates every op that a ggml-runnable case uses."""
    from minigraph.testing.ggml_oracle import translation_problem
    problems = [translation_problem(op) for op in sorted({c.op for c in CASES if c.ggml})]
    assert [p for p in problems if p] == []


# -- the conv-state store (with rollback slots; a plain copy when K == 1) --------------------------
N_COLS, CHANNELS, N_SEQS, MEM_SIZE, HEAD, OFFS_ELTS = 3, 5, 2, 4, 1, 7


def conv_state_store(rng, n: int, K: int) -> tuple[Built, np.ndarray]:
    """The store built with minigraph's public API, and the state NumPy says it must leave."""
    elt = 4
    n_embd_r = OFFS_ELTS + N_COLS * CHANNELS + 2            # the part lives inside a longer row
    row_size, offs = n_embd_r * elt, OFFS_ELTS * elt
    b = Built(Context())
    s = b.leaf(mg.f32, (n_embd_r, MEM_SIZE * K), rng=rng)
    hist = b.leaf(mg.f32, (N_COLS, CHANNELS, N_SEQS), rng=rng)
    new = b.leaf(mg.f32, (n, CHANNELS, N_SEQS), rng=rng)
    conv_x = mg.concat(hist, new, 0)                         # [n_cols + n, channels, n_seqs]
    cell_offs = HEAD * row_size + offs
    if K == 1:   # n_rs_seq == 0: plain copy of the last n_cols columns
        last = mg.view_3d(conv_x, N_COLS, CHANNELS, N_SEQS, conv_x.nb[1], conv_x.nb[2], n * elt)
        cell = mg.view_2d(s, N_COLS * CHANNELS, N_SEQS, row_size, cell_offs)
        b.out(mg.cpy(last, cell))
    else:
        kw = min(n, K)
        rev = mg.cast(mg.scale_bias(mg.arange(b.ctx, 0.0, float(K), 1.0), -1.0, float(K - 1)), mg.i32)
        slot_order = mg.view_1d(rev.set_name("s_slot_rev"), kw, (K - kw) * elt)
        windows = mg.view_4d(conv_x, N_COLS, kw, CHANNELS, N_SEQS, elt, conv_x.nb[1], conv_x.nb[2],
                             (n - (kw - 1)) * elt)            # overlapping: nb1 == elt
        slots = mg.view_4d(s, N_COLS, K, CHANNELS, N_SEQS, MEM_SIZE * row_size, N_COLS * elt,
                           row_size, cell_offs)               # permuted view of the cache
        b.out(mg.set_rows(slots, windows, slot_order))
    b.out(s)

    # the invariant: slot j (j < min(n, K)) of seq q = conv_x columns n-j .. n-j+n_cols-1
    state = b.data[s].reshape(s.shape).copy()                  # [mem_size*K, n_embd_r]
    cx = np.concatenate([b.data[hist], b.data[new]], axis=-1)[0]   # [n_seqs, channels, n_cols+n]
    for j in range(min(n, K)):
        for q in range(N_SEQS):
            part = cx[q, :, n - j:n - j + N_COLS]             # [channels, n_cols]
            state[j * MEM_SIZE + HEAD + q, OFFS_ELTS:OFFS_ELTS + N_COLS * CHANNELS] = part.reshape(-1)
    return b, state


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_conv_state_store_matches_ggml(n, K):
    for seed in (0, 1):
        ref_built, expected = conv_state_store(np.random.default_rng(seed), n, K)
        ref_state = run_built(ref_built, mg.backend("ref"))[-1]
        for n_threads in (1, 2):
            built, _ = conv_state_store(np.random.default_rng(seed), n, K)
            ggml_state = run_in_ggml(built, n_threads=n_threads)[-1]
            assert ggml_state.shape == ref_state.shape == expected.shape
            assert np.all(expected != 0), "random state data must be non-zero"
            # every byte of the state buffer, stale slots and the rest of each row included
            assert np.array_equal(ggml_state.view(np.uint8), expected.view(np.uint8)), \
                f"seed {seed}, {n_threads} threads: ggml's state differs from the invariant"
            assert np.array_equal(ref_state.view(np.uint8), ggml_state.view(np.uint8)), \
                f"seed {seed}: minigraph ref's state differs from ggml's"
