"""Gated DeltaNet (Qwen3.5 style, llama.cpp arch `qwen35` with every layer linear-attention):
embedding, N x (RMS norm -> gated delta-net mixer -> residual -> RMS norm -> SwiGLU FFN ->
residual), final RMS norm, output head (REFERENCE §6.3, §6.4, §11).

`build_delta_net_layer` reads like llama.cpp's qwen35 `build_layer_attn_linear`: the conv history
goes through `build_conv_state_store` (the one writer of the r cache); the recurrence is always
the fused `gated_delta_net` with K = n_rs_seq + 1 snapshots (K = 1 is the n_rs_seq = 0 case),
stored with `build_state_store`.

Weights use llama.cpp's GGUF tensor names (`blk.N.attn_qkv.weight`, ...) and ggml `ne` shapes;
the model takes part in models.gguf_io through `hparams` (its structural constructor arguments)
and `gguf_tensors()` (GGUF name -> tensor)."""
from __future__ import annotations

import numpy as np

import minigraph as mg


def build_delta_net_layer(g, inp_rs, cur, il: int, w: dict, hp: "DeltaNetModel") -> mg.Tensor:
    """One gated delta-net mixer. cur: [n_embd, n_tokens] (already normed).
    Returns [n_embd, n_tokens]. w: the layer's weights by short name; hp: the model."""
    head_k_dim, head_v_dim = hp.head_k_dim, hp.head_v_dim
    num_k_heads, num_v_heads = hp.num_k_heads, hp.num_v_heads
    key_dim, value_dim, conv_channels = hp.key_dim, hp.value_dim, hp.conv_channels
    n_seq_tokens, n_seqs = g.n_seq_tokens, g.n_seqs
    K = g.n_rs_seq + 1
    assert head_k_dim == head_v_dim and g.n_tokens == n_seq_tokens * n_seqs   # equal_seqs

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

    q_conv = mg.l2_norm(q_conv, hp.eps)
    k_conv = mg.l2_norm(k_conv, hp.eps)

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


def build_ffn_swiglu(cur, w: dict) -> mg.Tensor:
    """ffn_down @ (silu(ffn_gate @ cur) * (ffn_up @ cur)). cur: [n_embd, n_tokens]."""
    gate = mg.mul_mat(w["ffn_gate"], cur)                                                # [n_ff, n_tokens]
    up = mg.mul_mat(w["ffn_up"], cur)                                                    # [n_ff, n_tokens]
    return mg.mul_mat(w["ffn_down"], mg.mul(mg.silu(gate), up))                          # [n_embd, n_tokens]


