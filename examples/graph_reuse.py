"""A decode loop with graph reuse: how often the graph is rebuilt, what a reused step costs on
the host, and the validator that recomputes every reused step from a fresh build.

    python examples/graph_reuse.py [--model toy] [--steps 30]"""
from __future__ import annotations

import argparse
import time

import numpy as np

import minigraph as mg
from minigraph.models.runner import Runner
from minigraph.models.zoo import make_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="toy")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    model = make_model(args.model, [mg.backend(args.device)])
    rng = np.random.default_rng(0)
    # two sequences decoding together; every 10th step one of them drafts 2 tokens (a new shape)
    stream = [{0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}]
    for i in range(args.steps):
        n = 2 if i % 10 == 9 else 1
        stream.append({0: [int(t) for t in rng.integers(0, model.n_vocab, n)],
                       1: [int(t) for t in rng.integers(0, model.n_vocab, n)]})
    for reuse, validate in ((True, False), (False, False), (True, True)):
        r = Runner(model, mem_size=2, n_rs_seq=2, reuse=reuse, validate=validate)
        t0 = time.perf_counter()
        for step in stream:
            r.decode_seq_tokens(step)
        dt = (time.perf_counter() - t0) / len(stream)
        st = r.stats
        per_build = st.host_s_build / max(st.builds, 1) * 1e3
        per_reuse = st.host_s_reuse / max(st.reuses, 1) * 1e3
        mode = "validated" if validate else ("reuse on" if reuse else "reuse off")
        print(f"{mode:10s}: {st.builds:3d} builds, {st.reuses:3d} reuses, {dt * 1e3:7.2f} ms/step; "
              f"build+schedule+plan {per_build:.2f} ms, reuse check {per_reuse:.3f} ms"
              + (f"; {st.validated} reused steps matched a fresh build bit for bit" if validate else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
