"""Kimi delta attention (llama.cpp arch "kimi-linear").

Per block: attn_norm (RMS) -> KDA mixer -> residual add, ffn_norm (RMS) -> dense SwiGLU FFN ->
residual add; then output_norm and the output head. Every block here is a KDA block (llama.cpp
marks them with head_count_kv 0; `leading_dense_block_count` = n_layer keeps every FFN dense).

KDA mixer (build_kda_layer), d_inner = n_head * head_dim:
* q, k, v = silu(causal conv(attn_q/k/v x)), three convolutions whose histories share ONE r-cache
  row [Q | K | V] of 3 * conv_state_size floats, conv_state_size = (d_conv-1) * d_inner; part qkv
  lives at byte offset qkv * conv_state_size * 4 and is stored by
  GraphContext.build_conv_state_store(..., offs=that).
* per-key-dim decay g = ssm_a[h] * softplus(f_b(f_a(x)) + dt_bias), ssm_a = -exp(A_log) already
  negative as in the GGUF file, one A per head broadcast over head_dim -> [head_dim, n_head, T, S];
  beta = sigmoid(ssm_beta x) -> [1, n_head, T, S]; q, k l2-normalised per head.
* fused gated_delta_net with the vector gate and K = n_rs_seq + 1 snapshots; the K states go to
  the s cache with GraphContext.build_state_store (slot j = state j tokens back).
* output: per-head RMS norm (ssm_norm) times sigmoid(g_b(g_a(x))), then attn_output.

The scaffolding around the mixer (devices, seeded weights, `hparams` and `gguf_tensors()` for
models.gguf_io, the whole-model graph with its SwiGLU FFN) is models.base.RecurrentModel's.
"""
from __future__ import annotations

import numpy as np

import minigraph as mg

from .base import RecurrentModel, build_norm


def build_kda_layer(g, inp_rs, il: int, w: dict, cur: mg.Tensor, n_head: int, head_dim: int,
                    d_conv: int, eps: float) -> mg.Tensor:
    """One KDA mixer (llama.cpp kimi-linear's recurrent branch). cur: the normed input
    [n_embd, n_tokens]. Returns [n_embd, n_tokens]."""
    T, S = g.n_seq_tokens, g.n_seqs
    n_tokens = T * S
    H, hd = n_head, head_dim
    d_inner = H * hd
    css = (d_conv - 1) * d_inner                              # conv_state_size: one part of the row
    r, s = g.mctx.r_l[il], g.mctx.s_l[il]
    elt = r.type.size

    conv_all = g.build_rs(inp_rs, r, 3 * css, S)              # [3*css, S]: Q | K | V histories
    qkv = []
    for part, (proj, conv_w) in enumerate((("attn_q", "conv_q"), ("attn_k", "conv_k"), ("attn_v", "conv_v"))):
        x = mg.mul_mat(w[proj], cur)                          # [d_inner, n_tokens]
        x = mg.reshape_3d(x, d_inner, T, S)                   # [d_inner, T, S]
        hist = mg.view_3d(conv_all, d_conv - 1, d_inner, S,   # [d_conv-1, d_inner, S]
                          (d_conv - 1) * elt, conv_all.nb[1], part * css * elt)
        conv_x = mg.concat(hist, mg.transpose(x), 0)          # [d_conv-1+T, d_inner, S]
        g.build_conv_state_store(inp_rs, r, conv_x, d_conv - 1, part * css * elt)
        kern = mg.reshape_2d(w[conv_w], d_conv, d_inner)      # [d_conv, 1, d_inner] -> [d_conv, d_inner]
        y = mg.silu(mg.ssm_conv(conv_x, kern))                # [d_inner, T, S]
        qkv.append(mg.reshape_4d(y, hd, H, T, S))             # [hd, H, T, S]
    q, k, v = qkv
    q = mg.l2_norm(q, eps)                                    # [hd, H, T, S]
    k = mg.l2_norm(k, eps)                                    # [hd, H, T, S]

    # per-key-dim decay: g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)
    f = mg.mul_mat(w["ssm_f_b"], mg.mul_mat(w["ssm_f_a"], cur))   # [d_inner, n_tokens]
    f = mg.softplus(mg.add(f, w["ssm_dt_b"]))                 # [d_inner, n_tokens]
    A = mg.reshape_3d(w["ssm_a"], 1, H, 1)                    # [1, H, 1]: one A per head
    gk = mg.mul(mg.reshape_3d(f, hd, H, n_tokens), A)         # [hd, H, n_tokens]
    gk = mg.reshape_4d(gk, hd, H, T, S)                       # [hd, H, T, S]
    beta = mg.mul_mat(w["ssm_beta"], cur)                     # [H, n_tokens]
    beta = mg.sigmoid(mg.reshape_4d(beta, 1, H, T, S))        # [1, H, T, S]

    D = hd * hd * H                                           # n_embd_s
    state = g.build_rs(inp_rs, s, D, S)                       # [D, S]
    state = mg.reshape_4d(state, hd, hd, H, S)                # [hd(key i), hd(value j), H, S]
    K = g.n_rs_seq + 1
    out = mg.gated_delta_net(q, k, v, gk, beta, state, K)     # [hd*H, T*S + K*hd*S]
    g.build_state_store(inp_rs, s, out, hd * H * n_tokens * out.type.size, D)

    o = mg.view_3d(out, hd, H, n_tokens, hd * out.type.size, hd * H * out.type.size, 0)  # [hd, H, n_tokens]
    o = build_norm(o, w["ssm_norm"], eps)                     # per-head RMS norm, [hd, H, n_tokens]
    gate = mg.mul_mat(w["ssm_g_b"], mg.mul_mat(w["ssm_g_a"], cur))   # [d_inner, n_tokens]
    o = mg.mul(o, mg.sigmoid(mg.reshape_3d(gate, hd, H, n_tokens)))  # [hd, H, n_tokens]
    o = mg.reshape_2d(o, d_inner, n_tokens)                   # [d_inner, n_tokens]
    return mg.mul_mat(w["attn_output"], o)                    # [n_embd, n_tokens]


