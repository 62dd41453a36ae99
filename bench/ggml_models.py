"""Whole models on real ggml: tokens per second of each tiny model on minigraph's `cpu`, on
`ggml:cpu` (the ggml backend: llama.cpp's ggml 0.25) and spread over two `minigraph rpc-server`
processes on loopback ports (`ggml:rpc://...,ggml:rpc://...,cpu`), in this process's own
interpreter: llama.cpp's ggml must not share a process with the op oracle's libggml-python, which
bench/models.py loads (it runs this script as a subprocess).

    python bench/ggml_models.py [--quick] [--threads N] [--no-rpc]

Prefill: 2 sequences x 32 tokens per step (one ubatch of 64); decode: 1 token per sequence per
step; Runner with n_rs_seq 3, graph reuse on, atomic=False (as bench/models.py); median of
repetitions. The RPC rows pay one TCP round trip per tensor transfer and per split compute on
loopback, and the servers' threads share this machine's cores."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]   # bench/models.py
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))                 # rpc_servers.py

import numpy as np                                    # noqa: E402

import minigraph as mg                                # noqa: E402
from minigraph.models.runner import Runner            # noqa: E402
from minigraph.models.zoo import make_model, parse_devices, recurrent_only   # noqa: E402

MODELS = ("mamba2", "delta-net", "lfm", "kda")
N_LAYER, N_SEQS = 4, 2    # recurrent blocks only (zoo.recurrent_only), as bench/models.py times them


def bench(name, spec, reps, steps, n_threads):
    devices = parse_devices(spec)
    for d in devices:
        if hasattr(d, "set_n_threads") and not d.name.startswith("ggml:rpc"):
            d.set_n_threads(n_threads)
    model = make_model(name, devices, n_layer=N_LAYER, **recurrent_only(name, N_LAYER))
    runner = Runner(model, mem_size=4, n_rs_seq=3, n_ubatch=64, atomic=False)
    tok = np.random.default_rng(1).integers(0, model.n_vocab, 1 << 16)
    pos = [0]

    def step(n):
        p = pos[0]
        pos[0] = p + N_SEQS * n
        runner.decode_seq_tokens({q: tok[(p + q * n + np.arange(n)) % tok.size].tolist() for q in range(N_SEQS)})

    out = {}
    for phase, n in (("prefill", 32), ("decode", 1)):
        step(n)
        step(n)                                       # warm: a build, then a reused step
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(steps[phase]):
                step(n)
            times.append((time.perf_counter() - t0) / steps[phase])
        out[phase] = N_SEQS * n / statistics.median(times)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--threads", type=int, default=1, help="threads of cpu and ggml:cpu (default 1)")
    ap.add_argument("--no-rpc", action="store_true", help="skip the two loopback RPC servers")
    args = ap.parse_args(argv)
    try:
        mg.backend("ggml:cpu")
    except Exception as e:
        print(f"ggml backend not available ({e}); no ggml rows")
        return 0
    reps = 3 if args.quick else 5
    steps = {"prefill": 2 if args.quick else 4, "decode": 4 if args.quick else 16}
    print(f"## whole models on ggml (load before: {open('/proc/loadavg').read().split()[:3]}), "
          f"{N_LAYER} layers, {args.threads} thread(s); tokens/s")
    from rpc_servers import servers
    n_servers = 0 if args.no_rpc else 2
    with servers(n_servers) as rpc:
        specs = {"cpu": "cpu", "ggml:cpu": "ggml:cpu"}
        if rpc:
            specs["2 rpc + cpu"] = ",".join(s.device for s in rpc) + ",cpu"
        print(f"{'model':10s} {'phase':8s} " + " ".join(f"{k:>12s}" for k in specs) + "   ggml:cpu/cpu")
        for name in MODELS:
            rows = {k: bench(name, spec, reps, steps, args.threads) for k, spec in specs.items()}
            for phase in ("prefill", "decode"):
                cells = " ".join(f"{rows[k][phase]:12.0f}" for k in specs)
                print(f"{name:10s} {phase:8s} {cells}   {rows['ggml:cpu'][phase] / rows['cpu'][phase]:.2f}", flush=True)
    print(f"load after: {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
