"""Gated DeltaNet (Qwen3.5, llama.cpp arch `qwen35`), read side by side with llama.cpp's
src/models/qwen35.cpp: embedding, N x (RMS norm -> mixer -> residual -> RMS norm -> SwiGLU FFN ->
residual), final RMS norm, output head. The mixer of block il is a gated delta-net
(recurrent state) or, when full_attention_interval is set and (il + 1) % interval == 0 (llama.cpp's
rule), a gated attention block (KV cache): `build_gated_attn_layer`.

q and k of the delta-net are l2-normed as llama.cpp does it: rms_norm(x, eps / n) / sqrt(n)
= x / sqrt(sum x^2 + eps) (not ggml_l2_norm's x / max(|x|, eps)).

`build_delta_net_layer` reads like llama.cpp's qwen35 `build_layer_attn_linear`: the conv history
goes through `build_conv_state_store` (the one writer of the r cache); the recurrence is always
the fused `gated_delta_net` with K = n_rs_seq + 1 snapshots (K = 1 is the n_rs_seq = 0 case),
stored with `build_state_store`.

Weights use llama.cpp's GGUF tensor names (`blk.N.attn_qkv.weight`, ...) and ggml `ne` shapes;
the scaffolding around the mixer (devices, seeded weights, `hparams` and `gguf_tensors()` for
models.gguf_io, the whole-model graph with its SwiGLU FFN) is models.base.RecurrentModel's."""
from __future__ import annotations

import numpy as np

import minigraph as mg

from .attn_inputs import build_attn
from .base import RecurrentModel, build_norm, require_equal_seqs
from .graph import GraphInput, _differs, write_input


ROPE_TYPE_IMROPE = 40      # llama.cpp's rope type for qwen35 (interleaved multi-section rope)


def build_gdn_l2_norm(x: mg.Tensor, eps: float) -> mg.Tensor:
    """llama.cpp's delta-net l2 norm over dim 0: x / sqrt(sum x^2 + eps)."""
    n = x.ne[0]
    return mg.scale(mg.rms_norm(x, eps / n), 1.0 / np.sqrt(n))


class InputPosMulti(GraphInput):
    """llama.cpp's inp_pos for a rope with 4 position streams (n_pos_per_embd = 4) fed text
    tokens: streams t, h, w = the token's position, stream e = 0; [4 * n_tokens] i32."""

    def __init__(self, pos: mg.Tensor):
        self.pos = pos

    def set_input(self, ubatch):
        p = ubatch.pos.tolist()
        write_input(self.pos, p * 3 + [0] * len(p))

    def can_reuse(self, params):
        return _differs("pos (4 * n_tokens)", self.pos.ne[0], 4 * params.ubatch.n_tokens)


def build_inp_pos_multi(g) -> mg.Tensor:
    """The 4-stream positions input, built once per graph."""
    if getattr(g, "_inp_pos_multi", None) is not None:
        return g._inp_pos_multi
    t = g._inp_pos_multi = g.ctx0.new_tensor_1d(mg.i32, 4 * g.n_tokens).set_name("inp_pos").set_input()
    g.res.inputs.append(InputPosMulti(t))
    return t


def build_gated_attn_layer(g, inp_attn, inp_pos: mg.Tensor, cur: mg.Tensor, il: int, w: dict,
                           hp: "DeltaNetModel") -> mg.Tensor:
    """One qwen35 gated attention mixer (llama.cpp's build_layer_attn). cur: the normed input
    [n_embd, n_tokens]. attn_q gives, per head, the query then its gate (2 * head_dim rows);
    q/k get a per-head RMS norm, IMROPE over the first n_rot dims, GQA attention over the KV
    cache, the output times sigmoid(gate), then attn_output. Returns [n_embd, n_tokens]."""
    T, d, H, Hkv = g.n_tokens, hp.attn_head_dim, hp.n_head, hp.n_head_kv
    q_full = mg.mul_mat(w["attn_q"], cur)                                     # [2*d*H, T]
    elt = q_full.type.size
    q = mg.view_3d(q_full, d, H, T, 2 * d * elt, 2 * d * H * elt, 0)          # [d, H, T]
    q = build_norm(q, w["attn_q_norm"], hp.eps)
    k = mg.reshape_3d(mg.mul_mat(w["attn_k"], cur), d, Hkv, T)                # [d, Hkv, T]
    k = build_norm(k, w["attn_k_norm"], hp.eps)
    gate = mg.view_3d(q_full, d, H, T, 2 * d * elt, 2 * d * H * elt, d * elt)  # [d, H, T]
    gate = mg.cont_2d(gate, d * H, T)                                         # [d*H, T]
    v = mg.reshape_3d(mg.mul_mat(w["attn_v"], cur), d, Hkv, T)                # [d, Hkv, T]
    # no YaRN (ext_factor 0), freq_scale 1, attn_factor 1 (llama.cpp's defaults for these files)
    rope = (hp.n_rot, list(hp.rope_sections), ROPE_TYPE_IMROPE, hp.n_ctx_train, hp.rope_freq_base,
            1.0, 0.0, 1.0, 32.0, 1.0)
    q = mg.rope_multi(q, inp_pos, None, *rope)
    k = mg.rope_multi(k, inp_pos, None, *rope)
    cur = build_attn(g, inp_attn, q, k, v, H, Hkv, 1.0 / np.sqrt(d), il)      # [d*H, T]
    cur = mg.mul(cur, mg.sigmoid(gate))
    return mg.mul_mat(w["attn_output"], cur)                                  # [n_embd, T]


