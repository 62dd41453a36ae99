"""Sequential NumPy Mamba-2 (llama.cpp arch `mamba2`), from the math
(selective scan, ggml's conv and llama.cpp's tensor names) — one token at a time, float64.

Per layer and sequence the state is
  conv window  W[c, ch]  (c = 0..d_conv-2, oldest first) of the conv input channels x|B|C,
  SSM state    H[h, p, n] (head, position in head, state index).
Per token (x_t = input of the block):
  u      = rms_norm(x_t) * attn_norm
  z|xBC|dt = ssm_in @ u
  win    = [W; xBC]                          (d_conv columns, newest last)
  xBC    = silu(sum_k win[k] * conv1d[:, k] + conv1d_b);  W <- win[1:]
  x[h,p], B[g,n], C[g,n] split from xBC; group of head h: g = h // (n_head / n_group)
  dt     = softplus(dt + dt_bias);  dA[h] = exp(dt[h] * A[h])
  H[h]   = H[h] * dA[h] + dt[h] * outer(x[h], B[g]);   y[h, p] = sum_n H[h, p, n] C[g, n]
  y      = (y + D[h] x[h]) * silu(z[h])
  y      = per group (d_inner/n_group values): rms_norm(y_g) * ssm_norm[g]
  out    = x_t + ssm_out @ y
No feed-forward; final rms_norm * output_norm, then the output head.

Cache layouts: r row = W transposed, element (c, ch) at c + ch*(d_conv-1);
s row = ggml [d_state, head_dim, n_head] = NumPy H[h, p, n] flattened."""
from __future__ import annotations

import numpy as np

from . import SeqRef, weights_of, rms_norm, silu, softplus


class Mamba2Ref(SeqRef):
    def __init__(self, W: dict, *, n_layer, d_conv, d_inner, d_state, n_head, n_group, eps=1e-5):
        super().__init__(W, eps)
        self.n_layer, self.d_conv, self.d_inner, self.d_state = n_layer, d_conv, d_inner, d_state
        self.n_head, self.n_group = n_head, n_group
        self.head_dim = d_inner // n_head
        self.channels = d_inner + 2 * n_group * d_state

    @classmethod
    def from_model(cls, m):
        return cls(weights_of(m), n_layer=m.n_layer, d_conv=m.d_conv, d_inner=m.d_inner, d_state=m.d_state,
                   n_head=m.n_head, n_group=m.n_group, eps=m.eps)

    def new_state(self):
        return [{"conv": np.zeros((self.d_conv - 1, self.channels)),
                 "ssm": np.zeros((self.n_head, self.head_dim, self.d_state))} for _ in range(self.n_layer)]

    def rows(self, st):
        return {il: (s["conv"].T.reshape(-1).copy(), s["ssm"].reshape(-1).copy()) for il, s in enumerate(st)}

    def block(self, il, st, h):
        W = self.W
        u = rms_norm(h, self.eps) * W[f"blk.{il}.attn_norm.weight"]
        return h + self.mix(il, st, u)

    def mix(self, il, st, u):
        p = f"blk.{il}."
        W = self.W
        di, ds, nh, ng, hd = self.d_inner, self.d_state, self.n_head, self.n_group, self.head_dim
        proj = W[p + "ssm_in.weight"] @ u
        z = proj[:di]
        xBC = proj[di:di + self.channels]
        dt = proj[di + self.channels:]
        assert dt.shape == (nh,)

        # causal depthwise conv over the last d_conv inputs (newest last), bias, silu
        win = np.concatenate([st["conv"], xBC[None, :]], axis=0)         # [d_conv, channels]
        wconv = W[p + "ssm_conv1d.weight"]                                # [channels, d_conv]
        conv = np.zeros(self.channels)
        for k in range(self.d_conv):
            conv += win[k] * wconv[:, k]
        xBC = silu(conv + W[p + "ssm_conv1d.bias"])
        st["conv"] = win[1:].copy()

        x = xBC[:di].reshape(nh, hd)
        B = xBC[di:di + ng * ds].reshape(ng, ds)
        C = xBC[di + ng * ds:].reshape(ng, ds)
        dt = softplus(dt + W[p + "ssm_dt.bias"])
        A = W[p + "ssm_a"].reshape(nh)
        D = W[p + "ssm_d"].reshape(nh)
        H = st["ssm"]
        y = np.zeros((nh, hd))
        for h in range(nh):
            g = h // (nh // ng)
            H[h] = H[h] * np.exp(dt[h] * A[h]) + dt[h] * np.outer(x[h], B[g])
            y[h] = H[h] @ C[g]
            y[h] = (y[h] + D[h] * x[h]) * silu(z[h * hd:(h + 1) * hd])
        yg = y.reshape(ng, di // ng)
        yg = rms_norm(yg, self.eps) * W[p + "ssm_norm.weight"]            # [n_group, d_inner/n_group]
        return W[p + "ssm_out.weight"] @ yg.reshape(-1)
