"""One Mamba-2 layer and one gated delta-net layer, built by the models' own layer functions
(`build_mamba2_layer`, `build_delta_net_layer`) on leaves with random data, computed by real ggml
(libggml-python, through minigraph.ggml_oracle) and by minigraph's `cpu` and `ref` backends.

The graph covers the whole mixer: projections, the conv-state read (build_rs, with a tail cell
and optionally the zero row), concat, the conv-state store (seed 000's set_rows of overlapping
windows, or the plain copy when n_rs_seq = 0), ssm_conv, ssm_scan reading the cache rows directly
/ gated_delta_net, the K state snapshots stored into the s cache, the gated norm and the output
projection. Compared: the layer output and both caches (every row; rows the graph must not write
bit for bit)."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

import minigraph as mg
from minigraph.op_cases import Built, nmse, run_built
from minigraph.tensor import Context
from models.delta_net import DeltaNetModel, build_delta_net_layer
from models.graph import GraphContext, GraphParams, GraphResult
from models.mamba2 import Mamba2Model, build_mamba2_layer

if importlib.util.find_spec("libggml") is None:
    pytest.skip("real ggml is not installed: pip install libggml-python==0.20.2.post1 "
                "(the 'test' extra) to run the oracle tests", allow_module_level=True)

from minigraph.ggml_oracle import run_in_ggml  # noqa: E402

pytestmark = pytest.mark.oracle

MEM_SIZE, HEAD, N_SEQS = 4, 1, 2
N_RS = N_SEQS + 1                       # one tail cell after the ubatch's cells


class LeafMemory:
    """The parts of a recurrent memory context a layer graph reads, over leaf caches."""

    def __init__(self, il, r, s, rs_z):
        self.r_l, self.s_l, self.rs_z = {il: r}, {il: s}, rs_z

    def get_n_rs(self):
        return N_RS

    def get_head(self):
        return HEAD

    def get_rs_z(self):
        return self.rs_z

    def get_size(self):
        return MEM_SIZE


def layer_built(kind: str, n_rs_seq: int, T: int, rs_z: int, seed: int):
    """The layer graph on leaves. Returns (Built, info) with info the cache leaves' indices in
    outs and the rows the graph may write."""
    rng = np.random.default_rng(seed)
    K = n_rs_seq + 1
    if kind == "mamba2":
        m = Mamba2Model(devices=mg.backend("ref"), n_layer=1, seed=seed)
        build_layer = build_mamba2_layer
    else:
        m = DeltaNetModel(devices=mg.backend("ref"), n_layer=1, seed=seed)
        build_layer = build_delta_net_layer
    b = Built(Context())
    r = b.leaf(mg.f32, (m.n_embd_r(0), MEM_SIZE * K), data=rng.standard_normal((MEM_SIZE * K, m.n_embd_r(0))))
    s = b.leaf(mg.f32, (m.n_embd_s(0), MEM_SIZE * K),
               data=0.5 * rng.standard_normal((MEM_SIZE * K, m.n_embd_s(0))))
    r.set_name("cache_r_l0")
    s.set_name("cache_s_l0")
    w = {k: b.leaf(mg.f32, t.ne, data=t.numpy()).set_name(t.name) for k, t in m.layer_w[0].items()}
    cur = b.leaf(mg.f32, (m.n_embd, T * N_SEQS), data=rng.standard_normal((T * N_SEQS, m.n_embd)))

    mem = LeafMemory(0, r, s, rs_z)
    ub = SimpleNamespace(n_tokens=T * N_SEQS, n_seq_tokens=T, n_seqs=N_SEQS)
    params = GraphParams(m.arch, ub, mem, n_rs_seq, "per-layer", T * N_SEQS)
    g = GraphContext(params, GraphResult(params, mg.Graph()))
    g.ctx0 = b.ctx                                   # graph inputs become Built leaves
    inp_rs = g.build_inp_rs()
    # sources: seq 0 from the zero row when there is one, seq 1 from a rollback plane, the tail
    # cell from plane 0 of another cell
    src = [rs_z if rs_z >= 0 else 0 * MEM_SIZE + 3, (K - 1) * MEM_SIZE + 0, 2]
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
    written = sorted({j * MEM_SIZE + HEAD + q for j in range(min(T, K)) for q in range(N_SEQS)}
                     | {HEAD + N_SEQS} | ({rs_z} if rs_z >= 0 else set()))
    return b, {"written": written, "names": ["write"] * (len(b.outs) - 3) + ["out", "r", "s"]}


CASES = [(kind, n_rs_seq, T, rs_z) for kind in ("mamba2", "delta-net") for n_rs_seq in (0, 1, 3)
         for T in (1, 3, 5) for rs_z in (-1, HEAD) if rs_z == -1 or T == 3]


@pytest.mark.parametrize("kind,n_rs_seq,T,rs_z", CASES,
                         ids=[f"{k}-nrs{n}-T{t}-z{z}" for k, n, t, z in CASES])
def test_layer_matches_ggml(kind, n_rs_seq, T, rs_z):
    seed = 7 * n_rs_seq + T
    built, info = layer_built(kind, n_rs_seq, T, rs_z, seed)
    initial = {name: built.data[t].copy() for name, t in zip(("r", "s"), built.outs[-2:])}
    ggml = run_in_ggml(built, n_threads=2)
    for backend in ("ref", "cpu"):
        mine = run_built(layer_built(kind, n_rs_seq, T, rs_z, seed)[0], mg.backend(backend))
        for name, a, e in zip(info["names"], mine, ggml):
            if name == "write":
                continue                             # views of the caches, compared whole below
            assert a.shape == e.shape
            rel = float(np.max(np.abs(a - e)) / np.max(np.abs(e)))
            err = nmse(a, e)
            assert err <= 1e-10 and rel <= 1e-5, f"{kind} {backend} vs ggml: {name}: nmse {err:.3g}, rel {rel:.3g}"
        for name, a, e in zip(("r", "s"), mine[-2:], ggml[-2:]):
            a, e = a.reshape(e.shape[-2], -1), e.reshape(e.shape[-2], -1)
            keep = [i for i in range(a.shape[0]) if i not in info["written"]]
            assert np.array_equal(a[keep].view(np.uint32), initial[name].reshape(a.shape)[keep].view(np.uint32))
            assert np.array_equal(e[keep].view(np.uint32), initial[name].reshape(a.shape)[keep].view(np.uint32))
    # the rows the graph writes did change (the comparison above is not vacuous)
    for name, e in zip(("r", "s"), ggml[-2:]):
        e = e.reshape(e.shape[-2], -1)
        for row in info["written"]:
            assert not np.array_equal(e[row], initial[name].reshape(e.shape)[row])
