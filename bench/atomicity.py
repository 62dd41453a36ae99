"""What failure atomicity costs per decode step: no guarantee, the whole-cache copy, the row journal.

    python bench/atomicity.py                   # 24-layer mamba2, n_embd 768, mem_size 4 and 64
    python bench/atomicity.py --write           # also (re)write its section of bench/RESULTS.md
    python bench/atomicity.py --layers 4 --steps 4 --rounds 2     # a smoke run

A 24-layer Mamba-2 (n_embd 768, d_inner 1536, d_state 16, 24 heads of 64, 1 group, n_rs_seq 3:
K = 4 planes) on `cpu` decodes 4 sequences, one token each per step (one ubatch), through
`models.runner.Runner` with graph reuse, for every (mem_size, atomic mode):

- `off`   atomic=False: nothing copied, no guarantee;
- `full`  atomic="full": the whole r/s cache copied before each step (the old way);
- `rows`  atomic=True: cell metadata plus the rows the ubatch may write (models/step_journal.py).

The three runners of a mem_size alternate in rounds of `--steps` timed steps; the step time is the
median over all timed steps, on the wall clock (`step ms`, `tokens/s`) and in this process's CPU
time (`cpu ms`: user + system, all threads; steadier than the wall clock on a shared machine, and
it includes the page faults of fresh snapshot buffers); `vs off` compares cpu ms. `snapshot KiB/step` is what the journal copied per step (the
runner's `stats.snapshot_bytes`), `graph KiB/step` what the graphs' own copies held instead (their
gathers of the states, mamba2's side copies of its SSM rows: `stats.witnessed_bytes`); `cache MiB`
the size of the whole r/s cache. The last line is `full/rows saved bytes per step at mem_size M: R`
(rows: both columns together).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.dirname(HERE))
sys.path.append(HERE)
import results  # noqa: E402  (bench/results.py)

import numpy as np  # noqa: E402

import minigraph as mg  # noqa: E402
from minigraph.models.mamba2 import Mamba2Model  # noqa: E402
from minigraph.models.runner import Runner  # noqa: E402

MODES = {"off": False, "full": "full", "rows": True}
N_SEQS, N_RS_SEQ = 4, 3


def make_model(args, be):
    d_inner = 2 * args.n_embd
    return Mamba2Model(n_vocab=256, n_embd=args.n_embd, n_layer=args.layers, d_conv=4, d_inner=d_inner,
                       d_state=16, n_head=d_inner // 64, n_group=1, devices=be, seed=0)


def bench_mem_size(model, mem_size, args):
    """{mode: (median step s, median step cpu s, snapshot bytes per step, graph-held bytes per step,
    cache bytes)}."""
    rng = np.random.default_rng(0)
    runners = {}
    for mode, atomic in MODES.items():
        r = Runner(model, mem_size=mem_size, n_rs_seq=N_RS_SEQ, n_ubatch=64, atomic=atomic)
        r.decode_seq_tokens({s: [int(x) for x in rng.integers(0, model.n_vocab, 8)] for s in range(N_SEQS)})
        for _ in range(2):                               # warm up: the decode graph built, then reused
            r.decode_seq_tokens({s: [int(rng.integers(model.n_vocab))] for s in range(N_SEQS)})
        runners[mode] = r
    times = {mode: [] for mode in MODES}
    cpu = {mode: [] for mode in MODES}
    bytes0 = {mode: (r.stats.snapshot_bytes, r.stats.witnessed_bytes, r.stats.steps) for mode, r in runners.items()}
    for _ in range(args.rounds):
        for mode, r in runners.items():
            for _ in range(args.steps):
                step = {s: [int(rng.integers(model.n_vocab))] for s in range(N_SEQS)}
                t0, c0 = time.perf_counter(), time.process_time()
                r.decode_seq_tokens(step)
                times[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
    out = {}
    for mode, r in runners.items():
        b0, w0, n0 = bytes0[mode]
        b, w, n = r.stats.snapshot_bytes - b0, r.stats.witnessed_bytes - w0, max(r.stats.steps - n0, 1)
        cache = sum(t.nbytes() for t in r.memory.tensors())
        out[mode] = (statistics.median(times[mode]), statistics.median(cpu[mode]), b / n, w / n, cache)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--mem-sizes", default="4,64", help="cell counts, comma separated")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per runner per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="(re)write this script's section of bench/RESULTS.md")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    machine0 = results.machine_line()
    be = mg.backend("cpu")
    if hasattr(be, "set_n_threads"):
        be.set_n_threads(args.threads)
    model = make_model(args, be)
    lines = [f"# mamba2 {args.layers} layers, n_embd {args.n_embd}, d_inner {2 * args.n_embd}, d_state 16, "
             f"n_rs_seq {N_RS_SEQ}, decode {N_SEQS} seqs x 1 token/step, {args.rounds}x{args.steps} steps per "
             f"mode, cpu {args.threads} thread(s), {platform.machine()} {os.cpu_count()} cores, "
             f"load avg {os.getloadavg()[0]:.1f}",
             f"{'mem_size':>8s} {'atomic':>6s} {'cache MiB':>10s} {'snapshot KiB/step':>18s} {'graph KiB/step':>15s} "
             f"{'step ms':>8s} {'tokens/s':>9s} {'cpu ms':>8s} {'vs off':>7s}"]
    ratios = []
    for mem_size in [int(x) for x in args.mem_sizes.split(",")]:
        res = bench_mem_size(model, mem_size, args)
        c_off = res["off"][1]
        for mode, (t, c, snap, held, cache) in res.items():
            lines.append(f"{mem_size:8d} {mode:>6s} {cache / 2**20:10.1f} {snap / 2**10:18.1f} {held / 2**10:15.1f} "
                         f"{t * 1e3:8.2f} {N_SEQS / t:9.1f} {c * 1e3:8.2f} {(c / c_off - 1) * 100:+6.1f}%")
        saved_rows = res["rows"][2] + res["rows"][3]
        ratios.append((mem_size, res["full"][2] / saved_rows if saved_rows else float("inf")))
    for mem_size, ratio in ratios:
        lines.append(f"full/rows saved bytes per step at mem_size {mem_size}: {ratio:.1f}")
    lines.append(f"# wall {time.perf_counter() - t_start:.0f} s, load avg at the end {os.getloadavg()[0]:.1f}")
    report = "\n".join(lines)
    print(report)
    if args.write:
        results.write_report("bench/atomicity.py", list(sys.argv[1:] if argv is None else argv), report,
                             time.perf_counter() - t_start, machine0,
                             title="Failure atomicity: cost per decode step (bench/atomicity.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
