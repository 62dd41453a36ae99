"""Worker for tests/test_ggml_meta.py (a process of its own: llama.cpp's ggml, and ggml's meta
device aborts on a split state it cannot derive). One graph runs on minigraph's meta backend over
cpu:0,cpu:1 and on ggml's meta device over two ggml CPU devices, with the same leaf split states;
prints one JSON line: every tensor's state on each side, the all-reduces and the outputs' error.

    python tests/ggml_meta_worker.py mlp|mamba2|delta-net

Before ggml runs, minigraph's side is printed as a first JSON line (so a ggml abort still leaves
minigraph's states to compare with)."""
from __future__ import annotations

import json
import sys

import numpy as np

import minigraph as mg
from minigraph.backends.meta import MetaBackend, recipe_for, split_by_name
from minigraph.backends.meta.split_state import axis_name
from minigraph.testing.op_cases import Built, run_built


def mlp():
    """y = w2 @ silu(w1 @ x): w1 split by output rows, w2 by input columns -> y is a partial sum."""
    rng = np.random.default_rng(1)
    b = Built(mg.Context())
    w1 = b.leaf(mg.f32, (8, 6), data=rng.standard_normal((6, 8))).set_name("w1")
    w2 = b.leaf(mg.f32, (6, 8), data=rng.standard_normal((8, 6))).set_name("w2")
    x = b.leaf(mg.f32, (8, 3), data=rng.standard_normal((3, 8))).set_name("x")
    b.out(mg.mul_mat(w2, mg.silu(mg.mul_mat(w1, x))).set_name("y"))
    return b, split_by_name({"w1": 1, "w2": 0})


def delta_net():
    from minigraph.models.delta_net import DeltaNetModel
    from minigraph.models.standalone import layer_built
    b, _ = layer_built("delta-net", 3, 4, -1, 0)
    return b, recipe_for(DeltaNetModel(devices=mg.backend("ref"), n_layer=1, seed=0))


def mamba2():
    """Mamba-2 has no split recipe (ggml's SSM_SCAN rule is scalar-only): all MIRRORED."""
    from minigraph.models.standalone import layer_built
    b, _ = layer_built("mamba2", 3, 4, -1, 0)
    return b, None


def main(kind: str) -> int:
    from minigraph.backends.ggml.meta_compare import run_built_on_meta
    b, callback = {"mlp": mlp, "delta-net": delta_net, "mamba2": mamba2}[kind]()
    meta = MetaBackend([mg.backend("cpu:0"), mg.backend("cpu:1")], callback)
    want = run_built(b, meta)
    gf = mg.Graph()
    for o in b.outs:
        gf.build_forward_expand(o)
    rep = meta.split_report(gf)
    mine = {t.id: axis_name(meta.states.entry(t).own.axis) for t in gf.leafs + gf.nodes}
    rules = {t.id: meta.states.entry(t).rule for t in gf.nodes}
    labels = {t.id: f"{t.op} {t.name or t.label}" for t in gf.leafs + gf.nodes}
    print(json.dumps({"side": "minigraph", "states": mine, "rules": rules, "labels": labels,
                      "all_reduces": len(rep["all_reduces"])}), flush=True)
    run = run_built_on_meta(b, gf, lambda t: meta.states.entry(t).own)
    errs = [float(np.max(np.abs(run.outs[o.id] - w)) / max(float(np.max(np.abs(w))), 1e-30))
            for o, w in zip(b.outs, want) if o.id in run.outs]
    print(json.dumps({"side": "ggml", "states": {i: sorted(a) for i, a in run.states.items()},
                      "all_reduces": len(run.partial), "outs_compared": len(errs),
                      "max_rel_err": max(errs) if errs else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
