"""A tiny short-conv model: embedding, N conv layers (each on its own device), output head.

It is the smallest model that exercises the recurrent memory, the conv-state store and every
slot-order strategy; the runner's tests and bench/reuse.py use it before the real model files.
Its scaffolding (devices, seeded weights, the whole-model graph) is models.base.RecurrentModel's."""
from __future__ import annotations

import numpy as np

import minigraph as mg

from .base import RecurrentModel


class ToyConvModel(RecurrentModel):
    arch = "toy-conv"
    residual_first = True
    eps = 1e-5

    def __init__(self, n_vocab=32, n_embd=16, n_layer=2, d_conv=4, devices=None, seed=0):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding and output head live on the last device of the list (the host)."""
        super().__init__(dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, d_conv=d_conv), devices)
        self.d_conv = d_conv
        # short names, not flagged as weights: the toy's tensors as they always were (no GGUF model)
        self.make_weights(seed, suffix="", mark_weights=False)

    def layer_weights(self, mk, il):
        E = self.n_embd
        # no attn_norm: the layer input is a plain RMS norm
        return {
            "in_proj": mk(f"blk.{il}.in_proj", (E, E), 1 / np.sqrt(E)),
            "conv": mk(f"blk.{il}.conv", (self.d_conv, E), 0.5),
            "norm": mk(f"blk.{il}.norm", (E,), 0.1, 1.0),
        }

    # memory sizes (floats per cache row: conv history of d_conv-1 columns per channel, no s state)
    def n_embd_r(self, il):
        return (self.d_conv - 1) * self.n_embd

    def n_embd_s(self, il):
        return 0

    def build_layer(self, g, inp_rs, cur, il):
        """cur: rms_norm(h) [n_embd, n_tokens] -> the conv branch [n_embd, n_tokens]."""
        T, S = g.n_seq_tokens, g.n_seqs
        w = self.layer_w[il]
        r = g.mctx.r_l[il]
        x = mg.mul_mat(w["in_proj"], cur)                           # [n_embd, n_tokens]
        x = mg.reshape_3d(x, self.n_embd, T, S)                     # [n_embd, T, S]
        conv = g.build_rs(inp_rs, r, self.n_embd_r(il), S)          # [n_embd_r, S]
        conv = mg.reshape_3d(conv, self.d_conv - 1, self.n_embd, S)
        conv_x = mg.concat(conv, mg.transpose(x), 0)                # [d_conv-1+T, n_embd, S]
        g.build_conv_state_store(inp_rs, r, conv_x, self.d_conv - 1)
        y = mg.silu(mg.ssm_conv(conv_x, w["conv"]))                 # [n_embd, T, S]
        return mg.reshape_2d(mg.mul(y, w["norm"]), self.n_embd, T * S)
