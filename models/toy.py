"""A tiny short-conv model: embedding, N conv layers (each on its own device), output head.

It is the smallest model that exercises the recurrent memory, the conv-state store and every
slot-order strategy; the runner's tests and bench/reuse.py use it before the real model files."""
from __future__ import annotations

import numpy as np

import minigraph as mg


class ToyConvModel:
    arch = "toy-conv"
    supports_rollback = True
    causal = True

    def __init__(self, n_vocab=32, n_embd=16, n_layer=2, d_conv=4, devices=None, seed=0):
        """devices: None (everything on cpu), one backend, or a list with one backend per layer;
        the embedding and output head live on the last device of the list (the host)."""
        self.n_vocab, self.n_embd, self.n_layer, self.d_conv = n_vocab, n_embd, n_layer, d_conv
        if devices is None:
            devices = [mg.backend("cpu")] * n_layer
        elif isinstance(devices, mg.Backend):
            devices = [devices] * n_layer
        self.layer_devices = list(devices)
        self.host = self.layer_devices[-1] if len(set(map(id, devices))) == 1 else devices[-1]
        rng = np.random.default_rng(seed)
        self.layers = list(range(n_layer))
        self.weights = {}
        host_ctx = mg.Context()
        self.tok_embd = self._w(host_ctx, "token_embd", (n_embd, n_vocab), rng, 1.0)
        self.out_norm = self._w(host_ctx, "output_norm", (n_embd,), rng, 0.1, 1.0)
        self.output = self._w(host_ctx, "output", (n_embd, n_vocab), rng, 1 / np.sqrt(n_embd))
        mg.alloc_ctx_tensors(host_ctx, self.host)
        self.layer_w = []
        for il in self.layers:
            c = mg.Context()
            lw = {
                "in_proj": self._w(c, f"blk.{il}.in_proj", (n_embd, n_embd), rng, 1 / np.sqrt(n_embd)),
                "conv": self._w(c, f"blk.{il}.conv", (d_conv, n_embd), rng, 0.5),
                "norm": self._w(c, f"blk.{il}.norm", (n_embd,), rng, 0.1, 1.0),
            }
            mg.alloc_ctx_tensors(c, self.layer_devices[il])
            self.layer_w.append(lw)
        for t, arr in self.weights.items():
            t.set(arr)

    def _w(self, ctx, name, ne, rng, scale, mean=0.0):
        t = ctx.new_tensor(mg.f32, ne).set_name(name)
        self.weights[t] = (mean + scale * rng.standard_normal(tuple(reversed(t.ne)))).astype(np.float32)
        return t

    # memory sizes (REFERENCE §2.1: conv history of d_conv-1 columns per channel, no s state)
    def n_embd_r(self, il):
        return (self.d_conv - 1) * self.n_embd

    def n_embd_s(self, il):
        return 0

    def build(self, g) -> dict:
        """g: models.graph.GraphContext. Returns {'logits': [n_vocab, n_tokens]}."""
        T, S = g.n_seq_tokens, g.n_seqs
        tokens = g.build_inp_tokens()
        inp_rs = g.build_inp_rs()
        h = mg.get_rows(self.tok_embd, tokens)                      # [n_embd, n_tokens]
        for il in self.layers:
            w = self.layer_w[il]
            r = g.mctx.r_l[il]
            x = mg.mul_mat(w["in_proj"], mg.rms_norm(h, 1e-5))      # [n_embd, n_tokens]
            x = mg.reshape_3d(x, self.n_embd, T, S)                 # [n_embd, T, S]
            conv = g.build_rs(inp_rs, r, self.n_embd_r(il), S)      # [n_embd_r, S]
            conv = mg.reshape_3d(conv, self.d_conv - 1, self.n_embd, S)
            conv_x = mg.concat(conv, mg.transpose(x), 0)            # [d_conv-1+T, n_embd, S]
            g.build_conv_state_store(inp_rs, r, conv_x, self.d_conv - 1)
            y = mg.silu(mg.ssm_conv(conv_x, w["conv"]))             # [n_embd, T, S]
            h = mg.add(h, mg.reshape_2d(mg.mul(y, w["norm"]), self.n_embd, T * S))
        h = mg.mul(mg.rms_norm(h, 1e-5), self.out_norm)
        logits = mg.mul_mat(self.output, h).set_name("logits").set_output()   # [n_vocab, n_tokens]
        g.gf.build_forward_expand(logits)
        return {"logits": logits}
