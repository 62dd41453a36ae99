"""One Mamba-2 layer and one gated delta-net layer, built by the models' own layer functions
(`build_mamba2_layer`, `build_delta_net_layer`) on leaves with random data, computed by real ggml
(libggml-python, through minigraph.testing.ggml_oracle) and by minigraph's `cpu` and `ref` backends.

The graph covers the whole mixer: projections, the conv-state read (build_rs, with a tail cell
and optionally the zero row), concat, the conv-state store (one set_rows of overlapping
windows, or the plain copy when n_rs_seq = 0), ssm_conv, ssm_scan reading the cache rows directly
/ gated_delta_net, the K state snapshots stored into the s cache, the gated norm and the output
projection. Compared: the layer output and both caches (every row; rows the graph must not write
bit for bit). The layer graph itself is built by models.standalone.layer_built."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import nmse, run_built
from minigraph.models.standalone import HEAD, LeafMemory, layer_built  # noqa: F401  (LeafMemory: moved there)

if importlib.util.find_spec("libggml") is None:
    pytest.skip("real ggml is not installed: pip install libggml-python==0.20.2.post1 "
                "(the 'test' extra) to run the oracle tests", allow_module_level=True)

from minigraph.testing.ggml_oracle import run_in_ggml  # noqa: E402

pytestmark = pytest.mark.oracle


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
