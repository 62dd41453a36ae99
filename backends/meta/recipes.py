"""Split-by-heads callbacks for the models of this repository (llama.cpp's
llama_meta_device_get_split_state in small): weights and caches are split so that every op of a
layer has a valid split state and each mixer / FFN ends in one all-reduce (its output
projection), the residual stream staying MIRRORED.

* toy-conv with out_proj (models/toy_tp.py): in_proj and conv by channel (axis 1), norm and
  out_proj on axis 0, cache_r_l by channel (axis 0, n_cols = d_conv-1 elements per channel).
* qwen35 (models/delta_net.py), as llama.cpp splits Qwen 3.5: the fused q|k|v rows are one
  segment of key_dim repeated 2 + Hv/Hk times (v is segmented on the scale of k, so v head h
  stays on the device of its k head h % Hk), each repeat split in whole k heads; attn_gate,
  ssm_out, ssm_dt/ssm_a/ssm_alpha/ssm_beta and the s cache repeat Hv/Hk times; the FFN is split
  Megatron-style; the output head is split by vocabulary (axis 1: logits split, gathered on read).
* Everything else (embeddings, norms) is MIRRORED.

Mamba-2, LFM2 and KDA have no recipe (all MIRRORED): ggml's SSM_SCAN rule is scalar-only and
Mamba-2's conv bias add meets a split conv output; llama.cpp runs the LFM2 short-conv block
mirrored; KDA's three-part r rows cannot be split (the permuted-view rule finds no dim)."""
from __future__ import annotations

import re

from minigraph.backends.meta.split_state import SplitState, even_shares


def _split(axis: int, seg: int, n_dev: int, granule: int = 1, nr: int = 1) -> SplitState:
    """axis split in nr repeats of a segment of seg elements, each cut in whole granules."""
    return SplitState(axis, (even_shares(seg, n_dev, granule),), (nr,))


def _toy(model):
    if not all("out_proj" in lw for lw in model.layer_w):
        return None          # without an output projection the residual add cannot take a split
    n_cols = model.d_conv - 1

    def cb(t, n_dev):
        name = t.name or ""
        if name.startswith("cache_r_l"):       # [n_cols*n_embd, rows]: split by channel
            return _split(0, t.ne[0], n_dev, n_cols)
        if name.startswith("blk."):
            axis = {"in_proj": 1, "conv": 1, "norm": 0, "out_proj": 0}.get(name.split(".", 2)[2])
            if axis is not None:
                return _split(axis, t.ne[axis], n_dev)
        return None
    return cb


def _qwen35(model):
    hd, Hk, Hv = model.head_k_dim, model.num_k_heads, model.num_v_heads
    r = Hv // Hk
    key_dim, n_cols = model.key_dim, model.d_conv - 1
    rules = [
        (r"blk\.\d+\.(attn_qkv|ssm_conv1d)\.weight", lambda t, n: _split(1, key_dim, n, hd, 2 + r)),
        (r"blk\.\d+\.attn_gate\.weight", lambda t, n: _split(1, key_dim, n, hd, r)),
        (r"blk\.\d+\.ssm_out\.weight", lambda t, n: _split(0, key_dim, n, hd, r)),
        (r"blk\.\d+\.(ssm_dt\.bias|ssm_a)", lambda t, n: _split(0, Hk, n, 1, r)),
        (r"blk\.\d+\.(ssm_alpha|ssm_beta)\.weight", lambda t, n: _split(1, Hk, n, 1, r)),
        (r"cache_r_l\d+", lambda t, n: _split(0, key_dim * n_cols, n, hd * n_cols, 2 + r)),
        (r"cache_s_l\d+", lambda t, n: _split(0, Hk * hd * hd, n, hd * hd, r)),
        (r"blk\.\d+\.ffn_(gate|up)\.weight", lambda t, n: _split(1, t.ne[1], n)),
        (r"blk\.\d+\.ffn_down\.weight", lambda t, n: _split(0, t.ne[0], n)),
        (r"output\.weight", lambda t, n: _split(1, t.ne[1], n)),
    ]
    compiled = [(re.compile(p), f) for p, f in rules]

    def cb(t, n_dev):
        for rx, f in compiled:
            if rx.fullmatch(t.name or ""):
                return f(t, n_dev)
        return None
    return cb


def recipe_for(model):
    arch = getattr(model, "arch", "")
    if arch.startswith("toy-conv"):
        return _toy(model)
    if arch == "qwen35":
        return _qwen35(model)
    return None
