"""Activation rounding ties in the reference backend's mul_mat with a half or block-type weight
(a test helper).

Before such a weight multiplies an activation row, ggml converts the row to the weight's
vec_dot type: f16, bf16, q8_0 (q8_0 and q4_0 weights) or q8_K (the K-quants), each value rounded
to a grid. When a value lies within a hair of the midpoint between two grid points, which one it
takes is decided by float32 summation order upstream, and ggml (SIMD lanes) and NumPy (pairwise)
sum in different orders: llama.cpp may take the other point. A q8 level is 1/127 of its block's
largest value, and a recurrent state or a KV cache carries it to every later token, so a single
such tie can move the logits by 1e-2 while every other number agrees to 1e-7.

`watch()` records, during a run on the ref backend, every activation value within TIE_STEPS grid
steps of a midpoint (the row it is in, its column, how close); `watch(flip=tie)` runs again with
that value moved just across the midpoint, so it takes the other grid point, in every mul_mat
that converts that same row: llama.cpp converts a row once per use too, and several weights
often share one input (attn_q/k/v, ffn_gate/up), so their products all move together. A test
that finds a disagreement can ask whether one recorded tie, resolved the other way, accounts for
all of it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from minigraph.ops import matmul
from minigraph.quants.simple import bf16_bits_to_f32, f32_to_bf16_bits

TIE_STEPS = 1e-3      # how close to a midpoint, in steps of the grid, counts as a tie
F32 = np.float32


@dataclass(frozen=True)
class Tie:
    row_key: bytes     # the activation row (src1 row) the value is in, as its bytes
    col: int           # value within the row
    vec_type: str      # the grid: f16, bf16, q8_0 or q8_k
    distance: float    # from the midpoint, in grid steps
    moved: float       # the activation value that lands on the other grid point
    where: str = field(default="", compare=False)   # the first mul_mat that met it, for messages

    def __str__(self):
        return f"{self.where} ({self.vec_type} activations), value {self.col}: {self.distance:.1e} steps from a midpoint"


def _half_grid(x, name):
    """(nearest grid value, grid step) of each value for f16 or bf16."""
    if name == "f16":
        r = x.astype(np.float16)
        return r.astype(F32), np.spacing(np.abs(r)).astype(F32)
    r = bf16_bits_to_f32(f32_to_bf16_bits(x))
    return r, (np.spacing(np.abs(r)) * F32(65536)).astype(F32)


def _scales(x, name):
    """Per value, the factor the q8 quantizer scales it by before rounding (x: blocks as rows)."""
    if name == "q8_0":                                     # 127 / absmax (ggml's x86 routine)
        m = np.abs(x).max(axis=1)
        scale = np.where(m != 0, F32(127) / np.where(m != 0, m, F32(1)), F32(0))
    else:                                                  # q8_k: -127 / the signed absmax
        m = x[np.arange(x.shape[0]), np.argmax(np.abs(x), axis=1)]
        scale = np.where(m != 0, F32(-127) / np.where(m != 0, m, F32(1)), F32(0))
    return np.broadcast_to(scale.astype(F32)[:, None], x.shape)


VEC_TYPE = {"f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0", "q4_k": "q8_k", "q6_k": "q8_k"}
BLOCK = {"q8_0": 32, "q8_k": 256}


def _ties(call, b, vec):
    """The ties among b's values (N rows of K f32) on the grid of ``vec``."""
    if vec in ("f16", "bf16"):
        near, step = _half_grid(b, vec)
        with np.errstate(invalid="ignore", divide="ignore"):
            distance = np.abs(np.abs(b - near) / step - F32(0.5))
        across = near + np.sign(b - near) * step             # the grid point on the other side
        moved = lambda n, k: across[n, k]                    # noqa: E731
    else:
        x = b.reshape(-1, BLOCK[vec])
        scale = _scales(x, vec).reshape(b.shape)
        s = b * scale
        distance = np.abs(np.abs(s - np.floor(s)) - F32(0.5))
        level = np.rint(s)

        def moved(n, k):                                   # a quarter step across the midpoint
            other = np.floor(s[n, k]) if level[n, k] == np.ceil(s[n, k]) else np.ceil(s[n, k])
            return F32((level[n, k] + other) / 2 + (other - level[n, k]) / 4) / scale[n, k]
    return [Tie(b[n].tobytes(), int(k), vec, float(distance[n, k]), float(moved(n, k)), f"mul_mat {call}, row {n}")
            for n, k in zip(*np.nonzero(distance <= TIE_STEPS))]


@contextlib.contextmanager
def watch(flip: Tie | None = None):
    """Records the ref backend's activation ties into the yielded list (each once, in the order
    first met) while active; with ``flip``, moves that one value across its midpoint wherever its
    row is converted to that grid."""
    found, seen, count = [], set(), [0]
    original = matmul.mul_mat_rows

    def watched(a_raw, name, b):
        call = count[0]
        count[0] += 1
        b = np.array(b, dtype=F32)                           # a copy: a flip must not touch the graph
        vec = VEC_TYPE[name]
        for tie in _ties(call, b, vec):
            if tie not in seen:
                seen.add(tie)
                found.append(tie)
        if flip is not None and flip.vec_type == vec and flip.col < b.shape[1]:
            for n in range(b.shape[0]):
                if b[n].tobytes() == flip.row_key:
                    b[n, flip.col] = flip.moved
        return original(a_raw, name, b)

    matmul.mul_mat_rows = watched
    try:
        yield found
    finally:
        matmul.mul_mat_rows = original


def first_resolved(ties, run, accept, limit: int):
    """(tie, result, tried): `run()` again with each of the `limit` nearest ties resolved the other
    way, nearest first, until `accept(result)`; tie and result are None when none is accepted.
    tried lists (tie, result) of every rerun, for the failure message."""
    tried = []
    for tie in sorted(ties, key=lambda t: t.distance)[:limit]:
        with watch(flip=tie):
            result = run()
        tried.append((tie, result))
        if accept(result):
            return tie, result, tried
    return None, None, tried
