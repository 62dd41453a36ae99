"""The smallest model a meta device can split: the toy conv model (models/toy.py) with an output
projection per layer. Without it the layer output (split by channel) meets the MIRRORED residual
stream in an ADD, which ggml's rules refuse; with it the layer ends in a mul_mat of two axis-0
splits, i.e. a PARTIAL result and one all-reduce per layer (the Megatron pattern)."""
from __future__ import annotations

import numpy as np

import minigraph as mg
from minigraph.models.base import build_output_head
from minigraph.models.toy import ToyConvModel


class ToyConvTPModel(ToyConvModel):
    arch = "toy-conv-tp"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        rng = np.random.default_rng(1000 + kw.get("seed", 0))
        for il in self.layers:
            c = mg.Context()
            t = c.new_tensor_2d(mg.f32, self.n_embd, self.n_embd).set_name(f"blk.{il}.out_proj")
            mg.alloc_ctx_tensors(c, self.layer_devices[il])
            t.set((rng.standard_normal((self.n_embd, self.n_embd)) / np.sqrt(self.n_embd)).astype(np.float32))
            self.layer_w[il]["out_proj"] = t

    def build(self, g) -> dict:
        T, S = g.n_seq_tokens, g.n_seqs
        tokens = g.build_inp_tokens()
        inp_rs = g.build_inp_rs()
        h = mg.get_rows(self.tok_embd, tokens)
        for il in self.layers:
            w = self.layer_w[il]
            r = g.mctx.r_l[il]
            x = mg.mul_mat(w["in_proj"], mg.rms_norm(h, 1e-5))
            x = mg.reshape_3d(x, self.n_embd, T, S)
            conv = g.build_rs(inp_rs, r, self.n_embd_r(il), S)
            conv = mg.reshape_3d(conv, self.d_conv - 1, self.n_embd, S)
            conv_x = mg.concat(conv, mg.transpose(x), 0)
            g.build_conv_state_store(inp_rs, r, conv_x, self.d_conv - 1)
            y = mg.silu(mg.ssm_conv(conv_x, w["conv"]))
            y = mg.reshape_2d(mg.mul(y, w["norm"]), self.n_embd, T * S)
            h = mg.add(h, mg.mul_mat(w["out_proj"], y))
        logits = build_output_head(g, h, self.out_norm, self.output, 1e-5)
        g.gf.build_forward_expand(logits)
        return {"logits": logits}
