"""Sequential NumPy gated delta-net (Qwen3.5, llama.cpp arch `qwen35`), from the math
(the gated delta rule, ggml's conv and llama.cpp's tensor names) — one token at a time, float64.

Per layer and sequence the state is
  conv window  W[c, ch]   (c = 0..d_conv-2, oldest first) of the conv channels q|k|v,
  delta state  S[h, i, j] (v head h, key index i, value index j): the memory read as o = S^T q.
Per token (x_t = input of the block):
  u      = rms_norm(x_t) * attn_norm
  qkv    = attn_qkv @ u;  z = attn_gate @ u
  beta   = sigmoid(ssm_beta @ u);  g = softplus(ssm_alpha @ u + dt_bias) * A     (A < 0)
  win    = [W; qkv];  c = silu(sum_k win[k] * conv1d[:, k]);  W <- win[1:]
  q, k   = per k head, x / sqrt(sum x^2 + eps) (llama.cpp's delta-net l2 norm);  v per v head
  for v head h (k head h % H_k):
    S[h]  *= exp(g[h])
    delta  = (v[h] - S[h]^T k) * beta[h]
    S[h]  += outer(k, delta)
    o[h]   = S[h]^T q / sqrt(head_dim)
  o[h]   = rms_norm(o[h]) * ssm_norm * silu(z[h])
  x      = x_t + ssm_out @ o
  out    = x + ffn_down @ (silu(ffn_gate @ f) * (ffn_up @ f)),  f = rms_norm(x) * post_attention_norm
Final rms_norm * output_norm, then the output head.

Cache layouts: r row = W transposed, element (c, ch) at c + ch*(d_conv-1);
s row = ggml [S_v (i), S_v (j), H] i.e. memory M[h][j][i] = S[h, i, j]: NumPy S.transpose(0, 2, 1)."""
from __future__ import annotations

import numpy as np

from . import SeqRef, weights_of, rms_norm, sigmoid, silu, softplus


def l2_normalize(x, eps):
    return x / np.sqrt(np.sum(x * x) + eps)


class DeltaNetRef(SeqRef):
    def __init__(self, W: dict, *, n_layer, d_conv, head_dim, num_k_heads, num_v_heads, eps=1e-6):
        super().__init__(W, eps)
        self.n_layer, self.d_conv, self.d = n_layer, d_conv, head_dim
        self.hk, self.hv = num_k_heads, num_v_heads
        self.key_dim, self.value_dim = head_dim * num_k_heads, head_dim * num_v_heads
        self.channels = 2 * self.key_dim + self.value_dim

    @classmethod
    def from_model(cls, m):
        return cls(weights_of(m), n_layer=m.n_layer, d_conv=m.d_conv, head_dim=m.head_k_dim,
                   num_k_heads=m.num_k_heads, num_v_heads=m.num_v_heads, eps=m.eps)

    def new_state(self):
        return [{"conv": np.zeros((self.d_conv - 1, self.channels)),
                 "S": np.zeros((self.hv, self.d, self.d))} for _ in range(self.n_layer)]

    def rows(self, st):
        return {il: (s["conv"].T.reshape(-1).copy(), s["S"].transpose(0, 2, 1).reshape(-1).copy())
                for il, s in enumerate(st)}

    def block(self, il, st, h):
        W, p = self.W, f"blk.{il}."
        x = h + self.mix(il, st, rms_norm(h, self.eps) * W[p + "attn_norm.weight"])
        f = rms_norm(x, self.eps) * W[p + "post_attention_norm.weight"]
        ffn = W[p + "ffn_down.weight"] @ (silu(W[p + "ffn_gate.weight"] @ f) * (W[p + "ffn_up.weight"] @ f))
        return x + ffn

    def mix(self, il, st, u):
        W, p = self.W, f"blk.{il}."
        d, hk, hv = self.d, self.hk, self.hv
        qkv = W[p + "attn_qkv.weight"] @ u
        z = (W[p + "attn_gate.weight"] @ u).reshape(hv, d)
        beta = sigmoid(W[p + "ssm_beta.weight"] @ u)
        g = softplus(W[p + "ssm_alpha.weight"] @ u + W[p + "ssm_dt.bias"]) * W[p + "ssm_a"]

        win = np.concatenate([st["conv"], qkv[None, :]], axis=0)          # [d_conv, channels]
        wconv = W[p + "ssm_conv1d.weight"]                                # [channels, d_conv]
        c = np.zeros(self.channels)
        for k in range(self.d_conv):
            c += win[k] * wconv[:, k]
        c = silu(c)
        st["conv"] = win[1:].copy()

        q = c[:self.key_dim].reshape(hk, d)
        k = c[self.key_dim:2 * self.key_dim].reshape(hk, d)
        v = c[2 * self.key_dim:].reshape(hv, d)
        S = st["S"]
        o = np.zeros((hv, d))
        for h in range(hv):
            qh, kh = l2_normalize(q[h % hk], self.eps), l2_normalize(k[h % hk], self.eps)
            S[h] *= np.exp(g[h])
            delta = (v[h] - S[h].T @ kh) * beta[h]
            S[h] += np.outer(kh, delta)
            o[h] = (S[h].T @ qh) / np.sqrt(d)
            o[h] = rms_norm(o[h], self.eps) * W[p + "ssm_norm.weight"] * silu(z[h])
        return W[p + "ssm_out.weight"] @ o.reshape(-1)
