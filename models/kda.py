"""Kimi-Linear (llama.cpp arch "kimi-linear"), read side by side with llama.cpp's
src/models/kimi-linear.cpp: KDA blocks (recurrent state) and MLA blocks (KV cache).

Per block: attn_norm (RMS) -> mixer -> residual add, ffn_norm (RMS) -> dense SwiGLU FFN ->
residual add; then output_norm and the output head. Which mixer a block has comes from the
per-layer `head_count_kv` array, as llama.cpp reads it: 0 -> KDA, > 0 -> MLA (its converter writes
1: MLA runs as one shared K head). Blocks from `leading_dense_block_count` on have MoE FFNs in the
real model; minigraph runs dense FFNs only and refuses such files (models.gguf_io).

KDA mixer (build_kda_layer), d_inner = n_head * head_dim:
* q, k, v = silu(causal conv(attn_q/k/v x)), three convolutions whose histories share ONE r-cache
  row [Q | K | V] of 3 * conv_state_size floats, conv_state_size = (d_conv-1) * d_inner; part qkv
  lives at byte offset qkv * conv_state_size * 4 and is stored by
  GraphContext.build_conv_state_store(..., offs=that).
* per-key-dim decay g = ssm_a[h] * softplus(f_b(f_a(x)) + dt_bias), ssm_a = -exp(A_log) already
  negative as in the GGUF file, one A per head broadcast over head_dim -> [head_dim, n_head, T, S];
  beta = sigmoid(ssm_beta x) -> [1, n_head, T, S]; q, k l2-normed per head the way llama.cpp's
  delta-net models do it (x / sqrt(sum x^2 + eps), models.delta_net.build_gdn_l2_norm).
* fused gated_delta_net with the vector gate and K = n_rs_seq + 1 snapshots; the K states go to
  the s cache with GraphContext.build_state_store (slot j = state j tokens back).
* output: per-head RMS norm (ssm_norm) times sigmoid(g_b(g_a(x))), then attn_output.

MLA mixer (build_mla_layer), llama.cpp's path with the absorbed projections and a K-only cache:
* q = attn_q x, per head [nope | rope] (qk_nope = mla_k_head_dim - n_rot dims, then n_rot);
* attn_kv_a_mqa x -> [kv_lora_rank | n_rot]: the compressed kv (RMS-normed with attn_kv_a_norm)
  and k_pe, one head shared by all query heads. Kimi's MLA applies no rope (llama.cpp's rope type
  for this arch is none): the "rope" dims are used as they are;
* each head's q_nope is absorbed into the latent space by attn_k_b ([nope, kv_lora_rank, n_head]);
  query = [absorbed q_nope | q_pe], key = [kv | k_pe] (one head, kv_lora_rank + n_rot wide) is all
  the cache stores; the values are the key rows' first kv_lora_rank channels (a view);
* attention with scale 1/sqrt(mla_k_head_dim), then attn_v_b ([kv_lora_rank, v_head_dim, n_head])
  maps each head's attended latent to its v_head_dim values, then attn_output.

The scaffolding around the mixers (devices, seeded weights, `hparams` and `gguf_tensors()` for
models.gguf_io, the whole-model graph with its SwiGLU FFN) is models.base.RecurrentModel's.
"""
from __future__ import annotations

import numpy as np

import minigraph as mg

from .attn_inputs import build_attn_k
from .base import RecurrentModel, build_norm
from .delta_net import build_gdn_l2_norm


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
    q = build_gdn_l2_norm(q, eps)                             # [hd, H, T, S]
    k = build_gdn_l2_norm(k, eps)                             # [hd, H, T, S]

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


