"""LFM2 with short-conv layers (llama.cpp arch "lfm2", REFERENCE §6.2 and §11).

Per block: attn_norm (RMS) -> short conv -> residual add, ffn_norm (RMS) -> SwiGLU FFN -> residual
add; after the last block the final norm (`token_embd_norm`, llama.cpp's output_norm for lfm2) and
the output head. Every block here is a short-conv block (llama.cpp marks them with head_count_kv 0).

Short conv (build_shortconv_layer): bcx = in_proj x -> b, c, x (rows B | C | x); the product b*x
is the conv input; its history of L-1 columns lives in the layer's r cache and is written only by
GraphContext.build_conv_state_store (n_cols = L-1); conv_out = ssm_conv(history ++ b*x, conv);
y = out_proj(c * conv_out). No s state.

The helpers at the bottom (weight creation on a device, RMS norm, SwiGLU FFN, device lists) are
shared with models/kda.py.
"""
from __future__ import annotations

import numpy as np

import minigraph as mg


# ---------------------------------------------------------------------------------------------
# shared helpers (models/kda.py uses them too)

def layer_device_list(devices, n_layer: int) -> list:
    """None -> cpu for every layer; one backend -> that backend everywhere; a list -> one per layer."""
    if devices is None:
        return [mg.backend("cpu")] * n_layer
    if isinstance(devices, mg.Backend):
        return [devices] * n_layer
    devices = list(devices)
    if len(devices) != n_layer:
        raise ValueError(f"devices: need one backend per layer ({n_layer}), got {len(devices)}")
    return devices


class WeightMaker:
    """Creates f32 weights in one context with seeded random values; `place(dev)` allocates the
    context on the device and writes the values there (weights are created on their device)."""

    def __init__(self, rng: np.random.Generator, named: dict):
        self.rng = rng
        self.ctx = mg.Context()
        self.values = []
        self.named = named           # gguf name -> tensor, filled as weights are made

    def __call__(self, name: str, ne, scale: float, mean: float = 0.0) -> mg.Tensor:
        t = self.ctx.new_tensor(mg.f32, tuple(ne)).set_name(name)
        t.set_weight()
        arr = (mean + scale * self.rng.standard_normal(tuple(reversed(t.ne)))).astype(np.float32)
        self.values.append((t, arr))
        self.named[name] = t
        return t

    def fixed(self, name: str, ne, arr) -> mg.Tensor:
        t = self.ctx.new_tensor(mg.f32, tuple(ne)).set_name(name)
        t.set_weight()
        self.values.append((t, np.asarray(arr, np.float32).reshape(tuple(reversed(t.ne)))))
        self.named[name] = t
        return t

    def place(self, dev) -> None:
        mg.alloc_ctx_tensors(self.ctx, dev)
        for t, arr in self.values:
            t.set(arr)


def build_norm(x: mg.Tensor, w: mg.Tensor, eps: float) -> mg.Tensor:
    """RMS norm over dim 0 times the weight (llama.cpp's build_norm with LLM_NORM_RMS)."""
    return mg.mul(mg.rms_norm(x, eps), w)


def build_ffn(x: mg.Tensor, w: dict) -> mg.Tensor:
    """SwiGLU: down(silu(gate x) * up x).  x [n_embd, n_tokens] -> [n_embd, n_tokens]."""
    gate = mg.silu(mg.mul_mat(w["ffn_gate"], x))             # [n_ff, n_tokens]
    up = mg.mul_mat(w["ffn_up"], x)                          # [n_ff, n_tokens]
    return mg.mul_mat(w["ffn_down"], mg.mul(gate, up))       # [n_embd, n_tokens]


def make_ffn(mk: WeightMaker, il: int, n_embd: int, n_ff: int) -> dict:
    return {
        "ffn_norm": mk(f"blk.{il}.ffn_norm.weight", (n_embd,), 0.1, 1.0),
        "ffn_gate": mk(f"blk.{il}.ffn_gate.weight", (n_embd, n_ff), 1 / np.sqrt(n_embd)),
        "ffn_up": mk(f"blk.{il}.ffn_up.weight", (n_embd, n_ff), 1 / np.sqrt(n_embd)),
        "ffn_down": mk(f"blk.{il}.ffn_down.weight", (n_ff, n_embd), 1 / np.sqrt(n_ff)),
    }


# ---------------------------------------------------------------------------------------------
# the short-conv layer

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


