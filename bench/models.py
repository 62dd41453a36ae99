"""Model benchmarks: tokens per second of the tiny models on `cpu`, and one recurrent layer's graph
in minigraph against the same graph in real ggml (libggml-python), in the same process.

    python bench/models.py            # full run
    python bench/models.py --quick    # under two minutes

Whole models (mamba2, delta-net, lfm, kda; `models.zoo.make_model` on [cpu]): prefill (2
sequences x 32 tokens per step, n_ubatch 64: one ubatch) and decode (1 token per sequence per step,
2 sequences) through `models.runner.Runner` (n_rs_seq 3, atomic=False as in bench/reuse.py), graph
reuse on and off, 1 and 2 threads; runners alternate, medians of repetitions.

Then, where the `llama` extra is installed, bench/ggml_models.py in a process of its own: the same
models on the ggml backend (`ggml:cpu`) and over two loopback RPC servers, beside `cpu`.

Layer graphs (mamba2, delta-net; `models.standalone.layer_built` at the tiny models' sizes, n_rs_seq
3, 2 sequences): decode shape (T = 1) and prefill shape (T = 32; the full run adds T = 64). Each
graph is built once on each side; minigraph is timed through `CpuBackend.graph_compute(gf)` on the
same graph (its CPU plan cached, the Python entry included), ggml through `ggml_graph_compute` on a
prebuilt graph and cplan with a persistent threadpool (bench/ops.py's runners and alternating
timer). The `kernels` column is minigraph's plan alone (`run_plan`, no per-call checks). Target:
minigraph/ggml <= 1.0 for decode and prefill. `--profile` (and the full run, for a case
that misses its target) times every node on its own on both sides and sums by op.

The last line is `worst layer-graph time ratio minigraph/ggml: R (MODEL, PHASE)`.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# this file is bench/models.py: the script's folder must not shadow the `models` package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.dirname(HERE))
sys.path.append(HERE)       # after the project: bench/results.py only
import results  # noqa: E402


def _load_bench_ops():
    """bench/ops.py as the module `bench_ops` (its runners, timer and ggml threadpool cdefs)."""
    if "bench_ops" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_ops", os.path.join(HERE, "ops.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_ops"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_ops"]


import minigraph as mg                                    # noqa: E402
from minigraph.graph import Graph                         # noqa: E402
from minigraph.backends.cpu import CpuBackend                       # noqa: E402
from minigraph.backends.cpu import ffi as cpu_ffi, lib as cpu_lib   # noqa: E402
from minigraph.models.runner import Runner                          # noqa: E402
from minigraph.models.standalone import layer_built                 # noqa: E402
from minigraph.models.zoo import make_model, recurrent_only         # noqa: E402
from minigraph.testing.other_load import OtherLoad                  # noqa: E402

bench_ops = _load_bench_ops()
GgmlRunner, MgRunner, fmt, time_alternating = (bench_ops.GgmlRunner, bench_ops.MgRunner, bench_ops.fmt,
                                               bench_ops.time_alternating)

go = bench_ops.go
if go is not None:
    # (ggml_graph_n_nodes and ggml_graph_node come with the shared lowering's declarations)
    go.ffi.cdef("""
        void ggml_graph_add_node(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
        const char * ggml_op_desc(const struct ggml_tensor * t);
    """)

MODELS = ("mamba2", "delta-net", "lfm", "kda")
N_LAYER = 2        # recurrent blocks only (zoo.recurrent_only): the models these endless decodes time
LAYERS = ("mamba2", "delta-net")
TARGET = {"decode": 1.0, "prefill": 1.0}   # minigraph/ggml at most: as fast as ggml on every layer graph
N_SEQS, N_RS_SEQ = 2, 3
VIEW_OPS = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}
BUSY = 0.25          # other processes using more cores than this make a row unreliable (marked *)


def quietest(measure, retries, deadline=float("inf")):
    """(result, other cores) of measure(), run again up to `retries` times (and not after the
    perf_counter `deadline`) while other processes were busy (> BUSY cores); the run with the
    least other load is kept."""
    best = None
    for i in range(retries + 1):
        if i and time.perf_counter() > deadline:
            break
        load = OtherLoad()
        res = measure()
        other = load.cores()
        if best is None or (other is not None and other < best[1]):
            best = (res, other)
        if other is None or other <= BUSY:
            break
    return best


def _other(c):
    return f"{'-':>5s} " if c is None else f"{c:5.2f}{'*' if c > BUSY else ' '}"


# -- whole models -------------------------------------------------------------------------------

def bench_model(name, n_threads, reps, steps, prefill_len):
    """{(phase, reuse): (tokens/s, step seconds, builds, reuses)} for one model and thread count;
    the reuse-on and reuse-off runners alternate, each timed over blocks of `steps[phase]` steps."""
    be = mg.backend("cpu")
    be.set_n_threads(n_threads)
    model = make_model(name, [be], n_layer=N_LAYER, **recurrent_only(name, N_LAYER))
    runners = {reuse: Runner(model, mem_size=4, n_rs_seq=N_RS_SEQ, n_ubatch=64, reuse=reuse, atomic=False)
               for reuse in (False, True)}
    tok = np.random.default_rng(1).integers(0, model.n_vocab, 1 << 16)
    pos = {reuse: 0 for reuse in runners}

    def step(reuse, n):
        p = pos[reuse]
        pos[reuse] = p + N_SEQS * n
        runners[reuse].decode_seq_tokens({q: tok[(p + q * n + np.arange(n)) % tok.size].tolist()
                                          for q in range(N_SEQS)})

    out = {}
    for phase, n in (("prefill", prefill_len), ("decode", 1)):
        for reuse in runners:                     # warm: the first builds, then (reuse) a reused step
            step(reuse, n)
            step(reuse, n)
        before = {reuse: (r.stats.builds, r.stats.reuses) for reuse, r in runners.items()}
        times = {reuse: [] for reuse in runners}
        order = list(runners)
        for rep in range(reps):
            for reuse in order[rep % 2:] + order[:rep % 2]:
                t0 = time.perf_counter()
                for _ in range(steps[phase]):
                    step(reuse, n)
                times[reuse].append((time.perf_counter() - t0) / steps[phase])
        for reuse, r in runners.items():
            t = statistics.median(times[reuse])
            out[(phase, reuse)] = (N_SEQS * n / t, t, r.stats.builds - before[reuse][0],
                                   r.stats.reuses - before[reuse][1])
    return out


# -- layer graphs ------------------------------------------------------------------------------

class LayerMgRunner(MgRunner):
    """MgRunner over a ready Built with several outs: all of them are graph outputs."""

    def __init__(self, built, n_threads):
        self.b, self.out = built, built.outs[-3]          # outs: writes..., layer output, r, s
        self.be = CpuBackend(100 + n_threads).set_n_threads(n_threads)
        mg.alloc_ctx_tensors(built.ctx, self.be)
        for t, arr in built.data.items():
            t.set(arr)
        self.gf = Graph()
        for o in built.outs:
            o.set_output()
            self.gf.build_forward_expand(o)
        self.be.graph_compute(self.gf)                    # builds and caches the plan
        self.plan = self.be.get_plan(self.gf.nodes)

    def kernels(self):
        """The cached plan alone: what graph_compute runs after its per-call checks."""
        self.be.run_plan(self.plan)


def profile_mg(m: LayerMgRunner, n_threads, min_time):
    """{op: seconds per graph} from every plan record run on its own (one C call each)."""
    err = cpu_ffi.new("mg_error *")
    out = defaultdict(float)
    for i, node in enumerate(m.plan.compute):
        rec = m.plan.records + i
        out[node.op] += _per_call(lambda: cpu_lib.mg_plan_run(rec, 1, n_threads, err), min_time)
    return out


def profile_ggml(g: GgmlRunner, n_threads, min_time):
    """{op: seconds per graph} from every non-view node of ggml's graph computed on its own (a
    one-node graph and cplan on the same threadpool)."""
    lib, ffi = go.lib, go.ffi
    n = lib.ggml_graph_n_nodes(g.cgraph)
    size = 8
    ctx = lib.ggml_init({"mem_size": n * (lib.ggml_graph_overhead_custom(size, False) + 256) + (1 << 16),
                         "mem_buffer": ffi.NULL, "no_alloc": True})
    out = defaultdict(float)
    g.resume()
    try:
        for i in range(n):
            t = lib.ggml_graph_node(g.cgraph, i)
            op = ffi.string(lib.ggml_op_desc(t)).decode()
            if op in VIEW_OPS:
                continue
            one = lib.ggml_new_graph_custom(ctx, size, False)
            lib.ggml_graph_add_node(one, t)
            plan = ffi.new("struct ggml_cplan *", lib.ggml_graph_plan(one, n_threads, g.pool))
            work = ffi.new("uint8_t[]", plan.work_size) if plan.work_size else ffi.NULL
            plan.work_data = work
            out[op] += _per_call(lambda: lib.ggml_graph_compute(one, plan), min_time)
    finally:
        g.pause()
        lib.ggml_free(ctx)
    return out


def _per_call(fn, min_time):
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_time and n >= 5:
            return dt / n


def layer_runners(kind, T, n_threads):
    """The layer graph built once on each side (minigraph cpu, ggml), after checking that both
    compute the same layer output from the same initial caches."""
    built, _ = layer_built(kind, N_RS_SEQ, T, -1, seed=1, n_seqs=N_SEQS)
    m = LayerMgRunner(built, n_threads)
    first = m.out.numpy()                     # from the initial caches, as ggml's first compute
    g = GgmlRunner(m, n_threads, outs=built.outs)
    g.resume()
    ref = go._read(g.g[m.out], m.out.shape)
    g.pause()
    if not np.allclose(first, ref, rtol=1e-4, atol=1e-5):
        print(f"  WARNING: minigraph and ggml differ on the {kind} layer output (T={T})")
    return m, g


def bench_layer(kind, T, n_threads, reps, min_time):
    """Median seconds per compute of one layer graph {minigraph, kernels, ggml} and the node
    counts (minigraph compute records, ggml graph nodes)."""
    m, g = layer_runners(kind, T, n_threads)
    try:
        t0 = time.perf_counter()
        m()
        inner = max(1, int(min_time / max(time.perf_counter() - t0, 1e-7)))
        t = time_alternating({"minigraph": m, "kernels": m.kernels, "ggml": g}, reps, inner)
        return t, m.plan.n, go.lib.ggml_graph_n_nodes(g.cgraph)
    finally:
        g.close()


def profile_layer(kind, T, n_threads, min_time):
    """Per-op profiles (minigraph, ggml) of one layer graph: every node run on its own."""
    m, g = layer_runners(kind, T, n_threads)
    try:
        return profile_mg(m, n_threads, min_time), profile_ggml(g, n_threads, min_time)
    finally:
        g.close()


def print_profile(kind, phase, T, nt, t, prof):
    pm, pg = prof
    print(f"  per-op profile, {kind} {phase} T={T} {nt} threads (each node run alone; sums per graph):")
    print(f"    {'op':16s} {'minigraph':>11s} {'ggml':>11s} {'mg-ggml':>10s}")
    for op in sorted(set(pm) | set(pg), key=lambda o: -(pm.get(o, 0) - pg.get(o, 0))):
        a, b = pm.get(op, 0.0), pg.get(op, 0.0)
        print(f"    {op:16s} {fmt(a)} {fmt(b)} {(a - b) * 1e6:8.1f}us")
    print(f"    {'sum of nodes':16s} {fmt(sum(pm.values()))} {fmt(sum(pg.values()))}")
    print(f"    {'whole graph':16s} {fmt(t['kernels'])} {fmt(t['ggml'])}   (minigraph: run_plan)")
    print(f"    {'python entry':16s} {fmt(t['minigraph'] - t['kernels'])}   (graph_compute - run_plan)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 2 minutes)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma separated")
    ap.add_argument("--models", default=",".join(MODELS), help="whole models, comma separated ('' for none)")
    ap.add_argument("--profile", action="store_true", help="per-op profile of every layer graph")
    ap.add_argument("--retries", type=int, default=None,
                    help="measure a row again (up to N times, default 2; 1 with --quick, within its "
                         "first minute) while other processes keep a core busy")
    ap.add_argument("--budget", type=float, default=0.0, metavar="SECONDS",
                    help="stop starting new rows after this many seconds (0: no limit); the rows left out "
                         "are counted at the end (minigraph bench --quick uses it)")
    ap.add_argument("--write", action="store_true", help="(re)write this script's section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    title = "Model benchmarks: tiny models on cpu, layer graphs against real ggml (bench/models.py)"
    return results.run_and_write("bench/models.py", argv, title, lambda: run(args), args.write)


def run(args):
    threads = [int(t) for t in args.threads.split(",")]
    t_start = time.perf_counter()
    skipped = [0]

    def over_budget() -> bool:
        if args.budget > 0 and time.perf_counter() - t_start > args.budget:
            skipped[0] += 1
            return True
        return False
    if args.retries is None:
        args.retries = 1 if args.quick else 2
    # --quick stays under two minutes on a busy 2-core machine: no retries after the first minute
    deadline = time.perf_counter() + 60 if args.quick else float("inf")
    if args.quick:
        reps, steps, min_time, layer_reps, prefill_T = 5, {"prefill": 5, "decode": 20}, 0.03, 9, (32,)
    else:
        reps, steps, min_time, layer_reps, prefill_T = 9, {"prefill": 12, "decode": 60}, 0.05, 21, (32, 64)
    print(f"# {results.cpu_name()}, {os.cpu_count()} cores, {platform.python_implementation()} "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}")

    print(f"\n## whole models on cpu: {N_SEQS} seqs, prefill {N_SEQS}x32 tokens/step (n_ubatch 64), "
          f"decode {N_SEQS}x1 tokens/step, n_rs_seq {N_RS_SEQ}")
    print(f"{'model':10s} {'phase':8s} {'thr':>3s} {'reuse':>5s} {'tok/s':>9s} {'ms/step':>9s} {'builds':>6s} "
          f"{'reuses':>6s} {'other':>6s}")
    busiest = 0.0
    for name in [n for n in args.models.split(",") if n]:
        for nt in threads:
            if over_budget():
                continue
            res, other = quietest(lambda: bench_model(name, nt, reps, steps, 32), args.retries, deadline)
            busiest = max(busiest, other or 0.0)
            for (phase, reuse), (tps, t, nb, nr) in res.items():
                print(f"{name:10s} {phase:8s} {nt:3d} {'on' if reuse else 'off':>5s} {tps:9.0f} "
                      f"{t * 1e3:9.3f} {nb:6d} {nr:6d} {_other(other)}", flush=True)

    if not over_budget() and importlib.util.find_spec("llama_cpp") is not None:
        # the ggml backend (llama.cpp's ggml) in a process of its own: this one holds libggml-python
        print(flush=True)
        # (its output through this process, so that --write keeps it too)
        done = subprocess.run([sys.executable, os.path.join(HERE, "ggml_models.py")] + (["--quick"] if args.quick else []),
                              stdout=subprocess.PIPE, text=True)
        print(done.stdout, end="", flush=True)

    if go is None:
        print(f"\nggml not available ({bench_ops.GGML_ERROR}); no layer-graph comparison")
        print("worst layer-graph time ratio minigraph/ggml: n/a (ggml not available)")
        return
    print(f"\n## layer graphs (tiny model sizes, n_rs_seq {N_RS_SEQ}, {N_SEQS} seqs): minigraph cpu "
          f"graph_compute vs ggml_graph_compute; ratio minigraph/ggml (lower is better)")
    print(f"{'layer':10s} {'phase':8s} {'shape':10s} {'thr':>3s} {'nodes':>9s} {'minigraph':>11s} {'kernels':>11s} "
          f"{'ggml':>11s} {'mg/ggml':>8s} {'kern/ggml':>9s} {'target':>7s} {'other':>6s}")
    worst, profiles = None, []
    for kind in LAYERS:
        for phase, Ts in (("decode", (1,)), ("prefill", prefill_T)):
            for T in Ts:
                for nt in threads:
                    if over_budget():
                        continue
                    (t, n_rec, n_ggml), other = quietest(
                        lambda: bench_layer(kind, T, nt, layer_reps, min_time), args.retries, deadline)
                    busiest = max(busiest, other or 0.0)
                    r, rk = t["minigraph"] / t["ggml"], t["kernels"] / t["ggml"]
                    ok = r <= TARGET[phase]
                    print(f"{kind:10s} {phase:8s} {f'{N_SEQS}x{T}':10s} {nt:3d} {f'{n_rec}/{n_ggml}':>9s} "
                          f"{fmt(t['minigraph'])} {fmt(t['kernels'])} {fmt(t['ggml'])} {r:8.2f} {rk:9.2f} "
                          f"{'<=' if ok else '> '}{TARGET[phase]:.2f} {_other(other)}", flush=True)
                    if args.profile or (not args.quick and not ok):
                        profiles.append((kind, phase, T, nt, t))
                    if worst is None or r > worst[0]:
                        worst = (r, kind, phase, T, nt)
    print("  nodes: minigraph compute records / ggml graph nodes (ggml counts view nodes too)")
    print("  other: cores kept busy by other processes during the row's measurement (from /proc/stat;\n"
          "         a row is measured again, up to --retries times, while that exceeds "
          f"{BUSY}, and the quietest run kept)")
    for kind, phase, T, nt, t in profiles:
        print_profile(kind, phase, T, nt, t, profile_layer(kind, T, nt, min_time / 10))
    if busiest > BUSY:
        print(f"note: other processes kept up to {busiest:.2f} cores busy; rows marked * are unreliable "
              f"(two-thread rows above all)")
    if skipped[0]:
        print(f"budget: {args.budget:.0f} s reached, {skipped[0]} rows not measured (without --budget every row runs)")
    if worst is None:
        print("worst layer-graph time ratio minigraph/ggml: n/a (no layer row within the budget)")
        return
    print(f"worst case: {worst[1]} {worst[2]} T={worst[3]}, {worst[4]} threads")
    print(f"worst layer-graph time ratio minigraph/ggml: {worst[0]:.2f} ({worst[1]}, {worst[2]})")


if __name__ == "__main__":
    main()