class KDAModel(RecurrentModel):
    """A tiny Kimi-Linear with KDA blocks only and dense FFNs, seeded random weights.

    Defaults: d_model 64, 2 blocks, vocab 64, 2 heads of 16 (d_inner 32), d_conv 4, FFN 96:
    n_embd_r = 3*3*32 = 288 and n_embd_s = 16*16*2 = 512 per layer. `hparams` holds the
    constructor's structural arguments; `gguf_tensors()` the weights by GGUF name."""

    arch = "kimi-linear"
    residual_first = True
    layer_output_names = ("mixer", "l_out")

    def __init__(self, n_vocab=64, n_embd=64, n_layer=2, n_head=2, head_dim=16, d_conv=4, n_ff=96,
                 eps=1e-5, n_ctx_train=4096, devices=None, seed=0, layer_outputs=False):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding, final norm and output head live on the last device (the host).
        layer_outputs: also return each block's mixer output 'mixer.{il}' and block output
        'l_out.{il}' ([n_embd, n_tokens]; tests)."""
        super().__init__(dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                              head_dim=head_dim, d_conv=d_conv, n_ff=n_ff, eps=float(eps),
                              n_ctx_train=n_ctx_train),
                         devices, layer_outputs)
        self.n_head, self.head_dim, self.d_conv, self.n_ff = n_head, head_dim, d_conv, n_ff
        self.d_inner = n_head * head_dim
        self.eps = float(eps)
        self.make_weights(seed)

    def layer_weights(self, mk, il):
        E, H, hd, di, dc, p = self.n_embd, self.n_head, self.head_dim, self.d_inner, self.d_conv, f"blk.{il}."
        # A = exp(A_log), A_log uniform in [log 0.2, log 2]: moderate decay per head
        A = np.exp(mk.rng.uniform(np.log(0.2), np.log(2.0), (H, 1)))
        # dt bias: softplus(dt_bias) in [0.1, 1]
        dt = mk.rng.uniform(0.1, 1.0, di)
        lw = {
            "attn_norm": mk(p + "attn_norm.weight", (E,), 0.1, 1.0),
            "attn_q": mk(p + "attn_q.weight", (E, di), 1 / np.sqrt(E)),
            "attn_k": mk(p + "attn_k.weight", (E, di), 1 / np.sqrt(E)),
            "attn_v": mk(p + "attn_v.weight", (E, di), 1 / np.sqrt(E)),
            "conv_q": mk(p + "ssm_conv1d_q.weight", (dc, 1, di), 1 / np.sqrt(dc)),
            "conv_k": mk(p + "ssm_conv1d_k.weight", (dc, 1, di), 1 / np.sqrt(dc)),
            "conv_v": mk(p + "ssm_conv1d_v.weight", (dc, 1, di), 1 / np.sqrt(dc)),
            "ssm_f_a": mk(p + "ssm_f_a.weight", (E, hd), 1 / np.sqrt(E)),
            "ssm_f_b": mk(p + "ssm_f_b.weight", (hd, di), 0.5 / np.sqrt(hd)),
            "ssm_dt_b": mk.fixed(p + "ssm_dt.bias", (di,), np.log(np.expm1(dt))),
            "ssm_a": mk.fixed(p + "ssm_a", (1, H), -A),
            "ssm_beta": mk(p + "ssm_beta.weight", (E, H), 1 / np.sqrt(E)),
            "ssm_g_a": mk(p + "ssm_g_a.weight", (E, hd), 1 / np.sqrt(E)),
            "ssm_g_b": mk(p + "ssm_g_b.weight", (hd, di), 1 / np.sqrt(hd)),
            "ssm_norm": mk(p + "ssm_norm.weight", (hd,), 0.1, 1.0),
            "attn_output": mk(p + "attn_output.weight", (di, E), 1 / np.sqrt(di)),
        }
        lw.update(self.ffn_weights(mk, il, self.n_ff))
        return lw

    # memory sizes (floats per cache row): three conv histories (Q, K, V); one head_dim^2 state per head
    def n_embd_r(self, il):
        return 3 * (self.d_conv - 1) * self.d_inner

    def n_embd_s(self, il):
        return self.head_dim * self.head_dim * self.n_head

    def build_layer(self, g, inp_rs, cur, il):
        return build_kda_layer(g, inp_rs, il, self.layer_w[il], cur, self.n_head, self.head_dim, self.d_conv, self.eps)


KdaModel = KDAModel
