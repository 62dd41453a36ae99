"""Host time per decode step with graph reuse vs rebuild, for a 24-conv-layer model on the CPU.

    python bench/reuse.py [--layers 24] [--steps 40] [--n-rs-seq 3] [--threads N] [--write]

Host time of a step = the whole step minus the time the same graph takes to execute again
(kernels only): graph build, scheduling, memory planning and the CPU plan on a rebuild; the reuse
check and input setting on a reuse. Last line: `host time per step, rebuild/reuse: R`."""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402  (bench/results.py)

import minigraph as mg  # noqa: E402
from minigraph.models.runner import Runner  # noqa: E402
from minigraph.models.toy import ToyConvModel  # noqa: E402


def measure(reuse: bool, args) -> tuple[float, float, float]:
    be = mg.backend("cpu")
    if args.threads and hasattr(be, "set_n_threads"):
        be.set_n_threads(args.threads)
    model = ToyConvModel(n_vocab=64, n_embd=args.n_embd, n_layer=args.layers, d_conv=4, devices=be)
    r = Runner(model, mem_size=2, n_rs_seq=args.n_rs_seq, reuse=reuse, atomic=False)
    r.decode_seq_tokens({0: [1, 2, 3, 4]})
    step, execute = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        r.decode_seq_tokens({0: [i % 64]})
        t1 = time.perf_counter()
        r.prev.sched.graph_compute(r.prev.gf)     # the same graph again: kernels + copies only
        t2 = time.perf_counter()
        step.append(t1 - t0)
        execute.append(t2 - t1)
    s, e = statistics.median(step), statistics.median(execute)
    return s, e, max(s - e, 1e-9)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--n-rs-seq", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--write", action="store_true", help="(re)write this script's section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 15
    return results.run_and_write("bench/reuse.py", argv, "Graph reuse: host time per decode step (bench/reuse.py)",
                                 lambda: run(args), args.write)


def run(args):
    print(f"# {args.layers} conv layers, n_embd {args.n_embd}, n_rs_seq {args.n_rs_seq}, decode 1 token/step, "
          f"{args.steps} steps, {platform.machine()} {os.cpu_count()} cores")
    rows = {}
    for reuse in (False, True, False, True):          # alternate, keep the last of each
        rows[reuse] = measure(reuse, args)
    print(f"{'mode':10s} {'step ms':>9s} {'execute ms':>11s} {'host ms':>9s} {'host share':>10s}")
    for reuse in (False, True):
        s, e, h = rows[reuse]
        print(f"{'reuse' if reuse else 'rebuild':10s} {s * 1e3:9.3f} {e * 1e3:11.3f} {h * 1e3:9.3f} {h / s:10.1%}")
    ratio = rows[False][2] / rows[True][2]
    print(f"reuse saves {1 - rows[True][0] / rows[False][0]:.1%} of the step time")
    print(f"host time per step, rebuild/reuse: {ratio:.1f}")


if __name__ == "__main__":
    main()
