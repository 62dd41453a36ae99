"""An independent, sequential NumPy reference for the hybrid LFM2 (models/lfm.py with attention
blocks), written from the math: one token at a time, float64, each sequence with its own conv
windows and its own list of (already rotated) keys and values per attention layer.

Short-conv blocks are LfmRef's. An attention block, for the token at position p (the number of
tokens the sequence has seen before it), u = rms(x) * attn_norm:

    q = W_q u split into n_head heads of d;  k, v = W_k u, W_v u split into n_head_kv heads
    q_h = rope(rms(q_h) * q_norm, p);  k_h = rope(rms(k_h) * k_norm, p)
    rope (NEOX): for i < d/2, theta = p * base^(-2i/d):
        (a, b) = (x[i], x[i + d/2]) -> (a cos - b sin, a sin + b cos)
    keys/values of the sequence += (k, v)
    query head h reads K/V head h // (n_head / n_head_kv) (GQA):
        w = softmax(K_g q_h / sqrt(d)) over every token so far (this one included);  o_h = w V_g
    mixer = W_o concat(o_h over heads)
"""
from __future__ import annotations

import copy

import numpy as np

from . import rms_norm, weights_of
from .lfm_ref import LfmRef


def rope_neox(x: np.ndarray, pos: int, base: float) -> np.ndarray:
    """x [n_heads, d] rotated by position pos, pairs (i, i + d/2)."""
    d = x.shape[-1]
    half = d // 2
    theta = pos * base ** (-2.0 * np.arange(half) / d)
    c, s = np.cos(theta), np.sin(theta)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


class LfmHybridRef(LfmRef):
    def __init__(self, model):
        super().__init__(weights_of(model), model.n_layer, model.n_embd, model.l_cache, model.eps)
        self.hkv = list(model.head_count_kv)
        self.n_head, self.d, self.base = model.n_head, model.head_dim, model.rope_freq_base
        self.seqs: dict = {}          # seq -> per-layer state

    def new_state(self):
        return [{"k": [], "v": []} if self.hkv[il] else np.zeros((self.n_embd, self.L - 1))
                for il in range(self.n_layer)]

    def mixer(self, il: int, u: np.ndarray, st):
        if not self.hkv[il]:
            return super().mixer(il, u, st)
        p, H, Hkv, d = f"blk.{il}.", self.n_head, self.hkv[il], self.d
        pos = len(st["k"])
        q = (self.w[p + "attn_q.weight"] @ u).reshape(H, d)
        k = (self.w[p + "attn_k.weight"] @ u).reshape(Hkv, d)
        v = (self.w[p + "attn_v.weight"] @ u).reshape(Hkv, d)
        q = rope_neox(rms_norm(q, self.eps) * self.w[p + "attn_q_norm.weight"], pos, self.base)
        k = rope_neox(rms_norm(k, self.eps) * self.w[p + "attn_k_norm.weight"], pos, self.base)
        st = {"k": st["k"] + [k], "v": st["v"] + [v]}
        K, V = np.array(st["k"]), np.array(st["v"])                     # [n, Hkv, d]
        out = np.zeros((H, d))
        for h in range(H):
            g = h // (H // Hkv)
            s = K[:, g, :] @ q[h] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[h] = (w / w.sum()) @ V[:, g, :]
        return self.w[p + "attn_output.weight"] @ out.reshape(-1), st

    # -- sequences ------------------------------------------------------------------------------
    def run(self, seq, tokens) -> np.ndarray:
        """Feed tokens to seq; returns their logits [n, n_vocab]."""
        st = self.seqs.setdefault(seq, self.new_state())
        out = []
        for t in tokens:
            logits, st, _ = self.token(int(t), st)
            out.append(logits)
        self.seqs[seq] = st
        return np.array(out)

    def copy_seq(self, src, dst):
        self.seqs[dst] = copy.deepcopy(self.seqs[src])

    def snapshot(self):
        return copy.deepcopy(self.seqs)

    def restore(self, snap):
        self.seqs = copy.deepcopy(snap)
