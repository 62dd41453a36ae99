"""An independent, sequential NumPy reference for the toy-hybrid model (models/toy_hybrid.py),
written from the math: one token at a time, float64, each sequence with its own conv windows and
its own list of keys and values.

Per token and layer (h = the residual stream, x = rms_norm(h), no norm weight):

    conv layer:  u = in_proj @ x;  window = [hist_1 .. hist_{L-1}, u] (oldest first)
                 y = silu(sum_i conv[:, i] * window[:, i]) * norm;  hist <- window[:, 1:]
    attn layer:  q, k, v = W_q @ x, W_k @ x, W_v @ x, split into n_head heads of d;
                 keys/values of the sequence += (k, v)
                 per head: p = softmax(K_seq q / sqrt(d)) over every token so far (this one
                 included); o = sum_j p_j V_seq[j];  y = W_o @ concat(o over heads)
    h <- h + y

logits = output @ (rms_norm(h) * output_norm)."""
from __future__ import annotations

import copy

import numpy as np

from . import rms_norm, silu, weights_of


class ToyHybridRef:
    def __init__(self, model):
        self.W = {k: np.asarray(v, np.float64) for k, v in weights_of(model).items()}
        self.n_layer, self.n_embd, self.eps = model.n_layer, model.n_embd, model.eps
        self.attn_layers = set(model.attn_layers)
        self.n_head, self.d = model.n_head, model.n_embd_head
        self.d_conv = model.d_conv
        self.seqs: dict = {}            # seq -> per-layer state: conv history or (keys, values)

    def _new_state(self):
        return [([], []) if il in self.attn_layers else np.zeros((self.n_embd, self.d_conv - 1))
                for il in range(self.n_layer)]

    def _conv(self, il, st, x):
        p = f"blk.{il}."
        u = self.W[p + "in_proj"] @ x
        window = np.concatenate([st[il], u[:, None]], axis=1)                 # [n_embd, L]
        conv = sum(self.W[p + "conv"][:, i] * window[:, i] for i in range(self.d_conv))
        st[il] = window[:, 1:].copy()
        return silu(conv) * self.W[p + "norm"]

    def _attn(self, il, st, x):
        p = f"blk.{il}."
        H, d = self.n_head, self.d
        q = (self.W[p + "attn_q"] @ x).reshape(H, d)
        keys, values = st[il]
        keys.append((self.W[p + "attn_k"] @ x).reshape(H, d))
        values.append((self.W[p + "attn_v"] @ x).reshape(H, d))
        K, V = np.array(keys), np.array(values)                               # [n, H, d]
        out = np.zeros((H, d))
        for h in range(H):
            s = K[:, h, :] @ q[h] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[h] = (w / w.sum()) @ V[:, h, :]
        return self.W[p + "attn_output"] @ out.reshape(-1)

    def step(self, seq, token) -> np.ndarray:
        st = self.seqs.setdefault(seq, self._new_state())
        h = self.W["token_embd"][token].copy()
        for il in range(self.n_layer):
            x = rms_norm(h, self.eps)
            h = h + (self._attn(il, st, x) if il in self.attn_layers else self._conv(il, st, x))
        return self.W["output"] @ (rms_norm(h, self.eps) * self.W["output_norm"])

    def run(self, seq, tokens) -> np.ndarray:
        return np.array([self.step(seq, t) for t in tokens])

    def copy_seq(self, src, dst):
        self.seqs[dst] = copy.deepcopy(self.seqs[src])

    def snapshot(self):
        return copy.deepcopy(self.seqs)

    def restore(self, snap):
        self.seqs = copy.deepcopy(snap)