def build_delta_net_layer(g, inp_rs, cur, il: int, w: dict, hp: "DeltaNetModel") -> mg.Tensor:
    """One gated delta-net mixer. cur: [n_embd, n_tokens] (already normed).
    Returns [n_embd, n_tokens]. w: the layer's weights by short name; hp: the model."""
    head_k_dim, head_v_dim = hp.head_k_dim, hp.head_v_dim
    num_k_heads, num_v_heads = hp.num_k_heads, hp.num_v_heads
    key_dim, value_dim, conv_channels = hp.key_dim, hp.value_dim, hp.conv_channels
    n_seq_tokens, n_seqs = g.n_seq_tokens, g.n_seqs
    K = g.n_rs_seq + 1
    if head_k_dim != head_v_dim:
        raise ValueError(f"delta-net layer {il}: head_k_dim {head_k_dim} must equal head_v_dim {head_v_dim}")
    require_equal_seqs(g, "delta-net", il)

    conv_states_all = g.mctx.r_l[il]                            # [n_embd_r, mem_size*K]
    ssm_states_all = g.mctx.s_l[il]                             # [n_embd_s, mem_size*K]

    qkv_mixed = mg.mul_mat(w["attn_qkv"], cur)                                           # [conv_channels, n_tokens]
    qkv_mixed = mg.reshape_3d(qkv_mixed, conv_channels, n_seq_tokens, n_seqs)            # [conv_channels, n_seq_tokens, n_seqs]
    z = mg.mul_mat(w["attn_gate"], cur)                                                  # [value_dim, n_tokens]

    beta = mg.mul_mat(w["ssm_beta"], cur)                                                # [num_v_heads, n_tokens]
    beta = mg.reshape_4d(beta, 1, num_v_heads, n_seq_tokens, n_seqs)                     # [1, num_v_heads, n_seq_tokens, n_seqs]
    beta = mg.sigmoid(beta)

    alpha = mg.mul_mat(w["ssm_alpha"], cur)                                              # [num_v_heads, n_tokens]
    alpha = mg.reshape_3d(alpha, num_v_heads, n_seq_tokens, n_seqs)                      # [num_v_heads, n_seq_tokens, n_seqs]
    alpha_biased = mg.add(alpha, w["ssm_dt"])
    alpha_softplus = mg.softplus(alpha_biased)
    gate = mg.mul(alpha_softplus, w["ssm_a"])                   # -exp(A_log) * softplus: log-decay <= 0
    gate = mg.reshape_4d(gate, 1, num_v_heads, n_seq_tokens, n_seqs)                     # [1, num_v_heads, n_seq_tokens, n_seqs]

    # conv
    conv_states = g.build_rs(inp_rs, conv_states_all, hp.n_embd_r(il), n_seqs)          # [n_embd_r, n_seqs]
    conv_states = mg.reshape_3d(conv_states, hp.d_conv - 1, conv_channels, n_seqs)       # [d_conv-1, conv_channels, n_seqs]
    conv_input = mg.concat(conv_states, mg.transpose(qkv_mixed), 0)                      # [d_conv-1+n_seq_tokens, conv_channels, n_seqs]
    g.build_conv_state_store(inp_rs, conv_states_all, conv_input, hp.d_conv - 1)

    conv_output = mg.ssm_conv(conv_input, w["ssm_conv1d"])                               # [conv_channels, n_seq_tokens, n_seqs]
    conv_output = mg.silu(conv_output)

    elt = conv_output.type.size
    nb1, nb2 = conv_output.nb[1], conv_output.nb[2]
    q_conv = mg.view_4d(conv_output, head_k_dim, num_k_heads, n_seq_tokens, n_seqs,      # [head_k_dim, num_k_heads, n_seq_tokens, n_seqs]
                        head_k_dim * elt, nb1, nb2, 0)
    k_conv = mg.view_4d(conv_output, head_k_dim, num_k_heads, n_seq_tokens, n_seqs,      # [head_k_dim, num_k_heads, n_seq_tokens, n_seqs]
                        head_k_dim * elt, nb1, nb2, key_dim * elt)
    v_conv = mg.view_4d(conv_output, head_v_dim, num_v_heads, n_seq_tokens, n_seqs,      # [head_v_dim, num_v_heads, n_seq_tokens, n_seqs]
                        head_v_dim * elt, nb1, nb2, 2 * key_dim * elt)

    q_conv = build_gdn_l2_norm(q_conv, hp.eps)
    k_conv = build_gdn_l2_norm(k_conv, hp.eps)

    state = g.build_rs(inp_rs, ssm_states_all, hp.n_embd_s(il), n_seqs)                  # [n_embd_s, n_seqs]
    state = mg.reshape_4d(state, head_v_dim, head_v_dim, num_v_heads, n_seqs)            # [head_v_dim, head_v_dim, num_v_heads, n_seqs]

    # fused gated delta rule; k heads broadcast to v heads tiled (v head h uses k head h % H_k)
    out = mg.gated_delta_net(q_conv, k_conv, v_conv, gate, beta, state, K)               # [head_v_dim*num_v_heads, n_seq_tokens*n_seqs + K*head_v_dim*n_seqs]
    output = mg.view_4d(out, head_v_dim, num_v_heads, n_seq_tokens, n_seqs,              # [head_v_dim, num_v_heads, n_seq_tokens, n_seqs]
                        head_v_dim * elt, head_v_dim * num_v_heads * elt,
                        head_v_dim * num_v_heads * n_seq_tokens * elt, 0)

    # the last min(n_seq_tokens, K) states: slot j of seq q = state j tokens back
    g.build_state_store(inp_rs, ssm_states_all, out,
                        head_v_dim * num_v_heads * n_seq_tokens * n_seqs * elt, hp.n_embd_s(il))

    # gated RMS norm per head: rms_norm(o) * ssm_norm * silu(z)
    z_2d = mg.reshape_2d(z, head_v_dim, num_v_heads * n_seq_tokens * n_seqs)             # [head_v_dim, num_v_heads*n_tokens]
    attn_out_2d = mg.reshape_2d(output, head_v_dim, num_v_heads * n_seq_tokens * n_seqs)  # [head_v_dim, num_v_heads*n_tokens]
    attn_out_norm = mg.mul(mg.rms_norm(attn_out_2d, hp.eps), w["ssm_norm"])
    attn_out_norm = mg.mul(attn_out_norm, mg.silu(z_2d))
    final_output = mg.reshape_2d(attn_out_norm, value_dim, n_seq_tokens * n_seqs)        # [value_dim, n_tokens]

    return mg.mul_mat(w["ssm_out"], final_output)                                        # [n_embd, n_tokens]



