"""An independent, sequential NumPy reference for qwen35 with attention blocks
(models/delta_net.py with full_attention_interval), written from the math: one token at a time,
float64, each sequence with its own delta-net states and its own list of (already rotated) keys
and values per attention block. Delta-net blocks are DeltaNetRef's.

A gated attention block (every block il with (il + 1) % interval == 0), for the token at position
p (tokens the sequence has seen before it), u = rms(x) * attn_norm:

    W_q u, per head h: [q_h | g_h] (2 * d rows);  k, v = W_k u, W_v u split into n_head_kv heads
    q_h = rope(rms(q_h) * q_norm, p);  k_h = rope(rms(k_h) * k_norm, p)
    rope (IMROPE, text tokens): pairs (i, i + n_rot/2) for i < n_rot/2, dims >= n_rot kept;
        theta_i = p_s * base^(-2i/n_rot), where the pair's stream s follows sector = i mod
        sum(sections): sector mod 3 = 0, 1, 2 and sector < 3 * sections[0, 1, 2] -> t, h, w
        (position p), otherwise e (position 0)
    query head h reads K/V head h // (n_head / n_head_kv):
        w = softmax(K_g q_h / sqrt(d)) over every token so far;  o_h = (w V_g) * sigmoid(g_h)
    mixer = W_o concat(o_h over heads)
"""
from __future__ import annotations

import numpy as np

from . import rms_norm, sigmoid
from .delta_net_ref import DeltaNetRef


def rope_imrope(x: np.ndarray, pos: int, base: float, n_rot: int, sections) -> np.ndarray:
    """x [n_heads, d] rotated for a text token at position pos."""
    half = n_rot // 2
    total = sum(sections)
    i = np.arange(half)
    sector = i % total
    p = np.zeros(half)
    for s in range(3):
        p[(sector % 3 == s) & (sector < 3 * sections[s])] = pos
    theta = p * base ** (-2.0 * i / n_rot)
    c, s_ = np.cos(theta), np.sin(theta)
    out = x.copy()
    a, b = x[..., :half], x[..., half:n_rot]
    out[..., :half] = a * c - b * s_
    out[..., half:n_rot] = a * s_ + b * c
    return out


class DeltaNetHybridRef(DeltaNetRef):
    def __init__(self, W, *, attn_layers, n_head, n_head_kv, attn_head_dim, n_rot, rope_sections,
                 rope_freq_base, **kw):
        super().__init__(W, **kw)
        self.attn_layers = tuple(attn_layers)
        self.H, self.Hkv, self.ad, self.n_rot = n_head, n_head_kv, attn_head_dim, n_rot
        self.sections, self.base = list(rope_sections), rope_freq_base

    @classmethod
    def from_model(cls, m):
        from . import weights_of
        return cls(weights_of(m), n_layer=m.n_layer, d_conv=m.d_conv, head_dim=m.head_k_dim,
                   num_k_heads=m.num_k_heads, num_v_heads=m.num_v_heads, eps=m.eps,
                   attn_layers=m.attn_layers, n_head=m.n_head, n_head_kv=m.n_head_kv,
                   attn_head_dim=m.attn_head_dim, n_rot=m.n_rot, rope_sections=m.rope_sections,
                   rope_freq_base=m.rope_freq_base)

    def new_state(self):
        st = super().new_state()
        for il in self.attn_layers:
            st[il] = {"k": [], "v": []}
        return st

    def rows(self, st):
        return {il: (s["conv"].T.reshape(-1).copy(), s["S"].transpose(0, 2, 1).reshape(-1).copy())
                for il, s in enumerate(st) if il not in self.attn_layers}

    def mix(self, il, st, u):
        if il not in self.attn_layers:
            return super().mix(il, st, u)
        W, p, H, Hkv, d = self.W, f"blk.{il}.", self.H, self.Hkv, self.ad
        pos = len(st["k"])
        qg = (W[p + "attn_q.weight"] @ u).reshape(H, 2, d)
        q, g = qg[:, 0], qg[:, 1]
        k = (W[p + "attn_k.weight"] @ u).reshape(Hkv, d)
        v = (W[p + "attn_v.weight"] @ u).reshape(Hkv, d)
        q = rope_imrope(rms_norm(q, self.eps) * W[p + "attn_q_norm.weight"], pos, self.base, self.n_rot, self.sections)
        k = rope_imrope(rms_norm(k, self.eps) * W[p + "attn_k_norm.weight"], pos, self.base, self.n_rot, self.sections)
        st["k"].append(k)
        st["v"].append(v)
        K, V = np.array(st["k"]), np.array(st["v"])                      # [n, Hkv, d]
        out = np.zeros((H, d))
        for h in range(H):
            gk = h // (H // Hkv)
            s = K[:, gk, :] @ q[h] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[h] = ((w / w.sum()) @ V[:, gk, :]) * sigmoid(g[h])
        return W[p + "attn_output.weight"] @ out.reshape(-1)
