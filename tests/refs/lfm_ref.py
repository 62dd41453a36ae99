"""An independent, sequential NumPy reference for LFM2 with short-conv blocks, written from the math,
not from the graph code: one token at a time, in float64, with an
explicit conv window and an explicit state per sequence.

Weights are given by their GGUF names as NumPy arrays in NumPy order (the reverse of ggml's ne):
a matrix `W` stored with ne [n_in, n_out] is the array `W[out, in]`, so a projection is `W @ x`.

Per token and block (x = the block input, d = n_embd, L = shortconv.l_cache):
    u = rms(x) * attn_norm
    B, C, X = split(in_proj @ u, 3)              (rows B | C | X)
    w_t = B * X                                    (the conv input for this token)
    window = [hist_1 .. hist_{L-1}, w_t]            (oldest first, per channel)
    conv = sum_i conv_w[:, i] * window[:, i]        (tap L-1 multiplies the newest column)
    mixer = out_proj @ (C * conv);  hist <- window[:, 1:]
    x = x + mixer;  x = x + down @ (silu(gate @ rms(x)*ffn_norm) * (up @ rms(x)*ffn_norm))
logits = output @ (rms(x) * token_embd_norm).

State of one sequence: a list over blocks of `hist` arrays [n_embd, L-1] (channel, oldest tap first).
The r-cache row layout of llama.cpp (tap fastest, then channel) is `hist.reshape(-1)`.
"""
from __future__ import annotations

import numpy as np

from . import PreNormFfnRef


class LfmRef(PreNormFfnRef):
    final_norm = "token_embd_norm.weight"

    def __init__(self, weights: dict, n_layer: int, n_embd: int, l_cache: int, eps: float):
        self.w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
        self.n_layer, self.n_embd, self.L, self.eps = n_layer, n_embd, l_cache, eps
        if "output.weight" not in self.w:                      # tied head
            self.w["output.weight"] = self.w["token_embd.weight"]

    def new_state(self):
        return [np.zeros((self.n_embd, self.L - 1)) for _ in range(self.n_layer)]

    def mixer(self, il: int, u: np.ndarray, hist: np.ndarray):
        """One short-conv step: (output [n_embd], new history [n_embd, L-1])."""
        p, d = f"blk.{il}.shortconv.", self.n_embd
        bcx = self.w[p + "in_proj.weight"] @ u
        B, C, X = bcx[:d], bcx[d:2 * d], bcx[2 * d:]
        window = np.concatenate([hist, (B * X)[:, None]], axis=1)      # [n_embd, L]
        conv = np.zeros(d)
        for i in range(self.L):
            conv += self.w[p + "conv.weight"][:, i] * window[:, i]
        return self.w[p + "out_proj.weight"] @ (C * conv), window[:, 1:].copy()

    # cache-row layouts (what llama.cpp's memory holds for one cell)
    def r_row(self, state: list, il: int) -> np.ndarray:
        return state[il].reshape(-1)

    def s_row(self, state: list, il: int):
        return None
