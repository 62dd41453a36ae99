"""LFM2 with short-conv layers (llama.cpp arch "lfm2").

Per block: attn_norm (RMS) -> short conv -> residual add, ffn_norm (RMS) -> SwiGLU FFN -> residual
add; after the last block the final norm (`token_embd_norm`, llama.cpp's output_norm for lfm2) and
the output head. Every block here is a short-conv block (llama.cpp marks them with head_count_kv 0).

Short conv (build_shortconv_layer): bcx = in_proj x -> b, c, x (rows B | C | x); the product b*x
is the conv input; its history of L-1 columns lives in the layer's r cache and is written only by
GraphContext.build_conv_state_store (n_cols = L-1); conv_out = ssm_conv(history ++ b*x, conv);
y = out_proj(c * conv_out). No s state.

The scaffolding around the mixer (devices, seeded weights, `hparams` and `gguf_tensors()` for
models.gguf_io, the whole-model graph with its SwiGLU FFN) is models.base.RecurrentModel's.
"""
from __future__ import annotations

import numpy as np

import minigraph as mg

from .base import RecurrentModel


def build_shortconv_layer(g, inp_rs, r: mg.Tensor, w: dict, cur: mg.Tensor, n_embd: int,
                          l_cache: int) -> mg.Tensor:
    """One LFM2 short-conv mixer (llama.cpp build_shortconv_block).

    g: GraphContext; r: this layer's r cache [n_embd*(L-1), mem_size*K]; cur: the normed input
    [n_embd, n_tokens]. Returns [n_embd, n_tokens]."""
    T, S = g.n_seq_tokens, g.n_seqs
    d_conv = l_cache - 1                                     # history columns kept (kernel - 1)
    cur = mg.reshape_3d(cur, n_embd, T, S)                   # [n_embd, T, S]
    bcx = mg.mul_mat(w["in_proj"], cur)                      # [3*n_embd, T, S]
    elt = bcx.type.size
    b = mg.view_3d(bcx, n_embd, T, S, bcx.nb[1], bcx.nb[2], 0 * n_embd * elt)   # [n_embd, T, S]
    c = mg.view_3d(bcx, n_embd, T, S, bcx.nb[1], bcx.nb[2], 1 * n_embd * elt)   # [n_embd, T, S]
    x = mg.view_3d(bcx, n_embd, T, S, bcx.nb[1], bcx.nb[2], 2 * n_embd * elt)   # [n_embd, T, S]
    bx = mg.transpose(mg.mul(b, x))                          # [T, n_embd, S]
    conv = g.build_rs(inp_rs, r, d_conv * n_embd, S)         # [d_conv*n_embd, S]
    conv = mg.reshape_3d(conv, d_conv, n_embd, S)            # [d_conv, n_embd, S]
    bx = mg.concat(conv, bx, 0)                              # [d_conv+T, n_embd, S]
    g.build_conv_state_store(inp_rs, r, bx, d_conv)          # history (and rollback slots)
    conv_out = mg.ssm_conv(bx, w["conv"])                    # [n_embd, T, S]
    y = mg.mul(c, conv_out)                                  # [n_embd, T, S]
    y = mg.mul_mat(w["out_proj"], y)                         # [n_embd, T, S]
    return mg.reshape_2d(y, n_embd, T * S)                   # [n_embd, n_tokens]


class LFM2Model(RecurrentModel):
    """A tiny LFM2 (short-conv blocks only) with seeded random weights.

    Defaults: d_model 64, 2 blocks, vocab 64, kernel L = 3 (2 history columns), FFN 128:
    n_embd_r = 128 per layer, no s state. `hparams` holds the constructor's structural arguments
    (what models.gguf_io writes and reads back); `gguf_tensors()` the weights by GGUF name."""

    arch = "lfm2"
    residual_first = True                    # llama.cpp's lfm2: add(prev_cur, cur)
    layer_output_names = ("mixer", "l_out")

    def __init__(self, n_vocab=64, n_embd=64, n_layer=2, l_cache=3, n_ff=128, n_head=4, eps=1e-5,
                 n_ctx_train=4096, devices=None, seed=0, layer_outputs=False):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding, final norm and output head live on the last device (the host).
        layer_outputs: also return each block's mixer output 'mixer.{il}' and block output
        'l_out.{il}' ([n_embd, n_tokens]; tests)."""
        if l_cache < 2:
            raise ValueError(f"lfm2: shortconv.l_cache must be > 1, got {l_cache}")
        super().__init__(dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, l_cache=l_cache,
                              n_ff=n_ff, n_head=n_head, eps=float(eps), n_ctx_train=n_ctx_train),
                         devices, layer_outputs)
        self.l_cache, self.n_ff, self.eps = l_cache, n_ff, float(eps)
        self.make_weights(seed, out_norm="token_embd_norm")   # llama.cpp's output_norm for lfm2

    def layer_weights(self, mk, il):
        E, L, p = self.n_embd, self.l_cache, f"blk.{il}."
        lw = {
            "attn_norm": mk(p + "attn_norm.weight", (E,), 0.1, 1.0),
            "in_proj": mk(p + "shortconv.in_proj.weight", (E, 3 * E), 1 / np.sqrt(E)),
            "conv": mk(p + "shortconv.conv.weight", (L, E), 1 / np.sqrt(L)),
            "out_proj": mk(p + "shortconv.out_proj.weight", (E, E), 1 / np.sqrt(E)),
        }
        lw.update(self.ffn_weights(mk, il, self.n_ff))
        return lw

    # memory sizes (floats per cache row): L-1 history columns per channel, no s state
    def n_embd_r(self, il):
        return (self.l_cache - 1) * self.n_embd

    def n_embd_s(self, il):
        return 0

    def build_layer(self, g, inp_rs, cur, il):
        return build_shortconv_layer(g, inp_rs, g.mctx.r_l[il], self.layer_w[il], cur, self.n_embd, self.l_cache)


LfmModel = LFM2Model