class LFM2Model:
    """A tiny LFM2 (short-conv blocks only) with seeded random weights.

    Defaults: d_model 64, 2 blocks, vocab 64, kernel L = 3 (2 history columns), FFN 128:
    n_embd_r = 128 per layer, no s state. `hparams` holds the constructor's structural arguments
    (what models.gguf_io writes and reads back); `gguf_tensors()` the weights by GGUF name."""

    arch = "lfm2"
    supports_rollback = True
    causal = True

    def __init__(self, n_vocab=64, n_embd=64, n_layer=2, l_cache=3, n_ff=128, n_head=4, eps=1e-5,
                 n_ctx_train=4096, devices=None, seed=0, layer_outputs=False):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding, final norm and output head live on the last device (the host).
        layer_outputs: also return each block's mixer output 'mixer.{il}' and block output
        'l_out.{il}' ([n_embd, n_tokens]; tests)."""
        if l_cache < 2:
            raise ValueError(f"lfm2: shortconv.l_cache must be > 1, got {l_cache}")
        self.hparams = dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, l_cache=l_cache,
                            n_ff=n_ff, n_head=n_head, eps=float(eps), n_ctx_train=n_ctx_train)
        self.n_vocab, self.n_embd, self.n_layer, self.l_cache = n_vocab, n_embd, n_layer, l_cache
        self.n_ff, self.eps = n_ff, float(eps)
        self.layer_devices = layer_device_list(devices, n_layer)
        self.host = self.layer_devices[-1]
        self.layers = list(range(n_layer))
        self.layer_outputs = layer_outputs
        self._named: dict[str, mg.Tensor] = {}
        rng = np.random.default_rng(seed)

        mk = WeightMaker(rng, self._named)
        self.tok_embd = mk("token_embd.weight", (n_embd, n_vocab), 1.0)
        self.out_norm = mk("token_embd_norm.weight", (n_embd,), 0.1, 1.0)
        self.output = mk("output.weight", (n_embd, n_vocab), 1 / np.sqrt(n_embd))
        mk.place(self.host)
        self.layer_w = []
        for il in self.layers:
            mk = WeightMaker(rng, self._named)
            lw = {
                "attn_norm": mk(f"blk.{il}.attn_norm.weight", (n_embd,), 0.1, 1.0),
                "in_proj": mk(f"blk.{il}.shortconv.in_proj.weight", (n_embd, 3 * n_embd), 1 / np.sqrt(n_embd)),
                "conv": mk(f"blk.{il}.shortconv.conv.weight", (l_cache, n_embd), 1 / np.sqrt(l_cache)),
                "out_proj": mk(f"blk.{il}.shortconv.out_proj.weight", (n_embd, n_embd), 1 / np.sqrt(n_embd)),
            }
            lw.update(make_ffn(mk, il, n_embd, n_ff))
            mk.place(self.layer_devices[il])
            self.layer_w.append(lw)

    # memory sizes (REFERENCE §2.1): L-1 history columns per channel, no s state
    def n_embd_r(self, il):
        return (self.l_cache - 1) * self.n_embd

    def n_embd_s(self, il):
        return 0

    def gguf_tensors(self) -> dict:
        """{GGUF tensor name: tensor}; each tensor's ne (trailing 1s dropped) is llama.cpp's shape."""
        return dict(self._named)

    def build(self, g) -> dict:
        """g: models.graph.GraphContext. Returns {'logits': [n_vocab, n_tokens]} (and, with
        layer_outputs, 'mixer.{il}' and 'l_out.{il}': [n_embd, n_tokens] per block)."""
        outs = {}
        tokens = g.build_inp_tokens()
        inp_rs = g.build_inp_rs()
        h = mg.get_rows(self.tok_embd, tokens)                            # [n_embd, n_tokens]
        for il in self.layers:
            w = self.layer_w[il]
            cur = build_norm(h, w["attn_norm"], self.eps)                 # [n_embd, n_tokens]
            cur = build_shortconv_layer(g, inp_rs, g.mctx.r_l[il], w, cur, self.n_embd, self.l_cache)
            if self.layer_outputs:
                outs[f"mixer.{il}"] = cur.set_name(f"mixer.{il}").set_output()
            h = mg.add(h, cur)                                            # [n_embd, n_tokens]
            cur = build_ffn(build_norm(h, w["ffn_norm"], self.eps), w)    # [n_embd, n_tokens]
            h = mg.add(h, cur)
            if self.layer_outputs:
                outs[f"l_out.{il}"] = h.set_name(f"l_out.{il}").set_output()
        h = build_norm(h, self.out_norm, self.eps)                        # [n_embd, n_tokens]
        logits = mg.mul_mat(self.output, h).set_name("logits").set_output()   # [n_vocab, n_tokens]
        g.gf.build_forward_expand(logits)
        for t in outs.values():
            g.gf.build_forward_expand(t)
        outs["logits"] = logits
        return outs


LfmModel = LFM2Model
