"""One recurrent layer's graph on its own: a Mamba-2 or gated delta-net mixer built by the
models' own layer functions (`build_mamba2_layer`, `build_delta_net_layer`) on leaves with random
data, outside any Runner or memory.

The result is an op_cases `Built`, so the same graph can be computed by minigraph's backends
(`run_built`) and by real ggml (`minigraph.testing.ggml_oracle.run_in_ggml`). Used by the layer-level
oracle test (tests/test_models_ggml.py) and the model benchmark (bench/models.py).

The graph covers the whole mixer: projections, the conv-state read (build_rs, with a tail cell
and optionally the zero row), concat, the conv-state store (one set_rows of overlapping
windows, or the plain copy when n_rs_seq = 0), ssm_conv, ssm_scan reading the cache rows directly
/ gated_delta_net, the K state snapshots stored into the s cache, the gated norm and the output
projection.

The caches are leaves of mem_size * K rows (K = n_rs_seq + 1 planes of mem_size cells); the
ubatch's n_seqs sequences occupy cells head .. head + n_seqs - 1 and one tail cell follows them.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import minigraph as mg
from minigraph.testing.op_cases import Built
from minigraph.tensor import Context

from .delta_net import DeltaNetModel, build_delta_net_layer
from .graph import GraphContext, GraphParams, GraphResult
from .mamba2 import Mamba2Model, build_mamba2_layer

# the defaults: 4 cells, the ubatch at cell 1, two sequences, then one tail cell (cell 3)
MEM_SIZE, HEAD, N_SEQS = 4, 1, 2

LAYER_KINDS = {
    "mamba2": (Mamba2Model, build_mamba2_layer),
    "delta-net": (DeltaNetModel, build_delta_net_layer),
}


class LeafMemory:
    """The parts of a recurrent memory context a layer graph reads, over leaf caches: layer il's
    r (conv) and s (state) caches, the zero row rs_z (-1: none), n_rs rows read (the ubatch's
    sequences plus the tail cells), the ubatch's first cell and the number of cells."""

    def __init__(self, il, r, s, rs_z, n_rs: int = N_SEQS + 1, head: int = HEAD, size: int = MEM_SIZE):
        self.r_l, self.s_l, self.rs_z = {il: r}, {il: s}, rs_z
        self.n_rs, self.head, self.size = n_rs, head, size

    def get_n_rs(self):
        return self.n_rs

    def get_head(self):
        return self.head

    def get_rs_z(self):
        return self.rs_z

    def get_size(self):
        return self.size


def layer_built(kind: str, n_rs_seq: int, T: int, rs_z: int, seed: int, n_seqs: int = N_SEQS,
                mem_size: int | None = None, model_kw: dict | None = None):
    """The layer graph of `kind` ('mamba2' or 'delta-net') on leaves, for a ubatch of n_seqs
    sequences of T tokens each with K = n_rs_seq + 1 state snapshots; rs_z is the zero row (-1:
    none). model_kw overrides the tiny model's sizes (e.g. d_inner=, n_embd=). mem_size defaults
    to the smallest that holds the ubatch and its tail cell, and at least MEM_SIZE.

    Returns (Built, info): Built.outs are every cache write (in the order the graph context
    expanded them), then the layer output, then the r and s caches; info["written"] lists the
    cache rows the graph may write and info["names"] names each out ('write', 'out', 'r', 's')."""
    if kind not in LAYER_KINDS:
        raise ValueError(f"unknown layer kind {kind!r}: choose one of {', '.join(LAYER_KINDS)}")
    head = HEAD
    if mem_size is None:
        mem_size = max(MEM_SIZE, head + n_seqs + 1)
    if mem_size < head + n_seqs + 1:
        raise ValueError(f"mem_size {mem_size} cannot hold {n_seqs} sequences at cell {head} and a tail cell")
    rng = np.random.default_rng(seed)
    K = n_rs_seq + 1
    model_cls, build_layer = LAYER_KINDS[kind]
    m = model_cls(devices=mg.backend("ref"), n_layer=1, seed=seed, **(model_kw or {}))
    b = Built(Context())
    r = b.leaf(mg.f32, (m.n_embd_r(0), mem_size * K), data=rng.standard_normal((mem_size * K, m.n_embd_r(0))))
    s = b.leaf(mg.f32, (m.n_embd_s(0), mem_size * K),
               data=0.5 * rng.standard_normal((mem_size * K, m.n_embd_s(0))))
    r.set_name("cache_r_l0")
    s.set_name("cache_s_l0")
    w = {k: b.leaf(mg.f32, t.ne, data=t.numpy()).set_name(t.name) for k, t in m.layer_w[0].items()}
    cur = b.leaf(mg.f32, (m.n_embd, T * n_seqs), data=rng.standard_normal((T * n_seqs, m.n_embd)))

    mem = LeafMemory(0, r, s, rs_z, n_rs=n_seqs + 1, head=head, size=mem_size)
    ub = SimpleNamespace(n_tokens=T * n_seqs, n_seq_tokens=T, n_seqs=n_seqs)
    params = GraphParams(m.arch, ub, mem, n_rs_seq, "per-layer", T * n_seqs)
    g = GraphContext(params, GraphResult(params, mg.Graph()))
    g.ctx0 = b.ctx                                   # graph inputs become Built leaves
    inp_rs = g.build_inp_rs()
    # sources: seq 0 from the zero row when there is one (else the last cell), seq q >= 1 from
    # the last rollback plane, the tail cell from plane 0 of another cell
    src = ([rs_z if rs_z >= 0 else mem_size - 1]
           + [(K - 1) * mem_size + (q - 1) % mem_size for q in range(1, n_seqs)] + [2 % mem_size])
    b.data[inp_rs.s_copy] = np.array(src, np.int32)
    out = build_layer(g, inp_rs, cur, 0, w, m)

    # every cache write, in the order the graph context expanded them (reads come first through
    # their dependencies), then the layer output, then the caches themselves
    used = {id(x) for n in g.gf.nodes for x in n.srcs.values()}
    for n in g.gf.nodes:
        if id(n) not in used:
            b.out(n)
    b.out(out)
    b.out(r)
    b.out(s)
    written = sorted({j * mem_size + head + q for j in range(min(T, K)) for q in range(n_seqs)}
                     | {head + n_seqs} | ({rs_z} if rs_z >= 0 else set()))
    return b, {"written": written, "names": ["write"] * (len(b.outs) - 3) + ["out", "r", "s"]}
