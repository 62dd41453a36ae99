"""Mamba-2 (llama.cpp arch `mamba2`): embedding, N x (RMS norm -> Mamba-2 mixer -> residual),
final RMS norm, output head. No feed-forward (REFERENCE §6.1, §11).

`build_mamba2_layer` reads like llama.cpp's `llm_graph_context_mamba::build_mamba2_layer`:
the conv history goes through `build_conv_state_store` (the one writer of the r cache), the
SSM state is read by `ssm_scan` directly from the cache rows (build_rs's get_state_rows hook)
and its K snapshots are stored with `build_state_store`. K = n_rs_seq + 1.

Weights use llama.cpp's GGUF tensor names (`blk.N.ssm_in.weight`, ...) and ggml `ne` shapes;
the model takes part in models.gguf_io through `hparams` (its structural constructor arguments)
and `gguf_tensors()` (GGUF name -> tensor)."""
from __future__ import annotations

import numpy as np

import minigraph as mg


def build_mamba2_layer(g, inp_rs, cur, il: int, w: dict, hp: "Mamba2Model") -> mg.Tensor:
    """One Mamba-2 mixer. cur: [n_embd, n_tokens] (already normed). Returns [n_embd, n_tokens].
    w: the layer's weights by short name; hp: the model (hyperparameters)."""
    d_conv, d_inner, d_state = hp.d_conv, hp.d_inner, hp.d_state
    n_head, head_dim, n_group = hp.n_head, hp.head_dim, hp.n_group
    n_seq_tokens, n_seqs = g.n_seq_tokens, g.n_seqs
    K = g.n_rs_seq + 1
    conv_channels = d_inner + 2 * n_group * d_state
    assert d_inner % n_head == 0 and g.n_tokens == n_seq_tokens * n_seqs   # equal_seqs

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


class Mamba2Model:
    """A tiny Mamba-2 with seeded random weights.

    Defaults: d_model 64, 2 layers, vocab 64, d_conv 4, d_inner 128 (expand 2), d_state 16,
    8 heads of 16, 2 groups: conv channels 192, n_embd_r 576, n_embd_s 2048 per layer."""
    arch = "mamba2"
    supports_rollback = True
    causal = True

    def __init__(self, n_vocab=64, n_embd=64, n_layer=2, d_conv=4, d_inner=128, d_state=16,
                 n_head=8, n_group=2, eps=1e-5, devices=None, seed=0, layer_outputs=False):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding and output head live on the last device of the list (the host).
        layer_outputs: also return each layer's residual output as 'l_out.{il}' (tests)."""
        if d_inner % n_head or n_head % n_group or d_inner % n_group:
            raise ValueError("mamba2: d_inner must divide into n_head heads and n_head into n_group groups")
        self.n_vocab, self.n_embd, self.n_layer = n_vocab, n_embd, n_layer
        self.d_conv, self.d_inner, self.d_state = d_conv, d_inner, d_state
        self.n_head, self.n_group, self.head_dim = n_head, n_group, d_inner // n_head
        self.conv_channels = d_inner + 2 * n_group * d_state
        self.d_in_proj = 2 * d_inner + 2 * n_group * d_state + n_head
        self.eps = eps
        self.layer_outputs = layer_outputs
        if devices is None:
            devices = [mg.backend("cpu")] * n_layer
        elif isinstance(devices, mg.Backend):
            devices = [devices] * n_layer
        if len(devices) != n_layer:
            raise ValueError(f"mamba2: {len(devices)} devices for {n_layer} layers")
        self.layer_devices = list(devices)
        self.host = self.layer_devices[-1]
        self.layers = list(range(n_layer))
        self.hparams = dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, d_conv=d_conv, d_inner=d_inner,
                            d_state=d_state, n_head=n_head, n_group=n_group, eps=float(eps))
        self._values: dict[str, np.ndarray] = {}    # gguf name -> initial values (NumPy order)
        self._named: dict[str, mg.Tensor] = {}      # gguf name -> tensor
        rng = np.random.default_rng(seed)
        E, V = n_embd, n_vocab

        host_ctx = mg.Context()
        self.tok_embd = self._w(host_ctx, "token_embd.weight", (E, V), rng, 1.0)
        self.out_norm = self._w(host_ctx, "output_norm.weight", (E,), rng, 0.1, 1.0)
        self.output = self._w(host_ctx, "output.weight", (E, V), rng, 1 / np.sqrt(E))
        mg.alloc_ctx_tensors(host_ctx, self.host)

        self.layer_w = []
        for il in self.layers:
            c = mg.Context()
            p = f"blk.{il}."
            ssm_in = self._init(rng, (E, self.d_in_proj), 1 / np.sqrt(E))
            ssm_in[-n_head:] *= 0.25                                  # dt rows: dt stays near its bias
            # dt bias = softplus^-1(dt0), dt0 log-uniform in [0.02, 0.2] (Mamba-2 inits [1e-3, 0.1]);
            # not smaller: ggml's f32 softplus log(1 + exp(x)) loses ~6e-8 absolute, i.e. 1e-5
            # relative at dt ~ 6e-3, and dt scales the state update linearly
            dt0 = np.exp(rng.uniform(np.log(0.02), np.log(0.2), n_head))
            lw = {
                "attn_norm": self._w(c, p + "attn_norm.weight", (E,), rng, 0.1, 1.0),
                "ssm_in": self._w(c, p + "ssm_in.weight", (E, self.d_in_proj), arr=ssm_in),
                "ssm_conv1d": self._w(c, p + "ssm_conv1d.weight", (d_conv, self.conv_channels), rng, 1 / np.sqrt(d_conv)),
                "ssm_conv1d_b": self._w(c, p + "ssm_conv1d.bias", (self.conv_channels,), rng, 0.1),
                "ssm_dt_b": self._w(c, p + "ssm_dt.bias", (n_head,), arr=dt0 + np.log(-np.expm1(-dt0))),
                # A = -exp(A_log), A_log uniform in [0, log 16]: stored already negative
                "ssm_a": self._w(c, p + "ssm_a", (1, n_head), arr=-np.exp(rng.uniform(0, np.log(16), (n_head, 1)))),
                "ssm_d": self._w(c, p + "ssm_d", (1, n_head), rng, 0.1, 1.0),
                "ssm_norm": self._w(c, p + "ssm_norm.weight", (d_inner // n_group, n_group), rng, 0.1, 1.0),
                "ssm_out": self._w(c, p + "ssm_out.weight", (d_inner, E), rng, 1 / np.sqrt(d_inner)),
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

    # memory sizes: conv history of d_conv-1 columns per conv channel; SSM state d_state x d_inner
    def n_embd_r(self, il):
        return (self.d_conv - 1) * self.conv_channels

    def n_embd_s(self, il):
        return self.d_state * self.d_inner

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
            cur = build_mamba2_layer(g, inp_rs, cur, il, w, self)            # [n_embd, n_tokens]
            inpL = mg.add(cur, inpL)                                         # residual
            if self.layer_outputs:
                out[f"l_out.{il}"] = inpL.set_name(f"l_out.{il}").set_output()
                g.gf.build_forward_expand(inpL)
        cur = mg.mul(mg.rms_norm(inpL, self.eps), self.out_norm)             # [n_embd, n_tokens]
        logits = mg.mul_mat(self.output, cur).set_name("logits").set_output()   # [n_vocab, n_tokens]
        g.gf.build_forward_expand(logits)
        out["logits"] = logits
        return out
