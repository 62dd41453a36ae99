"""Mamba-2 (llama.cpp arch `mamba2`): embedding, N x (RMS norm -> Mamba-2 mixer -> residual),
final RMS norm, output head. No feed-forward.

`build_mamba2_layer` reads like llama.cpp's `llm_graph_context_mamba::build_mamba2_layer`:
the conv history goes through `build_conv_state_store` (the one writer of the r cache), the
SSM state is read by `ssm_scan` directly from the cache rows (build_rs's get_state_rows hook)
and its K snapshots are stored with `build_state_store`. K = n_rs_seq + 1.

Weights use llama.cpp's GGUF tensor names (`blk.N.ssm_in.weight`, ...) and ggml `ne` shapes;
the scaffolding around the mixer (devices, seeded weights, `hparams` and `gguf_tensors()` for
models.gguf_io, the whole-model graph) is models.base.RecurrentModel's."""
from __future__ import annotations

import numpy as np

import minigraph as mg

from .base import RecurrentModel, require_equal_seqs


def build_mamba2_layer(g, inp_rs, cur, il: int, w: dict, hp: "Mamba2Model") -> mg.Tensor:
    """One Mamba-2 mixer. cur: [n_embd, n_tokens] (already normed). Returns [n_embd, n_tokens].
    w: the layer's weights by short name; hp: the model (hyperparameters)."""
    d_conv, d_inner, d_state = hp.d_conv, hp.d_inner, hp.d_state
    n_head, head_dim, n_group = hp.n_head, hp.head_dim, hp.n_group
    n_seq_tokens, n_seqs = g.n_seq_tokens, g.n_seqs
    K = g.n_rs_seq + 1
    conv_channels = d_inner + 2 * n_group * d_state
    if d_inner % n_head:
        raise ValueError(f"mamba2 layer {il}: d_inner {d_inner} must be a multiple of n_head {n_head}")
    require_equal_seqs(g, "mamba2", il)

    conv_states_all = g.mctx.r_l[il]                            # [n_embd_r, mem_size*K]
    ssm_states_all = g.mctx.s_l[il]                             # [n_embd_s, mem_size*K]

    conv = g.build_rs(inp_rs, conv_states_all, hp.n_embd_r(il), n_seqs)                  # [n_embd_r, n_seqs]
    conv = mg.reshape_3d(conv, d_conv - 1, conv_channels, n_seqs)                        # [d_conv-1, conv_channels, n_seqs]

    cur = mg.reshape_3d(cur, cur.ne[0], n_seq_tokens, n_seqs)                            # [n_embd, n_seq_tokens, n_seqs]

    # {n_embd, d_in_proj} @ {n_embd, n_seq_tokens, n_seqs} => {d_in_proj, n_seq_tokens, n_seqs}
    zxBCdt = mg.mul_mat(w["ssm_in"], cur)                                                # [2*d_inner+2*n_group*d_state+n_head, n_seq_tokens, n_seqs]

    elt = zxBCdt.type.size
    z = mg.view_4d(zxBCdt, head_dim, n_head, n_seq_tokens, n_seqs,                       # [head_dim, n_head, n_seq_tokens, n_seqs]
                   head_dim * elt, zxBCdt.nb[1], zxBCdt.nb[2], 0)
    xBC = mg.view_3d(zxBCdt, conv_channels, n_seq_tokens, n_seqs,                        # [conv_channels, n_seq_tokens, n_seqs]
                     zxBCdt.nb[1], zxBCdt.nb[2], d_inner * elt)
    dt = mg.view_3d(zxBCdt, n_head, n_seq_tokens, n_seqs,                                # [n_head, n_seq_tokens, n_seqs]
                    zxBCdt.nb[1], zxBCdt.nb[2], (2 * d_inner + 2 * n_group * d_state) * elt)

    # conv
    conv_x = mg.concat(conv, mg.transpose(xBC), 0)                                       # [d_conv-1+n_seq_tokens, conv_channels, n_seqs]
    g.build_conv_state_store(inp_rs, conv_states_all, conv_x, d_conv - 1)

    # 1D convolution (a cross-correlation over the window), bias, silu
    xBC = mg.ssm_conv(conv_x, w["ssm_conv1d"])                                           # [conv_channels, n_seq_tokens, n_seqs]
    xBC = mg.add(xBC, w["ssm_conv1d_b"])
    xBC = mg.silu(xBC)

    x = mg.view_4d(xBC, head_dim, n_head, n_seq_tokens, n_seqs,                          # [head_dim, n_head, n_seq_tokens, n_seqs]
                   head_dim * elt, xBC.nb[1], xBC.nb[2], 0)
    B = mg.view_4d(xBC, d_state, n_group, n_seq_tokens, n_seqs,                          # [d_state, n_group, n_seq_tokens, n_seqs]
                   d_state * elt, xBC.nb[1], xBC.nb[2], d_inner * elt)
    C = mg.view_4d(xBC, d_state, n_group, n_seq_tokens, n_seqs,                          # [d_state, n_group, n_seq_tokens, n_seqs]
                   d_state * elt, xBC.nb[1], xBC.nb[2], (d_inner + n_group * d_state) * elt)

    # {n_head, n_seq_tokens, n_seqs}
    dt = mg.add(mg.cont(dt), w["ssm_dt_b"])                                              # [n_head, n_seq_tokens, n_seqs]
    A = w["ssm_a"]                                                                       # [1, n_head]

    def get_ssm_rows(ctx, states, ids):
        ssm = mg.reshape_4d(states, d_state, head_dim, n_head, states.ne[1])             # [d_state, head_dim, n_head, mem_size*K]
        # y first, then K state snapshots (slot 0 = final state)
        return mg.ssm_scan(ssm, x, dt, A, B, C, ids, K)                                  # [n_head*head_dim*n_seq_tokens*n_seqs + K*n_embd_s*n_seqs]

    y_ssm = g.build_rs(inp_rs, ssm_states_all, hp.n_embd_s(il), n_seqs, get_ssm_rows)

    # store the last min(n_seq_tokens, K) states: slot j of seq q = state j tokens back
    g.build_state_store(inp_rs, ssm_states_all, y_ssm, x.nelements() * elt, d_state * d_inner)

    y = mg.view_4d(y_ssm, head_dim, n_head, n_seq_tokens, n_seqs,                        # [head_dim, n_head, n_seq_tokens, n_seqs]
                   head_dim * elt, head_dim * n_head * elt, head_dim * n_head * n_seq_tokens * elt, 0)

    # D skip connection, then gate with silu(z) (swiglu_split)
    y = mg.add(y, mg.mul(x, w["ssm_d"]))                                                 # [head_dim, n_head, n_seq_tokens, n_seqs]
    y = mg.mul(mg.silu(mg.cont(z)), y)                                                   # [head_dim, n_head, n_seq_tokens, n_seqs]

    # grouped RMS norm
    y = mg.reshape_4d(y, d_inner // n_group, n_group, n_seq_tokens, n_seqs)              # [d_inner/n_group, n_group, n_seq_tokens, n_seqs]
    y = mg.mul(mg.rms_norm(y, hp.eps), w["ssm_norm"])
    y = mg.reshape_3d(y, d_inner, n_seq_tokens, n_seqs)                                  # [d_inner, n_seq_tokens, n_seqs]

    # {d_inner, n_embd} @ {d_inner, n_seq_tokens, n_seqs} => {n_embd, n_seq_tokens, n_seqs}
    cur = mg.mul_mat(w["ssm_out"], y)                                                    # [n_embd, n_seq_tokens, n_seqs]
    return mg.reshape_2d(cur, cur.ne[0], n_seq_tokens * n_seqs)                          # [n_embd, n_tokens]


class Mamba2Model(RecurrentModel):
    """A tiny Mamba-2 with seeded random weights.

    Defaults: d_model 64, 2 layers, vocab 64, d_conv 4, d_inner 128 (expand 2), d_state 16,
    8 heads of 16, 2 groups: conv channels 192, n_embd_r 576, n_embd_s 2048 per layer."""
    arch = "mamba2"

    def __init__(self, n_vocab=64, n_embd=64, n_layer=2, d_conv=4, d_inner=128, d_state=16,
                 n_head=8, n_group=2, eps=1e-5, devices=None, seed=0, layer_outputs=False):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding and output head live on the last device of the list (the host).
        layer_outputs: also return each layer's residual output as 'l_out.{il}' (tests)."""
        if d_inner % n_head or n_head % n_group or d_inner % n_group:
            raise ValueError("mamba2: d_inner must divide into n_head heads and n_head into n_group groups")
        super().__init__(dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, d_conv=d_conv, d_inner=d_inner,
                              d_state=d_state, n_head=n_head, n_group=n_group, eps=float(eps)),
                         devices, layer_outputs)
        self.d_conv, self.d_inner, self.d_state = d_conv, d_inner, d_state
        self.n_head, self.n_group, self.head_dim = n_head, n_group, d_inner // n_head
        self.conv_channels = d_inner + 2 * n_group * d_state
        self.d_in_proj = 2 * d_inner + 2 * n_group * d_state + n_head
        self.eps = eps
        self.make_weights(seed)

    def layer_weights(self, mk, il):
        E, n_head, p = self.n_embd, self.n_head, f"blk.{il}."
        ssm_in = mk.normal((E, self.d_in_proj), 1 / np.sqrt(E))
        ssm_in[-n_head:] *= 0.25                                  # dt rows: dt stays near its bias
        # dt bias = softplus^-1(dt0), dt0 log-uniform in [0.02, 0.2] (Mamba-2 inits [1e-3, 0.1]);
        # not smaller: ggml's f32 softplus log(1 + exp(x)) loses ~6e-8 absolute, i.e. 1e-5
        # relative at dt ~ 6e-3, and dt scales the state update linearly
        dt0 = np.exp(mk.rng.uniform(np.log(0.02), np.log(0.2), n_head))
        return {
            "attn_norm": mk(p + "attn_norm.weight", (E,), 0.1, 1.0),
            "ssm_in": mk.fixed(p + "ssm_in.weight", (E, self.d_in_proj), ssm_in),
            "ssm_conv1d": mk(p + "ssm_conv1d.weight", (self.d_conv, self.conv_channels), 1 / np.sqrt(self.d_conv)),
            "ssm_conv1d_b": mk(p + "ssm_conv1d.bias", (self.conv_channels,), 0.1),
            "ssm_dt_b": mk.fixed(p + "ssm_dt.bias", (n_head,), dt0 + np.log(-np.expm1(-dt0))),
            # A = -exp(A_log), A_log uniform in [0, log 16]: stored already negative
            "ssm_a": mk.fixed(p + "ssm_a", (1, n_head), -np.exp(mk.rng.uniform(0, np.log(16), (n_head, 1)))),
            "ssm_d": mk(p + "ssm_d", (1, n_head), 0.1, 1.0),
            "ssm_norm": mk(p + "ssm_norm.weight", (self.d_inner // self.n_group, self.n_group), 0.1, 1.0),
            "ssm_out": mk(p + "ssm_out.weight", (self.d_inner, E), 1 / np.sqrt(self.d_inner)),
        }

    # memory sizes: conv history of d_conv-1 columns per conv channel; SSM state d_state x d_inner
    def n_embd_r(self, il):
        return (self.d_conv - 1) * self.conv_channels

    def n_embd_s(self, il):
        return self.d_state * self.d_inner

    def build_layer(self, g, inp_rs, cur, il):
        return build_mamba2_layer(g, inp_rs, cur, il, self.layer_w[il], self)