def check_attention(n_head: int, n_head_kv: int, d: int, n_rot: int, sections: list, key: str = ""):
    """The rules on qwen35's gated attention blocks, for the model and for GGUF files alike
    (``key`` prefixes the key names, e.g. "qwen35."): query heads a multiple of the K/V heads,
    an even rotary part of at most key_length dims, 4 rope sections >= 0. ValueError otherwise."""
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
        raise ValueError(f"qwen35: {key}attention.head_count {n_head} must be a multiple of "
                         f"attention.head_count_kv {n_head_kv} (both > 0)")
    if n_rot % 2 or not 0 < n_rot <= d:
        raise ValueError(f"qwen35: {key}rope.dimension_count = {n_rot}, expected even and in (0, key_length {d}]")
    if len(sections) != 4 or any(x < 0 for x in sections):
        raise ValueError(f"qwen35: {key}rope.dimension_sections = {sections}, expected 4 entries >= 0")


class DeltaNetModel(RecurrentModel):
    """A tiny Qwen3.5-style gated delta-net with seeded random weights.

    Defaults: d_model 64, 2 layers (a delta-net block, then a gated attention block: llama.cpp
    runs only hybrid qwen35 files), vocab 64, d_conv 4, head dim 16, 2 k heads, 4 v heads
    (d_inner 64), n_ff 128: conv channels 128, n_embd_r 384, n_embd_s 1024 per delta-net layer."""
    arch = "qwen35"
    k_shift = "refuse"         # multi-section rope: llama.cpp cannot shift cached keys (models.k_shift)

    def __init__(self, n_vocab=64, n_embd=64, n_layer=2, d_conv=4, head_dim=16, num_k_heads=2,
                 num_v_heads=4, n_ff=128, eps=1e-6, full_attention_interval=None, n_head=4, n_head_kv=2,
                 attn_head_dim=None, n_rot=None, rope_sections=None, rope_freq_base=1e7, n_ctx_train=4096,
                 devices=None, seed=0, layer_outputs=False):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding and output head live on the last device of the list (the host).
        full_attention_interval: 0 = every block a delta-net (a file llama.cpp cannot run: its
        hybrid memory needs an attention block); None = llama.cpp's default 4, or n_layer for a
        model of 2 or 3 blocks (2 blocks: delta-net, attention; 1 block: a delta-net); k = block il is a gated
        attention block when (il + 1) % k == 0 (n_head query heads, n_head_kv K/V heads of
        attn_head_dim (default head_dim), IMROPE over n_rot dims (default attn_head_dim) with
        rope_sections (4 entries; default: the n_rot/2 pairs split over t, h, w)).
        layer_outputs: also return each layer's residual output as 'l_out.{il}' (tests)."""
        if num_v_heads % num_k_heads:
            raise ValueError("delta-net: num_v_heads must be a multiple of num_k_heads")
        if full_attention_interval is None:            # one block alone stays a delta-net
            full_attention_interval = min(4, n_layer) if n_layer > 1 else 0
        interval = int(full_attention_interval)
        if interval < 0:
            raise ValueError(f"qwen35: full_attention_interval = {interval}, expected >= 0")
        attn_layers = tuple(il for il in range(n_layer) if interval and (il + 1) % interval == 0)
        d = int(attn_head_dim or head_dim)
        n_rot = int(n_rot or d)
        if rope_sections is None:
            half = n_rot // 2
            rope_sections = [half - 2 * (half // 3), half // 3, half // 3, 0]
        rope_sections = [int(x) for x in rope_sections]
        if attn_layers:
            check_attention(n_head, n_head_kv, d, n_rot, rope_sections)
        elif len(rope_sections) != 4 or any(x < 0 for x in rope_sections):
            raise ValueError(f"qwen35: rope.dimension_sections = {rope_sections}, expected 4 entries >= 0")
        hp = dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, d_conv=d_conv, head_dim=head_dim,
                  num_k_heads=num_k_heads, num_v_heads=num_v_heads, n_ff=n_ff, eps=float(eps),
                  full_attention_interval=interval)
        if interval:
            hp.update(n_head=n_head, n_head_kv=n_head_kv, attn_head_dim=d,
                      n_rot=n_rot, rope_sections=rope_sections, rope_freq_base=float(rope_freq_base),
                      n_ctx_train=n_ctx_train)
        self.full_attention_interval, self.attn_layers = interval, attn_layers
        self.n_head, self.n_head_kv, self.attn_head_dim, self.n_rot = n_head, n_head_kv, d, n_rot
        self.rope_sections, self.rope_freq_base = rope_sections, float(rope_freq_base)
        self.n_ctx_train = n_ctx_train
        super().__init__(hp, devices, layer_outputs)
        self.d_conv = d_conv
        # hparams as llama.cpp names them: ssm_d_state = head_k_dim, ssm_n_group = num_k_heads,
        # ssm_dt_rank = num_v_heads, ssm_d_inner = value_dim
        self.head_k_dim = self.head_v_dim = head_dim
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.key_dim = head_dim * num_k_heads
        self.value_dim = self.d_inner = head_dim * num_v_heads
        self.conv_channels = self.value_dim + 2 * self.key_dim
        self.n_ff, self.eps = n_ff, eps
        self.make_weights(seed)

    def attn_layer_weights(self, mk, il):
        E, d, p = self.n_embd, self.attn_head_dim, f"blk.{il}."
        H, Hkv = self.n_head, self.n_head_kv
        lw = {
            "attn_norm": mk(p + "attn_norm.weight", (E,), 0.1, 1.0),
            "attn_q": mk(p + "attn_q.weight", (E, 2 * d * H), 1 / np.sqrt(E)),     # q | gate per head
            "attn_k": mk(p + "attn_k.weight", (E, d * Hkv), 1 / np.sqrt(E)),
            "attn_v": mk(p + "attn_v.weight", (E, d * Hkv), 1 / np.sqrt(E)),
            "attn_q_norm": mk(p + "attn_q_norm.weight", (d,), 0.1, 1.0),
            "attn_k_norm": mk(p + "attn_k_norm.weight", (d,), 0.1, 1.0),
            "attn_output": mk(p + "attn_output.weight", (d * H, E), 1 / np.sqrt(d * H)),
        }
        lw.update(self.ffn_weights(mk, il, self.n_ff, norm="post_attention_norm"))
        return lw

    def layer_weights(self, mk, il):
        if il in self.attn_layers:
            return self.attn_layer_weights(mk, il)
        E, Hv, p = self.n_embd, self.num_v_heads, f"blk.{il}."
        # dt bias = softplus^-1(dt0), dt0 log-uniform in [0.02, 0.2]; A in [-16, -1]:
        # per-token log-decay g = softplus(alpha + dt_bias) * A mostly in [-3, -0.02]
        dt0 = np.exp(mk.rng.uniform(np.log(0.02), np.log(0.2), Hv))
        lw = {
            "attn_norm": mk(p + "attn_norm.weight", (E,), 0.1, 1.0),
            "attn_qkv": mk(p + "attn_qkv.weight", (E, self.conv_channels), 1 / np.sqrt(E)),
            "attn_gate": mk(p + "attn_gate.weight", (E, self.value_dim), 1 / np.sqrt(E)),
            "ssm_beta": mk(p + "ssm_beta.weight", (E, Hv), 1 / np.sqrt(E)),
            "ssm_alpha": mk(p + "ssm_alpha.weight", (E, Hv), 0.25 / np.sqrt(E)),
            "ssm_conv1d": mk(p + "ssm_conv1d.weight", (self.d_conv, self.conv_channels), 1 / np.sqrt(self.d_conv)),
            "ssm_dt": mk.fixed(p + "ssm_dt.bias", (Hv,), dt0 + np.log(-np.expm1(-dt0))),
            "ssm_a": mk.fixed(p + "ssm_a", (Hv,), -np.exp(mk.rng.uniform(0, np.log(16), Hv))),
            "ssm_norm": mk(p + "ssm_norm.weight", (self.head_v_dim,), 0.1, 1.0),
            "ssm_out": mk(p + "ssm_out.weight", (self.value_dim, E), 1 / np.sqrt(self.value_dim)),
        }
        lw.update(self.ffn_weights(mk, il, self.n_ff, norm="post_attention_norm"))
        return lw

    # memory sizes: conv history of d_conv-1 columns per conv channel (q|k|v); delta state
    # head_v_dim x head_v_dim per v head
    def n_embd_r(self, il):
        return 0 if il in self.attn_layers else (self.d_conv - 1) * self.conv_channels

    def n_embd_s(self, il):
        return 0 if il in self.attn_layers else self.head_v_dim * self.head_v_dim * self.num_v_heads

    def n_embd_k_gqa(self, il):
        return self.attn_head_dim * self.n_head_kv if il in self.attn_layers else 0

    def n_embd_v_gqa(self, il):
        return self.n_embd_k_gqa(il)

    def build_layer(self, g, inp_rs, cur, il):
        return build_delta_net_layer(g, inp_rs, cur, il, self.layer_w[il], self)

    def build_attn_layer(self, g, inp_attn, cur, il):
        return build_gated_attn_layer(g, inp_attn, build_inp_pos_multi(g), cur, il, self.layer_w[il], self)


class DeltaNetHybridModel(DeltaNetModel):
    """qwen35 with llama.cpp's layout: 4 blocks, every 4th a gated attention block (Qwen3.5's
    full_attention_interval), 4 query heads sharing 2 K/V heads."""

    def __init__(self, n_layer=4, full_attention_interval=4, **kw):
        super().__init__(n_layer=n_layer, full_attention_interval=full_attention_interval, **kw)