class DeltaNetModel:
    """A tiny Qwen3.5-style gated delta-net with seeded random weights.

    Defaults: d_model 64, 2 layers, vocab 64, d_conv 4, head dim 16, 2 k heads, 4 v heads
    (d_inner 64), n_ff 128: conv channels 128, n_embd_r 384, n_embd_s 1024 per layer."""
    arch = "qwen35"
    supports_rollback = True
    causal = True

    def __init__(self, n_vocab=64, n_embd=64, n_layer=2, d_conv=4, head_dim=16, num_k_heads=2,
                 num_v_heads=4, n_ff=128, eps=1e-6, devices=None, seed=0, layer_outputs=False):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding and output head live on the last device of the list (the host).
        layer_outputs: also return each layer's residual output as 'l_out.{il}' (tests)."""
        if num_v_heads % num_k_heads:
            raise ValueError("delta-net: num_v_heads must be a multiple of num_k_heads")
        self.n_vocab, self.n_embd, self.n_layer, self.d_conv = n_vocab, n_embd, n_layer, d_conv
        # hparams as llama.cpp names them: ssm_d_state = head_k_dim, ssm_n_group = num_k_heads,
        # ssm_dt_rank = num_v_heads, ssm_d_inner = value_dim
        self.head_k_dim = self.head_v_dim = head_dim
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.key_dim = head_dim * num_k_heads
        self.value_dim = self.d_inner = head_dim * num_v_heads
        self.conv_channels = self.value_dim + 2 * self.key_dim
        self.n_ff, self.eps = n_ff, eps
        self.layer_outputs = layer_outputs
        if devices is None:
            devices = [mg.backend("cpu")] * n_layer
        elif isinstance(devices, mg.Backend):
            devices = [devices] * n_layer
        if len(devices) != n_layer:
            raise ValueError(f"delta-net: {len(devices)} devices for {n_layer} layers")
        self.layer_devices = list(devices)
        self.host = self.layer_devices[-1]
        self.layers = list(range(n_layer))
        self.hparams = dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, d_conv=d_conv, head_dim=head_dim,
                            num_k_heads=num_k_heads, num_v_heads=num_v_heads, n_ff=n_ff, eps=float(eps))
        self._values: dict[str, np.ndarray] = {}    # gguf name -> initial values (NumPy order)
        self._named: dict[str, mg.Tensor] = {}      # gguf name -> tensor
        rng = np.random.default_rng(seed)
        E, V, Hv = n_embd, n_vocab, num_v_heads

        host_ctx = mg.Context()
        self.tok_embd = self._w(host_ctx, "token_embd.weight", (E, V), rng, 1.0)
        self.out_norm = self._w(host_ctx, "output_norm.weight", (E,), rng, 0.1, 1.0)
        self.output = self._w(host_ctx, "output.weight", (E, V), rng, 1 / np.sqrt(E))
        mg.alloc_ctx_tensors(host_ctx, self.host)

        self.layer_w = []
        for il in self.layers:
            c = mg.Context()
            p = f"blk.{il}."
            # dt bias = softplus^-1(dt0), dt0 log-uniform in [0.02, 0.2]; A in [-16, -1]:
            # per-token log-decay g = softplus(alpha + dt_bias) * A mostly in [-3, -0.02]
            dt0 = np.exp(rng.uniform(np.log(0.02), np.log(0.2), Hv))
            lw = {
                "attn_norm": self._w(c, p + "attn_norm.weight", (E,), rng, 0.1, 1.0),
                "attn_qkv": self._w(c, p + "attn_qkv.weight", (E, self.conv_channels), rng, 1 / np.sqrt(E)),
                "attn_gate": self._w(c, p + "attn_gate.weight", (E, self.value_dim), rng, 1 / np.sqrt(E)),
                "ssm_beta": self._w(c, p + "ssm_beta.weight", (E, Hv), rng, 1 / np.sqrt(E)),
                "ssm_alpha": self._w(c, p + "ssm_alpha.weight", (E, Hv), rng, 0.25 / np.sqrt(E)),
                "ssm_conv1d": self._w(c, p + "ssm_conv1d.weight", (d_conv, self.conv_channels), rng, 1 / np.sqrt(d_conv)),
                "ssm_dt": self._w(c, p + "ssm_dt.bias", (Hv,), arr=dt0 + np.log(-np.expm1(-dt0))),
                "ssm_a": self._w(c, p + "ssm_a", (Hv,), arr=-np.exp(rng.uniform(0, np.log(16), Hv))),
                "ssm_norm": self._w(c, p + "ssm_norm.weight", (head_dim,), rng, 0.1, 1.0),
                "ssm_out": self._w(c, p + "ssm_out.weight", (self.value_dim, E), rng, 1 / np.sqrt(self.value_dim)),
                "ffn_norm": self._w(c, p + "post_attention_norm.weight", (E,), rng, 0.1, 1.0),
                "ffn_gate": self._w(c, p + "ffn_gate.weight", (E, n_ff), rng, 1 / np.sqrt(E)),
                "ffn_up": self._w(c, p + "ffn_up.weight", (E, n_ff), rng, 1 / np.sqrt(E)),
                "ffn_down": self._w(c, p + "ffn_down.weight", (n_ff, E), rng, 1 / np.sqrt(n_ff)),
            }
            mg.alloc_ctx_tensors(c, self.layer_devices[il])
            self.layer_w.append(lw)
        for name, t in self._named.items():
            t.set(self._values.pop(name))

    @staticmethod
    def _init(rng, ne, scale, mean=0.0):
        return mean + scale * rng.standard_normal(tuple(reversed(ne)))

    def _w(self, ctx, name, ne, rng=None, scale=1.0, mean=0.0, arr=None):
        t = ctx.new_tensor(mg.f32, ne).set_name(name).set_weight()
        if arr is None:
            arr = self._init(rng, ne, scale, mean)
        self._values[name] = np.asarray(arr, np.float32).reshape(tuple(reversed(ne)))
        self._named[name] = t
        return t

    def gguf_tensors(self) -> dict:
        """{GGUF tensor name: tensor}; each tensor's ne (trailing 1s dropped) is llama.cpp's shape."""
        return dict(self._named)

    # memory sizes: conv history of d_conv-1 columns per conv channel (q|k|v); delta state
    # head_v_dim x head_v_dim per v head
    def n_embd_r(self, il):
        return (self.d_conv - 1) * self.conv_channels

    def n_embd_s(self, il):
        return self.head_v_dim * self.head_v_dim * self.num_v_heads

    def build(self, g) -> dict:
        """g: models.graph.GraphContext. Returns {'logits': [n_vocab, n_tokens]} (and 'l_out.{il}'
        [n_embd, n_tokens] per layer with layer_outputs)."""
        out = {}
        tokens = g.build_inp_tokens()
        inp_rs = g.build_inp_rs()
        inpL = mg.get_rows(self.tok_embd, tokens)                            # [n_embd, n_tokens]
        for il in self.layers:
            w = self.layer_w[il]
            cur = mg.mul(mg.rms_norm(inpL, self.eps), w["attn_norm"])        # [n_embd, n_tokens]
            cur = build_delta_net_layer(g, inp_rs, cur, il, w, self)         # [n_embd, n_tokens]
            cur = mg.add(cur, inpL)                                          # residual
            ffn_residual = cur
            cur = mg.mul(mg.rms_norm(cur, self.eps), w["ffn_norm"])          # [n_embd, n_tokens]
            cur = build_ffn_swiglu(cur, w)                                   # [n_embd, n_tokens]
            inpL = mg.add(cur, ffn_residual)                                 # residual
            if self.layer_outputs:
                out[f"l_out.{il}"] = inpL.set_name(f"l_out.{il}").set_output()
                g.gf.build_forward_expand(inpL)
        cur = mg.mul(mg.rms_norm(inpL, self.eps), self.out_norm)             # [n_embd, n_tokens]
        logits = mg.mul_mat(self.output, cur).set_name("logits").set_output()   # [n_vocab, n_tokens]
        g.gf.build_forward_expand(logits)
        out["logits"] = logits
        return out
