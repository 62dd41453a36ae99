"""LFM2 (llama.cpp arch "lfm2"): short-conv blocks and attention blocks, read side by side with
llama.cpp's src/models/lfm2.cpp.

Per block: attn_norm (RMS) -> mixer -> residual add, ffn_norm (RMS) -> SwiGLU FFN -> residual
add; after the last block the final norm (`token_embd_norm`, llama.cpp's output_norm for lfm2) and
the output head. The mixer of block il is chosen by the per-layer `head_count_kv` array, as in a
llama.cpp file: 0 -> a short-conv block (recurrent state), > 0 -> an attention block (KV cache).

Attention (build_attn_block): q/k/v projections reshaped to heads [head_dim, n_head(_kv), n_tokens];
per-head RMS norm times attn_q_norm / attn_k_norm; rope NEOX over the whole head with the file's
rope.freq_base at the tokens' positions; K/V stored in the KV cache and attended with kq_mask and
scale 1/sqrt(head_dim) (GQA: n_head query heads share n_head_kv key/value heads); attn_output.

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

from .attn_inputs import build_attn
from .base import RecurrentModel, build_norm

ROPE_TYPE_NEOX = 2          # llama.cpp's rope type for lfm2 (pairs dim k with k + head_dim/2)


def default_head_count_kv(n_layer: int, n_head_kv: int) -> list:
    """The hybrid layout of llama.cpp's LFM2 files, scaled to n_layer: attention blocks among
    the short-conv blocks, the first a few blocks in (LFM2-350M: 16 blocks, attention at
    2, 5, 8, 10, 12, 14). Here: every third block from block 1 (conv, attn, conv, conv, attn, ...)."""
    return [n_head_kv if il % 3 == 1 else 0 for il in range(n_layer)]


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


def build_attn_block(g, inp_attn, inp_pos: mg.Tensor, w: dict, cur: mg.Tensor, il: int, n_head: int,
                     n_head_kv: int, head_dim: int, eps: float, rope_base: float, n_ctx_orig: int) -> mg.Tensor:
    """One LFM2 attention mixer (llama.cpp's build_attn_block). cur: the normed input
    [n_embd, n_tokens]. Returns [n_embd, n_tokens]."""
    T = g.n_tokens
    q = mg.reshape_3d(mg.mul_mat(w["attn_q"], cur), head_dim, n_head, T)        # [d, n_head, T]
    k = mg.reshape_3d(mg.mul_mat(w["attn_k"], cur), head_dim, n_head_kv, T)     # [d, n_head_kv, T]
    v = mg.reshape_3d(mg.mul_mat(w["attn_v"], cur), head_dim, n_head_kv, T)     # [d, n_head_kv, T]
    # qk norm: each head's row normed on its own, then times the shared [d] weight
    q = build_norm(q, w["attn_q_norm"], eps)
    k = build_norm(k, w["attn_k_norm"], eps)
    # no YaRN (ext_factor 0), freq_scale 1: beta_fast/slow are then unused (llama.cpp's defaults)
    q = mg.rope_ext(q, inp_pos, None, head_dim, ROPE_TYPE_NEOX, n_ctx_orig, rope_base, 1.0, 0.0, 1.0, 32.0, 1.0)
    k = mg.rope_ext(k, inp_pos, None, head_dim, ROPE_TYPE_NEOX, n_ctx_orig, rope_base, 1.0, 0.0, 1.0, 32.0, 1.0)
    cur = build_attn(g, inp_attn, q, k, v, n_head, n_head_kv, 1.0 / np.sqrt(head_dim), il)  # [d*n_head, T]
    return mg.mul_mat(w["attn_output"], cur)                                      # [n_embd, T]


def check_head_counts(n_embd: int, n_head: int, hkv: list, key: str = "") -> list:
    """The rules on a per-layer K/V head count list (one entry per block; 0 = short conv), for the
    model and for GGUF files alike (``key`` prefixes the key names, e.g. "lfm2."): each entry 0 or
    a divisor of head_count, head_count dividing the embedding (attention blocks may differ in
    their K/V head counts). Returns hkv; raises ValueError naming the key and the rule."""
    if any(hkv):
        if n_head <= 0 or n_embd % n_head:
            raise ValueError(f"lfm2: {key}attention.head_count {n_head} must divide {key}embedding_length {n_embd}")
        bad = [(il, x) for il, x in enumerate(hkv) if x < 0 or (x and n_head % x)]
        if bad:
            il, x = bad[0]
            raise ValueError(f"lfm2: {key}attention.head_count_kv[{il}] = {x}, expected 0 (short conv) or a "
                             f"divisor of {key}attention.head_count {n_head}")
    return hkv


class LFM2Model(RecurrentModel):
    """A tiny LFM2 with seeded random weights.

    Defaults: d_model 64, 3 blocks (conv, attention, conv: llama.cpp's hybrid layout, as every
    llama.cpp LFM2 file has), vocab 64, kernel L = 3 (2 history columns), FFN 128, 4 query heads
    sharing 2 K/V heads (GQA): n_embd_r = 128 per conv layer, no s state. head_count_kv:
    llama.cpp's per-layer array (0 = short-conv block, > 0 = attention block with that many K/V
    heads); None: default_head_count_kv(n_layer, n_head_kv); all zeros: a conv-only LFM2 (which
    llama.cpp refuses). head_dim = n_embd / n_head.
    `hparams` holds the constructor's structural arguments (what models.gguf_io writes and reads
    back); `gguf_tensors()` the weights by GGUF name."""

    arch = "lfm2"
    residual_first = True                    # llama.cpp's lfm2: add(prev_cur, cur)
    k_shift = "rope"                         # cached keys re-rotated after seq_add (models.k_shift)
    layer_output_names = ("mixer", "l_out")

    DEFAULT_N_LAYER = 3

    def __init__(self, n_vocab=64, n_embd=64, n_layer=3, l_cache=3, n_ff=128, n_head=4, eps=1e-5,
                 n_ctx_train=4096, head_count_kv=None, rope_freq_base=1e6, devices=None, seed=0,
                 layer_outputs=False, n_head_kv=2):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding, final norm and output head live on the last device (the host).
        layer_outputs: also return each block's mixer output 'mixer.{il}' and block output
        'l_out.{il}' ([n_embd, n_tokens]; tests)."""
        if l_cache < 2:
            raise ValueError(f"lfm2: shortconv.l_cache must be > 1, got {l_cache}")
        if head_count_kv is None:
            head_count_kv = default_head_count_kv(n_layer, n_head_kv)
        head_count_kv = self._check_heads(n_embd, n_layer, n_head, head_count_kv)
        super().__init__(dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, l_cache=l_cache,
                              n_ff=n_ff, n_head=n_head, eps=float(eps), n_ctx_train=n_ctx_train,
                              head_count_kv=head_count_kv, rope_freq_base=float(rope_freq_base)),
                         devices, layer_outputs)
        self.l_cache, self.n_ff, self.eps = l_cache, n_ff, float(eps)
        self.n_head, self.head_count_kv, self.rope_freq_base = n_head, head_count_kv, float(rope_freq_base)
        self.n_ctx_train = n_ctx_train
        self.head_dim = n_embd // n_head
        self.attn_layers = tuple(il for il in range(n_layer) if head_count_kv[il] > 0)
        self.make_weights(seed, out_norm="token_embd_norm")   # llama.cpp's output_norm for lfm2

    @staticmethod
    def _check_heads(n_embd: int, n_layer: int, n_head: int, head_count_kv) -> list:
        """The per-layer K/V head counts, checked: one per layer, each 0 or a divisor of n_head."""
        if head_count_kv is None:
            return [0] * n_layer
        if isinstance(head_count_kv, (int, np.integer)):
            head_count_kv = [int(head_count_kv)] * n_layer
        hkv = [int(x) for x in head_count_kv]
        if len(hkv) > n_layer:               # a model cut to its first blocks (the CLI's memory probe)
            hkv = hkv[:n_layer]
        if len(hkv) != n_layer:
            raise ValueError(f"lfm2: attention.head_count_kv has {len(hkv)} entries, expected one per "
                             f"layer ({n_layer})")
        return check_head_counts(n_embd, n_head, hkv)

    def layer_weights(self, mk, il):
        if il in self.attn_layers:
            return self.attn_layer_weights(mk, il)
        E, L, p = self.n_embd, self.l_cache, f"blk.{il}."
        lw = {
            "attn_norm": mk(p + "attn_norm.weight", (E,), 0.1, 1.0),
            "in_proj": mk(p + "shortconv.in_proj.weight", (E, 3 * E), 1 / np.sqrt(E)),
            "conv": mk(p + "shortconv.conv.weight", (L, E), 1 / np.sqrt(L)),
            "out_proj": mk(p + "shortconv.out_proj.weight", (E, E), 1 / np.sqrt(E)),
        }
        lw.update(self.ffn_weights(mk, il, self.n_ff))
        return lw

    def attn_layer_weights(self, mk, il):
        E, d, p = self.n_embd, self.head_dim, f"blk.{il}."
        n_kv = self.head_count_kv[il] * d
        lw = {
            "attn_norm": mk(p + "attn_norm.weight", (E,), 0.1, 1.0),
            "attn_q": mk(p + "attn_q.weight", (E, self.n_head * d), 1 / np.sqrt(E)),
            "attn_k": mk(p + "attn_k.weight", (E, n_kv), 1 / np.sqrt(E)),
            "attn_v": mk(p + "attn_v.weight", (E, n_kv), 1 / np.sqrt(E)),
            "attn_q_norm": mk(p + "attn_q_norm.weight", (d,), 0.1, 1.0),
            "attn_k_norm": mk(p + "attn_k_norm.weight", (d,), 0.1, 1.0),
            "attn_output": mk(p + "attn_output.weight", (self.n_head * d, E), 1 / np.sqrt(E)),
        }
        lw.update(self.ffn_weights(mk, il, self.n_ff))
        return lw

    # memory sizes (floats per cache row): a conv layer keeps L-1 history columns per channel and
    # no s state; an attention layer keeps nothing there (its K/V live in the KV cache)
    def n_embd_r(self, il):
        return 0 if il in self.attn_layers else (self.l_cache - 1) * self.n_embd

    def n_embd_s(self, il):
        return 0

    def n_embd_k_gqa(self, il):
        return self.head_dim * self.head_count_kv[il]

    def n_embd_v_gqa(self, il):
        return self.head_dim * self.head_count_kv[il]

    def k_shift_dims(self, il):
        """(rotated dims, K heads, head size) of layer il's cached keys."""
        return self.head_dim, self.head_count_kv[il], self.head_dim

    def rope_shift(self, k, shift, il):
        """Layer il's keys k [head_dim, n_head_kv, kv_size] rotated by shift [kv_size] positions,
        with the graph's own rope (llama.cpp's build_rope_shift)."""
        return mg.rope_ext(k, shift, None, self.head_dim, ROPE_TYPE_NEOX, self.n_ctx_train, self.rope_freq_base,
                           1.0, 0.0, 1.0, 32.0, 1.0)

    def build_layer(self, g, inp_rs, cur, il):
        return build_shortconv_layer(g, inp_rs, g.mctx.r_l[il], self.layer_w[il], cur, self.n_embd, self.l_cache)

    def build_attn_layer(self, g, inp_attn, cur, il):
        return build_attn_block(g, inp_attn, g.build_inp_pos(), self.layer_w[il], cur, il, self.n_head,
                                self.head_count_kv[il], self.head_dim, self.eps, self.rope_freq_base,
                                self.n_ctx_train)


LFM2HybridModel = LFM2Model        # the former name of the hybrid default (zoo alias lfm-hybrid)
LfmModel = LFM2Model