def build_mla_layer(g, inp_attn, il: int, w: dict, cur: mg.Tensor, hp: "KDAModel") -> mg.Tensor:
    """One MLA mixer (llama.cpp kimi-linear's attention branch, MLA KV cache enabled). cur: the
    normed input [n_embd, n_tokens]. Returns [n_embd, n_tokens]."""
    T, H = g.n_tokens, hp.n_head
    dk, r, lora = hp.mla_k_head_dim, hp.n_rot, hp.kv_lora_rank
    nope = dk - r
    q = mg.mul_mat(w["attn_q"], cur)                                          # [dk*H, T]
    kv_pe = mg.mul_mat(w["attn_kv_a_mqa"], cur)                               # [lora + r, T]
    elt = kv_pe.type.size
    kv = mg.view_2d(kv_pe, lora, T, kv_pe.nb[1], 0)                           # [lora, T]
    k_pe = mg.view_3d(kv_pe, r, 1, T, kv_pe.nb[1], kv_pe.nb[1], lora * elt)   # [r, 1, T]
    kv = build_norm(kv, w["attn_kv_a_norm"], hp.eps)                          # [lora, T]
    q_nope = mg.view_3d(q, nope, H, T, dk * elt, dk * H * elt, 0)             # [nope, H, T]
    q_pe = mg.view_3d(q, r, H, T, dk * elt, dk * H * elt, nope * elt)         # [r, H, T]
    q_abs = mg.mul_mat(w["attn_k_b"], mg.permute(q_nope, 0, 2, 1, 3))        # [lora, T, H]
    q = mg.concat(mg.permute(q_abs, 0, 2, 1, 3), q_pe, 0)                     # [lora + r, H, T]
    k = mg.concat(mg.reshape_3d(kv, lora, 1, T), k_pe, 0)                     # [lora + r, 1, T]
    cur = build_attn_k(g, inp_attn, q, k, lora, w["attn_v_b"], 1.0 / np.sqrt(dk), il)   # [dv*H, T]
    return mg.mul_mat(w["attn_output"], cur)                                  # [n_embd, T]


def default_head_count_kv(n_layer: int) -> list:
    """Kimi-Linear's layout scaled to n_layer: every 4th block MLA (Kimi-Linear-48B: 3 KDA blocks,
    then one MLA block), each with llama.cpp's one shared K head; a model of fewer than 4 blocks
    has its last block MLA (llama.cpp's hybrid memory needs at least one attention block), a
    model of one block is KDA only."""
    if n_layer < 2:
        return [0] * n_layer
    every = min(4, n_layer)
    return [1 if (il + 1) % every == 0 else 0 for il in range(n_layer)]


def check_mla(n_head: int, hkv: list, mla_k_head_dim: int, n_rot: int, mla_v_head_dim: int,
              kv_lora_rank: int, key: str = "") -> list:
    """The rules on the MLA blocks, for the model and for GGUF files alike (``key`` prefixes the
    key names, e.g. "kimi-linear."): each head_count_kv entry 0 (KDA) or 1 (MLA's one shared K
    head, as llama.cpp's converter writes it), rope part inside the key head, positive sizes.
    Returns hkv; raises ValueError naming the key and the rule."""
    bad = [(il, x) for il, x in enumerate(hkv) if x not in (0, 1)]
    if bad:
        il, x = bad[0]
        raise ValueError(f"kimi-linear: {key}attention.head_count_kv[{il}] = {x}, expected 0 (KDA block) or 1 "
                         "(MLA block: one K head shared by every query head)")
    if any(hkv):
        if not 0 < n_rot < mla_k_head_dim:
            raise ValueError(f"kimi-linear: {key}rope.dimension_count = {n_rot}, expected in (0, "
                             f"{key}attention.key_length_mla {mla_k_head_dim})")
        if kv_lora_rank <= 0 or mla_v_head_dim <= 0 or n_head <= 0:
            raise ValueError(f"kimi-linear: {key}attention.kv_lora_rank {kv_lora_rank}, value_length_mla "
                             f"{mla_v_head_dim} and head_count {n_head} must be > 0")
    return hkv


