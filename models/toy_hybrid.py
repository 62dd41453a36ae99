"""A tiny hybrid model for tests: the toy's short-conv layers with plain attention layers between
them (every layer il with il % 3 == 1: conv, attn, conv, conv, attn, ...).

The attention layer is llama.cpp's build_attn without rope or flash attention: q/k/v projections
split into heads, K/V stored in the KV cache, softmax(k^T q * scale + kq_mask), V transposed, the
output projection. The conv layers keep their state in the recurrent memory, so the Runner gives
it a HybridMemory. It is what the hybrid memory, the KV cache and the attention inputs are tested
with before the real hybrid models (lfm2, qwen35, kimi with attention) are built."""
from __future__ import annotations

import numpy as np

import minigraph as mg

from .attn_inputs import build_attn
from .toy import ToyConvModel


def toy_attn_layers(n_layer: int) -> tuple:
    return tuple(il for il in range(n_layer) if il % 3 == 1)


class ToyHybridModel(ToyConvModel):
    arch = "toy-hybrid"
    DEFAULT_N_LAYER = 3

    def __init__(self, n_vocab=32, n_embd=16, n_layer=3, d_conv=4, n_head=2, devices=None, seed=0):
        if n_embd % n_head:
            raise ValueError(f"toy-hybrid: n_embd {n_embd} is not a multiple of n_head {n_head}")
        self.n_head = self.n_head_kv = n_head
        self.n_embd_head = n_embd // n_head
        self.attn_layers = toy_attn_layers(n_layer)          # read by layer_weights in __init__
        super().__init__(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, d_conv=d_conv, devices=devices, seed=seed)
        self.hparams["n_head"] = n_head

    def layer_weights(self, mk, il):
        if il not in self.attn_layers:
            return super().layer_weights(mk, il)
        E = self.n_embd
        return {name: mk(f"blk.{il}.{name}", (E, E), 1 / np.sqrt(E))
                for name in ("attn_q", "attn_k", "attn_v", "attn_output")}

    # memory sizes: attention layers have no recurrent state, conv layers no K/V
    def n_embd_r(self, il):
        return 0 if il in self.attn_layers else super().n_embd_r(il)

    def n_embd_k_gqa(self, il):
        return self.n_embd_head * self.n_head_kv

    def n_embd_v_gqa(self, il):
        return self.n_embd_head * self.n_head_kv

    def build_attn_layer(self, g, inp_attn, cur, il):
        """cur: rms_norm(h) [n_embd, n_tokens] -> attention output [n_embd, n_tokens]."""
        w = self.layer_w[il]
        d, H, T = self.n_embd_head, self.n_head, g.n_tokens
        q = mg.reshape_3d(mg.mul_mat(w["attn_q"], cur), d, H, T)
        k = mg.reshape_3d(mg.mul_mat(w["attn_k"], cur), d, self.n_head_kv, T)
        v = mg.reshape_3d(mg.mul_mat(w["attn_v"], cur), d, self.n_head_kv, T)
        out = build_attn(g, inp_attn, q, k, v, H, self.n_head_kv, 1.0 / np.sqrt(d), il)   # [E, T]
        return mg.mul_mat(w["attn_output"], out)
