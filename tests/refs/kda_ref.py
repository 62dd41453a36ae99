"""An independent, sequential NumPy reference for Kimi-Linear with KDA blocks and dense FFNs,
written from the math, not from the graph code: one token at a
time, in float64, explicit conv windows and an explicit delta-rule state per head and sequence.

Weights are given by their GGUF names as NumPy arrays in NumPy order (the reverse of ggml's ne):
a matrix stored with ne [n_in, n_out] is the array `W[out, in]` (projection `W @ x`); the conv
kernels ssm_conv1d_{q,k,v} (ne [d_conv, 1, d_inner]) are arrays [d_inner, 1, d_conv]; ssm_a
(ne [1, n_head], already -exp(A_log)) is [n_head, 1].

Per token and block (H heads of size d, D = H*d, L = d_conv):
    u = rms(x) * attn_norm
    for p in q, k, v: a_p = attn_p @ u; window_p = [hist_p (L-1 columns), a_p]
                      p_t = silu(sum_i conv_p[:, i] * window_p[:, i]); hist_p <- window_p[:, 1:]
    q_h, k_h = q_t, k_t per head, each divided by sqrt(||.||^2 + eps) (llama.cpp's delta-net l2 norm)
    g = ssm_a[h] * softplus(f_b @ (f_a @ u) + dt_bias)          (per head h and key dim i, <= 0)
    beta_h = sigmoid(ssm_beta @ u)[h]
    per head, with S[i][j] (i key dim, j value dim):
        S[i][j] *= exp(g[h][i]);  delta[j] = beta_h * (v_h[j] - sum_i S[i][j] k_h[i])
        S[i][j] += k_h[i] * delta[j];  o_h[j] = (1/sqrt(d)) * sum_i S[i][j] q_h[i]
    o_h <- rms(o_h) * ssm_norm * sigmoid(g_b @ (g_a @ u))[h]
    mixer = attn_output @ concat_h(o_h)
    x = x + mixer;  x = x + down @ (silu(gate @ rms(x)*ffn_norm) * (up @ rms(x)*ffn_norm))
logits = output @ (rms(x) * output_norm).

State of one sequence, per block: {"conv": [3, D, L-1] (part, channel, oldest tap first),
"S": [H, d(i), d(j)]}. llama.cpp's cache rows: r = conv.reshape(-1) (part-major, then channel,
taps fastest: byte offset of part p is p*(L-1)*D*4); s = element (i, j, h) at i + j*d + h*d*d,
i.e. S transposed to [H, j, i] and flattened.
"""
from __future__ import annotations

import numpy as np

from . import PreNormFfnRef


def rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


def l2n(x, eps):
    return x / np.sqrt(np.sum(x * x) + eps)


class KdaRef(PreNormFfnRef):
    final_norm = "output_norm.weight"

    def __init__(self, weights: dict, n_layer: int, n_head: int, head_dim: int, d_conv: int, eps: float):
        self.w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
        self.n_layer, self.H, self.d, self.L, self.eps = n_layer, n_head, head_dim, d_conv, eps
        self.D = n_head * head_dim

    def new_state(self):
        return [{"conv": np.zeros((3, self.D, self.L - 1)),
                 "S": np.zeros((self.H, self.d, self.d))} for _ in range(self.n_layer)]

    def mixer(self, il: int, u: np.ndarray, st: dict):
        """One KDA step: (output [n_embd], new state of the block)."""
        w, p, H, d = self.w, f"blk.{il}.", self.H, self.d
        conv = st["conv"].copy()
        qkv = []
        for part, name in enumerate("qkv"):
            a = w[p + f"attn_{name}.weight"] @ u                              # [D]
            window = np.concatenate([st["conv"][part], a[:, None]], axis=1)  # [D, L]
            kern = w[p + f"ssm_conv1d_{name}.weight"][:, 0, :]               # [D, L]
            acc = np.zeros(self.D)
            for i in range(self.L):
                acc += kern[:, i] * window[:, i]
            qkv.append(silu(acc).reshape(H, d))
            conv[part] = window[:, 1:]
        q, k, v = qkv
        q = np.array([l2n(q[h], self.eps) for h in range(H)])
        k = np.array([l2n(k[h], self.eps) for h in range(H)])
        f = w[p + "ssm_f_b.weight"] @ (w[p + "ssm_f_a.weight"] @ u) + w[p + "ssm_dt.bias"]
        g = w[p + "ssm_a"][:, 0][:, None] * softplus(f).reshape(H, d)      # [H, d] (per key dim)
        beta = sigmoid(w[p + "ssm_beta.weight"] @ u)                        # [H]
        S = st["S"].copy()
        o = np.zeros((H, d))
        for h in range(H):
            Sh = S[h] * np.exp(g[h])[:, None]                                 # decay row i (key dim)
            delta = beta[h] * (v[h] - Sh.T @ k[h])                            # [d] over j
            Sh = Sh + np.outer(k[h], delta)
            o[h] = (Sh.T @ q[h]) / np.sqrt(d)
            S[h] = Sh
        gate = sigmoid(w[p + "ssm_g_b.weight"] @ (w[p + "ssm_g_a.weight"] @ u)).reshape(H, d)
        o = rms(o, self.eps) * w[p + "ssm_norm.weight"] * gate               # per-head norm
        return w[p + "attn_output.weight"] @ o.reshape(-1), {"conv": conv, "S": S}

    # cache-row layouts (what llama.cpp's memory holds for one cell)
    def r_row(self, state: list, il: int) -> np.ndarray:
        return state[il]["conv"].reshape(-1)

    def s_row(self, state: list, il: int) -> np.ndarray:
        return state[il]["S"].transpose(0, 2, 1).reshape(-1)