class KDAModel(RecurrentModel):
    """A tiny Kimi-Linear with dense FFNs, seeded random weights.

    Defaults: d_model 64, 2 blocks (KDA, MLA), vocab 64, 2 heads of 16 (d_inner 32), d_conv 4,
    FFN 96: n_embd_r = 3*3*32 = 288 and n_embd_s = 16*16*2 = 512 per KDA layer. head_count_kv: llama.cpp's
    per-layer array (0 = KDA block, 1 = MLA block), or one value for every block; None:
    default_head_count_kv(n_layer), llama.cpp's hybrid layout (2 blocks: KDA, MLA). 0 gives a
    KDA-only model, whose file llama.cpp cannot run (its hybrid memory needs an attention block).
    MLA blocks: the n_head heads have keys of mla_k_head_dim (the last n_rot of them the "rope"
    part), values of mla_v_head_dim, a compressed kv of kv_lora_rank.
    `hparams` holds the constructor's structural arguments; `gguf_tensors()` the weights by GGUF name."""

    arch = "kimi-linear"
    k_shift = None                           # no rope on MLA keys: a shift only renumbers cells
    residual_first = True
    layer_output_names = ("mixer", "l_out")

    def __init__(self, n_vocab=64, n_embd=64, n_layer=2, n_head=2, head_dim=16, d_conv=4, n_ff=96,
                 eps=1e-5, n_ctx_train=4096, head_count_kv=None, kv_lora_rank=32, mla_k_head_dim=24,
                 mla_v_head_dim=16, n_rot=8, devices=None, seed=0, layer_outputs=False):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding, final norm and output head live on the last device (the host).
        layer_outputs: also return each block's mixer output 'mixer.{il}' and block output
        'l_out.{il}' ([n_embd, n_tokens]; tests)."""
        if head_count_kv is None:
            head_count_kv = default_head_count_kv(n_layer)
        if isinstance(head_count_kv, (int, np.integer)):     # one value for every block (0: KDA only)
            head_count_kv = [int(head_count_kv)] * n_layer
        hkv = [int(x) for x in head_count_kv][:n_layer]      # a model cut to its first blocks keeps its layout
        if len(hkv) != n_layer:
            raise ValueError(f"kimi-linear: attention.head_count_kv has {len(hkv)} entries, expected one per "
                             f"layer ({n_layer})")
        check_mla(n_head, hkv, mla_k_head_dim, n_rot, mla_v_head_dim, kv_lora_rank)
        hp = dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, head_dim=head_dim,
                  d_conv=d_conv, n_ff=n_ff, eps=float(eps), n_ctx_train=n_ctx_train, head_count_kv=hkv)
        if any(hkv):
            hp.update(kv_lora_rank=kv_lora_rank, mla_k_head_dim=mla_k_head_dim,
                      mla_v_head_dim=mla_v_head_dim, n_rot=n_rot)
        super().__init__(hp, devices, layer_outputs)
        self.n_head, self.head_dim, self.d_conv, self.n_ff = n_head, head_dim, d_conv, n_ff
        self.d_inner = n_head * head_dim
        self.eps = float(eps)
        self.head_count_kv = hkv
        self.attn_layers = tuple(il for il in range(n_layer) if hkv[il])
        self.kv_lora_rank, self.mla_k_head_dim, self.mla_v_head_dim, self.n_rot = \
            kv_lora_rank, mla_k_head_dim, mla_v_head_dim, n_rot
        self.make_weights(seed)

    def layer_weights(self, mk, il):
        if il in self.attn_layers:
            return self.mla_layer_weights(mk, il)
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

    def mla_layer_weights(self, mk, il):
        E, H, p = self.n_embd, self.n_head, f"blk.{il}."
        dk, dv, r, lora = self.mla_k_head_dim, self.mla_v_head_dim, self.n_rot, self.kv_lora_rank
        lw = {
            "attn_norm": mk(p + "attn_norm.weight", (E,), 0.1, 1.0),
            "attn_q": mk(p + "attn_q.weight", (E, H * dk), 1 / np.sqrt(E)),
            "attn_kv_a_mqa": mk(p + "attn_kv_a_mqa.weight", (E, lora + r), 1 / np.sqrt(E)),
            "attn_kv_a_norm": mk(p + "attn_kv_a_norm.weight", (lora,), 0.1, 1.0),
            "attn_k_b": mk(p + "attn_k_b.weight", (dk - r, lora, H), 1 / np.sqrt(dk - r)),
            "attn_v_b": mk(p + "attn_v_b.weight", (lora, dv, H), 1 / np.sqrt(lora)),
            "attn_output": mk(p + "attn_output.weight", (H * dv, E), 1 / np.sqrt(H * dv)),
        }
        lw.update(self.ffn_weights(mk, il, self.n_ff))
        return lw

    # memory sizes (floats per cache row): three conv histories (Q, K, V); one head_dim^2 state per
    # head; an MLA block keeps its one K head of kv_lora_rank + n_rot in the KV cache, no V
    def n_embd_r(self, il):
        return 0 if il in self.attn_layers else 3 * (self.d_conv - 1) * self.d_inner

    def n_embd_s(self, il):
        return 0 if il in self.attn_layers else self.head_dim * self.head_dim * self.n_head

    def n_embd_k_gqa(self, il):
        return self.kv_lora_rank + self.n_rot if il in self.attn_layers else 0

    def n_embd_v_gqa(self, il):
        return 0                         # K-only: the values are a view of the keys

    def build_layer(self, g, inp_rs, cur, il):
        return build_kda_layer(g, inp_rs, il, self.layer_w[il], cur, self.n_head, self.head_dim, self.d_conv, self.eps)

    def build_attn_layer(self, g, inp_attn, cur, il):
        return build_mla_layer(g, inp_attn, il, self.layer_w[il], cur, self)


class KDAHybridModel(KDAModel):
    """Kimi-Linear with the 48B model's rhythm: 4 blocks, the 4th an MLA block."""

    DEFAULT_N_LAYER = 4

    def __init__(self, n_layer=4, **kw):
        super().__init__(n_layer=n_layer, **kw)


KdaModel = KDAModel
