"""Op benchmarks: minigraph's cpu backend against NumPy and real ggml (libggml-python), measured
in the same process, alternating, medians of repetitions.

    python bench/ops.py                  # full run: quiet rows, then the contention rows
    python bench/ops.py --quick          # fewer repetitions
    python bench/ops.py --contention     # the contention rows only
    python bench/ops.py --quick --write  # also (re)write this script's section of bench/RESULTS.md
    python bench/ops.py --filter weights --write   # the half / block-type matrix x vector rows
                                                   # only, in a section of their own

Prints one line per (op, shape, threads) with times and the ratios ggml/minigraph and
numpy/minigraph (> 1: minigraph is faster). Then the contention rows: the same rows again while
one busy-loop process (started and stopped here) holds a core, each call timed on its own,
medians and 90th percentiles, minigraph against ggml under the same competition and against its
own 1-thread time. The last lines are
    gemm: numpy/minigraph at 4096x4096x512: R
    contention: worst 2-thread/1-thread ratio: R (...)
    min ratio ggml/minigraph: R (...)          (over the quiet rows)
minigraph is timed through `backend.graph_compute(gf)` on a graph whose plan is cached (the
Python entry cost included); ggml through `ggml_graph_compute` on a prebuilt graph and cplan with
a persistent threadpool; NumPy as one idiomatic expression, its OpenBLAS limited to the row's T threads
(when the setter is found; the table header says which). OpenBLAS's threads sleep as soon as a
call ends (OPENBLAS_THREAD_TIMEOUT=4, set before NumPy loads, unless the environment sets it),
as ggml's and minigraph's do within microseconds: left at its default, each spins for about a
tenth of a second after every call and holds the second core while the next engine's row runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")     # before NumPy loads OpenBLAS (see above)
import numpy as np                                        # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import results                                            # noqa: E402  (bench/results.py)

import minigraph as mg                                    # noqa: E402
from minigraph.graph import Graph                         # noqa: E402
from minigraph.testing.op_cases import Built                      # noqa: E402
from minigraph.tensor import Context                      # noqa: E402
from minigraph.backends.cpu import CpuBackend                       # noqa: E402

try:
    import minigraph.testing.ggml_oracle as go                    # noqa: E402
    go.ffi.cdef("""
        struct ggml_threadpool_params { bool cpumask[512]; int n_threads; int prio; uint32_t poll;
                                        bool strict_cpu; bool paused; };
        struct ggml_threadpool_params ggml_threadpool_params_default(int n_threads);
        void * ggml_threadpool_new(struct ggml_threadpool_params * params);
        void ggml_threadpool_free(void * threadpool);
        void ggml_threadpool_pause(void * threadpool);
        void ggml_threadpool_resume(void * threadpool);
    """)
    GGML_ERROR = None
except Exception as e:  # pragma: no cover - ggml is optional here
    go = None
    GGML_ERROR = e


# -- the cases: name, shape label, builder (rng, Built) -> out tensor, numpy fn(data) -> result --

def ssm_conv_case(d_inner, n_t, n_s, d_conv=4):
    def build(rng, b):
        x = b.leaf(mg.f32, (d_conv - 1 + n_t, d_inner, n_s), rng=rng)
        c = b.leaf(mg.f32, (d_conv, d_inner), rng=rng)
        return mg.ssm_conv(x, c)

    def numpy_fn(arrs):
        x = arrs[0].reshape(n_s, d_inner, d_conv - 1 + n_t)
        c = arrs[1].reshape(d_inner, d_conv)
        acc = np.zeros((n_s, d_inner, n_t), np.float32)
        for k in range(d_conv):
            acc += x[:, :, k:k + n_t] * c[:, k:k + 1]
        return np.ascontiguousarray(acc.transpose(0, 2, 1))
    moved = ((d_conv - 1 + n_t) * d_inner * n_s + d_conv * d_inner + d_inner * n_t * n_s) * 4
    return "SSM_CONV", f"d_inner={d_inner} n_t={n_t} n_s={n_s}", build, numpy_fn, moved


def conv_store_case(n_t, n_cols=3, K=4, ch=4096, n_seqs=4):
    """The shared conv-state store (llama.cpp's build_conv_state_store): Kw overlapping windows into permuted rollback slots."""
    mem = n_seqs + 1
    kw = min(n_t, K)

    def build(rng, b):
        s = b.leaf(mg.f32, (n_cols * ch, mem * K), rng=rng)
        x = b.leaf(mg.f32, (n_cols + n_t, ch, n_seqs), rng=rng)
        order = b.leaf(mg.i32, (kw,), data=np.arange(kw)[::-1])
        windows = mg.view_4d(x, n_cols, kw, ch, n_seqs, 4, x.nb[1], x.nb[2], (n_t - kw + 1) * 4)
        slots = mg.view_4d(s, n_cols, K, ch, n_seqs, mem * s.nb[1], n_cols * 4, s.nb[1], s.nb[1])
        return mg.set_rows(slots, windows, order)

    def numpy_fn(arrs):
        s = arrs[0].reshape(mem * K, n_cols * ch)
        x = arrs[1].reshape(n_seqs, ch, n_cols + n_t)
        order = arrs[2].reshape(-1)
        s4 = s.reshape(K, mem, ch, n_cols)
        for j, slot in enumerate(order):
            start = n_t - kw + j
            s4[slot, 1:1 + n_seqs] = x[:, :, start:start + n_cols]
        return s
    moved = 2 * kw * n_cols * ch * n_seqs * 4                     # windows read, slots written
    return "SET_ROWS", f"conv store n_cols={n_cols} K={K} ch={ch} n_seqs={n_seqs} n_t={n_t}", build, numpy_fn, moved


def concat_case(n_t, n_hist=3, ch=4096, n_seqs=4):
    def build(rng, b):
        return mg.concat(b.leaf(mg.f32, (n_hist, ch, n_seqs), rng=rng), b.leaf(mg.f32, (n_t, ch, n_seqs), rng=rng), 0)

    def numpy_fn(arrs):
        return np.concatenate([a.reshape(n_seqs, ch, -1) for a in arrs], axis=-1)
    return "CONCAT", f"dim0 [{n_hist}+{n_t}, {ch}, {n_seqs}]", build, numpy_fn, 2 * (n_hist + n_t) * ch * n_seqs * 4


def cont_t_case(n0=4096, n1=512):
    def build(rng, b):
        return mg.cont(mg.transpose(b.leaf(mg.f32, (n0, n1), rng=rng)))

    def numpy_fn(arrs):
        return np.ascontiguousarray(arrs[0].reshape(n1, n0).T)
    return "CONT", f"transposed {n0}x{n1}", build, numpy_fn, 2 * n0 * n1 * 4


def mul_mat_case(n, k=4096, m=4096):
    def build(rng, b):
        return mg.mul_mat(b.leaf(mg.f32, (k, m), rng=rng), b.leaf(mg.f32, (k, n), rng=rng))

    def numpy_fn(arrs):
        a, x = arrs[0].reshape(m, k), arrs[1].reshape(n, k)
        return x @ a.T
    # matrix x few vectors is memory-bound (the matrix is read once); large n is compute-bound
    moved = (m * k + (k + m) * n) * 4 if n <= 8 else None
    return "MUL_MAT", f"{m}x{k} by {k}x{n}", build, numpy_fn, moved


def mul_mat_weights_case(t, n=1, k=4096, m=4096):
    """matrix x vector (n=1: the decode step of a quantized model) or matrix x matrix (a prefill)
    with half / block-type weights: ggml converts the f32 operand to the weights' vec_dot_type,
    then integer dot products per block; the weights are ggml-quantized random normals. NumPy
    multiplies the dequantized matrix (converted once, outside the timing)."""
    def weights(rng):
        w = rng.standard_normal((m, k)).astype(np.float32)
        return w.astype(np.float16) if t == mg.f16 else np.asarray(mg.quantize(w, t)).view(t.np_dtype).reshape(m, -1)

    def build(rng, b):
        return mg.mul_mat(b.leaf(t, (k, m), data=weights(rng)), b.leaf(mg.f32, (k, n), rng=rng))

    deq = {}

    def numpy_fn(arrs):
        if "w" not in deq:   # converted once, on the first (warm-up) call
            w = arrs[0]
            deq["w"] = (w.astype(np.float32) if t == mg.f16 else
                        mg.dequantize(np.ascontiguousarray(w).view(np.uint8), t)).reshape(m, k)
        return arrs[1].reshape(n, k) @ deq["w"].T
    moved = m * t.row_size(k) + (k + m) * n * 4
    # as a model's load leaves them: packed where the cpu backend packs this type (MgRunner)
    packed = " packed" if CpuBackend.packs_type(t) else ""
    return "MUL_MAT", f"{t.name}{packed} weights {m}x{k} by {k}x{n}", build, numpy_fn, moved


QUANT_TYPES = ("q8_0", "q4_0", "q4_k", "q6_k", "f16", "bf16")
PREFILL_TYPES = ("q8_0", "q4_k", "q6_k")   # the types of the Q8_0 and Q4_K_M files bench/e2e.py runs


def unary_case(op, ne0=4096, ne1=64):
    """the exp-based unary ops (vectorised exp) on 1 MiB of f32"""
    fn = {"EXP": mg.exp, "SIGMOID": mg.sigmoid, "SILU": mg.silu, "SOFTPLUS": mg.softplus}[op]

    def build(rng, b):
        return fn(b.leaf(mg.f32, (ne0, ne1), data=rng.uniform(-8, 8, (ne1, ne0)).astype(np.float32)))

    def numpy_fn(arrs):
        x = arrs[0]
        if op == "EXP":
            return np.exp(x)
        if op == "SIGMOID":
            return np.float32(1) / (np.float32(1) + np.exp(-x))
        if op == "SILU":
            return x / (np.float32(1) + np.exp(-x))
        return np.where(x > np.float32(20), x, np.log(np.float32(1) + np.exp(x)))
    return op, f"[{ne0}, {ne1}] uniform(-8, 8)", build, numpy_fn, 2 * ne0 * ne1 * 4


def soft_max_case(n_kv=256, used=40, n_head=16, n_seqs=4):
    """a decode step's attention rows: [n_kv, 1 token, heads, sequences] scaled and masked, the
    mask -inf past the cells in use (llama.cpp pads n_kv to 256)"""
    def build(rng, b):
        mask = np.full((1, n_kv), -np.inf, np.float32)
        mask[0, :used] = 0
        kq = b.leaf(mg.f32, (n_kv, 1, n_head, n_seqs), rng=rng)
        return mg.soft_max_ext(kq, b.leaf(mg.f32, (n_kv, 1), data=mask), 0.125, 0.0)

    def numpy_fn(arrs):
        w = arrs[0] * np.float32(0.125) + arrs[1].reshape(n_kv)
        e = np.exp(w - w.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return "SOFT_MAX", f"decode kq [{n_kv}({used} used), 1, {n_head}, {n_seqs}]", build, numpy_fn, \
        2 * n_kv * n_head * n_seqs * 4


def all_cases(quick):
    cases = []
    for n_t in (1, 8, 512):
        for n_s in (1, 4):
            cases.append(ssm_conv_case(4096, n_t, n_s))
    for op in ("EXP", "SIGMOID", "SILU", "SOFTPLUS"):
        cases.append(unary_case(op))
    cases.append(soft_max_case())
    cases.append(conv_store_case(4))
    cases.append(concat_case(8))
    cases.append(concat_case(512))
    cases.append(cont_t_case())
    for n in (1, 4, 8, 512):
        cases.append(mul_mat_case(n))
    # decode with 4 sequences at a small model's width (mamba2-130m's in_proj: 768 -> 3352)
    cases.append(mul_mat_case(4, k=768, m=3352))
    for name in QUANT_TYPES:
        cases.append(mul_mat_weights_case(getattr(mg, name)))
    # a prefill's products: 512 tokens through a 2048x2048 quantized matrix
    for name in PREFILL_TYPES:
        cases.append(mul_mat_weights_case(getattr(mg, name), n=512, k=2048, m=2048))
    return cases


# -- runners ------------------------------------------------------------------------------------

class MgRunner:
    def __init__(self, build, n_threads):
        self.b = Built(Context())
        self.out = build(np.random.default_rng(0), self.b)
        self.out.set_output()
        self.be = CpuBackend(100 + n_threads).set_n_threads(n_threads)
        mg.alloc_ctx_tensors(self.b.ctx, self.be)
        for t, arr in self.b.data.items():
            t.set(arr)
        self.gf = Graph().build_forward_expand(self.out)
        for node in self.gf.nodes:   # a MUL_MAT's weights as load_gguf leaves them: packed where it packs
            a = node.srcs.get("a") if node.op == "MUL_MAT" else None
            if a is not None and a in self.b.data:
                self.be.pack_weight(a)
        self.be.graph_compute(self.gf)   # builds and caches the plan

    def __call__(self):
        self.be.graph_compute(self.gf)

    def result(self):
        return self.out.numpy()


class GgmlRunner:
    """run_in_ggml's graph build, kept alive so that only ggml_graph_compute is timed."""

    def __init__(self, mg_runner: MgRunner, n_threads, outs=None):
        """outs: the tensors whose graphs ggml computes, in expansion order (default: the
        runner's one out); every out of the Built is translated either way."""
        lib, ffi = go.lib, go.ffi
        b = mg_runner.b
        outs = [mg_runner.out] if outs is None else list(outs)
        gf = Graph()
        for o in b.outs + outs:
            gf.build_forward_expand(o)
        for node in gf.nodes:
            if node.op in go._CHECKS:
                go._CHECKS[node.op](node, b)
        tensors = gf.leafs + gf.nodes
        size = max(64, 2 * len(tensors))
        mem = (lib.ggml_graph_overhead_custom(size, False) + (1 << 20)
               + sum(lib.ggml_tensor_overhead() + t.nbytes() + 64 for t in tensors))
        self.ctx = lib.ggml_init({"mem_size": mem, "mem_buffer": ffi.NULL, "no_alloc": False})
        g = {}
        for leaf in gf.leafs:
            t = g[leaf] = lib.ggml_new_tensor(self.ctx, leaf.type.ggml_id, 4, leaf.ne)
            data = np.ascontiguousarray(b.data[leaf], dtype=leaf.type.np_dtype)
            ffi.memmove(t.data, data.tobytes(), data.nbytes)
        gb = go.GgmlBuilder(self.ctx, lib, ffi)
        for node in gf.nodes:
            g[node] = go.translate(gb, node, lambda name, node=node: g[node.srcs[name]])
        self.g, self.out = g, mg_runner.out
        self.cgraph = lib.ggml_new_graph_custom(self.ctx, size, False)
        for o in outs:
            lib.ggml_build_forward_expand(self.cgraph, g[o])
        params = ffi.new("struct ggml_threadpool_params *", lib.ggml_threadpool_params_default(n_threads))
        self.pool = lib.ggml_threadpool_new(params)
        self.plan = ffi.new("struct ggml_cplan *", lib.ggml_graph_plan(self.cgraph, n_threads, self.pool))
        self.work = ffi.new("uint8_t[]", self.plan.work_size) if self.plan.work_size else ffi.NULL
        self.plan.work_data = self.work
        self()
        self.pause()

    def pause(self):
        """Park ggml's workers (they poll) while the other runtimes are timed."""
        go.lib.ggml_threadpool_pause(self.pool)

    def resume(self):
        go.lib.ggml_threadpool_resume(self.pool)

    def __call__(self):
        if go.lib.ggml_graph_compute(self.cgraph, self.plan) != 0:
            raise RuntimeError("ggml_graph_compute failed")

    def result(self):
        return go._read(self.g[self.out], self.out.shape)

    def close(self):
        if self.pool is not None:
            go.lib.ggml_threadpool_free(self.pool)
            self.pool = None
        if self.ctx is not None:
            go.lib.ggml_free(self.ctx)
            self.ctx = None


def _openblas_thread_setter():
    """NumPy's OpenBLAS thread-count setter (ctypes), or None: found among the libraries this
    process has loaded, under the names the scipy-openblas wheels and plain builds export."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[5] for ln in f if len(ln.split()) > 5 and "openblas" in ln.split()[5].lower()})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
                     "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                return fn
    return None


np.ones((64, 64), np.float32) @ np.ones((64, 64), np.float32)   # loads NumPy's BLAS
SET_BLAS_THREADS = _openblas_thread_setter()


def numpy_threads(n: int) -> str:
    """Let NumPy's BLAS use n threads (the row's T), so that a T-thread row compares like with like."""
    if SET_BLAS_THREADS is None:
        return "NumPy's BLAS threads: its own (no OpenBLAS setter found)"
    SET_BLAS_THREADS(n)
    return (f"NumPy's BLAS threads: T (set per row), sleeping after each call "
            f"(OPENBLAS_THREAD_TIMEOUT={os.environ.get('OPENBLAS_THREAD_TIMEOUT')})")


def bench_case(case, n_threads, reps, min_time):
    op, shape, build, numpy_fn, _ = case
    m = MgRunner(build, n_threads)
    arrs = [m.b.data[t].copy() for t in m.b.data]
    numpy_threads(n_threads)
    runners = {"minigraph": m, "numpy": lambda: numpy_fn(arrs)}
    gg = None
    if go is not None:
        try:
            gg = runners["ggml"] = GgmlRunner(m, n_threads)
        except go.GgmlRefuses as e:
            print(f"  (ggml refuses {op} {shape}: {e})")
    # inner loop count so that one sample takes about min_time
    t0 = time.perf_counter()
    m()
    one = time.perf_counter() - t0
    inner = max(1, int(min_time / max(one, 1e-7)))
    try:
        t = time_alternating(runners, reps, inner)
        if gg is not None:   # sanity: same answer as ggml
            gg.resume()
            a, e = m.result(), gg.result()
            if op != "SET_ROWS" and not np.allclose(a, e, rtol=1e-3, atol=1e-3):
                print(f"  WARNING: minigraph and ggml differ on {op} {shape}")
    finally:
        if gg is not None:
            gg.close()
    return t


def time_alternating(runners: dict, reps: int, inner: int) -> dict:
    """Median seconds per call of each runner {name: callable}: reps rounds, each timing `inner`
    calls of every runner in turn, rotating who goes first. A runner with pause/resume (a
    GgmlRunner's threadpool) is resumed only while it is timed."""
    times = {k: [] for k in runners}
    order = list(runners)
    for r in range(reps):
        for k in order[r % len(order):] + order[:r % len(order)]:   # alternate who goes first
            fn = runners[k]
            pausable = hasattr(fn, "pause")
            time.sleep(0.005)    # let the previous runtime's spinning workers go idle
            if pausable:
                fn.resume()
            fn()                 # warm this runtime's workers
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[k].append((time.perf_counter() - t0) / inner)
            if pausable:
                fn.pause()
    return {k: statistics.median(v) for k, v in times.items()}


def time_per_call(runners: dict, reps: int, min_time: float) -> dict:
    """Every call timed on its own (contention makes the distribution long-tailed): reps rounds,
    each running every runner in turn (rotating who goes first) for about min_time, at least 2
    calls. Returns {name: sorted list of seconds per call}."""
    times = {k: [] for k in runners}
    order = list(runners)
    for r in range(reps):
        for k in order[r % len(order):] + order[:r % len(order)]:
            fn = runners[k]
            pausable = hasattr(fn, "pause")
            if pausable:
                fn.resume()
            fn()
            t_end = time.perf_counter() + min_time
            n = 0
            while n < 2 or time.perf_counter() < t_end:
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
                n += 1
            if pausable:
                fn.pause()
    return {k: sorted(v) for k, v in times.items()}


def pct(sorted_ts, q):
    return sorted_ts[min(len(sorted_ts) - 1, int(q * len(sorted_ts)))]


class BusyProcess:
    """One process spinning a core for the duration of a `with` block (the competition a
    shared machine gives: another job, a test run)."""

    def __enter__(self):
        import subprocess
        self.p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.p.kill()
        self.p.wait()


def bench_case_contention(case, threads, reps, min_time):
    """minigraph at each thread count and ggml at each, per-call times while a BusyProcess runs
    (the caller holds it). Returns {(runtime, n_threads): sorted seconds}."""
    op, shape, build, _, _ = case
    runners, ggs = {}, []
    try:
        for nt in threads:
            m = MgRunner(build, nt)
            runners[("minigraph", nt)] = m
            if go is not None:
                try:
                    gg = GgmlRunner(m, nt)
                    ggs.append(gg)
                    runners[("ggml", nt)] = gg
                except go.GgmlRefuses:
                    pass
        return time_per_call(runners, reps, min_time)
    finally:
        for gg in ggs:
            gg.close()


def contention_rows(cases, threads, reps, min_time, over_budget=lambda: False):
    """The contention table (printed as it goes) and the worst 2-thread/1-thread ratio of
    minigraph's medians: (lines, worst, failures against ggml)."""
    lines = []
    hdr = (f"{'op':9s} {'shape':48s} {'T':>2s} {'mg median':>11s} {'mg p90':>11s} {'ggml median':>11s} "
           f"{'ggml p90':>11s} {'ggml/mg':>8s} {'T/1T':>6s}")
    print(f"contention: the same rows while one busy process spins a core (per-call medians)")
    print(hdr)
    lines.append(hdr)
    worst, slower = None, []
    with BusyProcess():
        for case in cases:
            if over_budget():
                break
            t = bench_case_contention(case, threads, reps, min_time)
            one = pct(t[("minigraph", min(threads))], 0.5)
            for nt in threads:
                m = t[("minigraph", nt)]
                g = t.get(("ggml", nt))
                mm, m90 = pct(m, 0.5), pct(m, 0.9)
                gm, g90 = (pct(g, 0.5), pct(g, 0.9)) if g else (None, None)
                rg = gm / mm if gm else float("nan")
                r1 = mm / one
                line = (f"{case[0]:9s} {case[1]:48s} {nt:2d} {fmt(mm)} {fmt(m90)} "
                        f"{fmt(gm) if gm else '        -':>11s} {fmt(g90) if g90 else '        -':>11s} "
                        f"{rg:8.2f} {r1:6.2f}")
                print(line, flush=True)
                lines.append(line)
                if nt > 1 and (worst is None or r1 > worst[0]):
                    worst = (r1, case[0], case[1], nt)
                if gm and rg < 1.0:
                    slower.append((rg, case[0], case[1], nt))
    return lines, worst, slower


def section_markers(filter_: str = "") -> tuple:
    """The markers of the section a run writes: a filtered run (say --filter weights) has its
    own section, so it never replaces the full run's rows."""
    return results.markers("bench/ops.py --write" + (f" --filter {filter_}" if filter_ else ""))


def write_results(text: str, path=results.RESULTS, filter_: str = ""):
    """Replace this script's section of bench/RESULTS.md (between the markers), or insert it
    before the model benchmarks (appended when that heading is absent)."""
    results.replace_section(*section_markers(filter_), text, path, before="# Model benchmarks")


def copy_bandwidth(nbytes=64 << 20, reps=9) -> float:
    """NumPy's copy bandwidth on this machine, read + write bytes per second."""
    src = np.random.default_rng(0).random(nbytes // 8)
    dst = np.empty_like(src)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(ts)


def decode_graph_step(n_layer=24, n_embd=1024, reps=30):
    """A whole 24-layer decode graph (conv layers: rms_norm, mul_mat, build_rs get_rows, concat,
    the conv-state store's set_rows, ssm_conv, silu, mul, add) per step, and the share of the step
    spent outside kernels, estimated as the same graph's time at n_embd 8 (the same nodes, plan
    dispatch, barriers and Python entry, almost no arithmetic)."""
    from minigraph.models.runner import Runner
    from minigraph.models.toy import ToyConvModel
    out = {}
    for E in (n_embd, 8):
        be = mg.backend("cpu")
        model = ToyConvModel(n_vocab=256, n_embd=E, n_layer=n_layer, d_conv=4, devices=be)
        r = Runner(model, mem_size=1, n_rs_seq=3, atomic=False)
        r.decode_seq_tokens({0: [1, 2, 3, 4]})
        r.decode_seq_tokens({0: [5]})
        gf, sched = r.prev.gf, r.prev.sched
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            sched.graph_compute(gf)
            ts.append(time.perf_counter() - t0)
        out[E] = (statistics.median(ts), len(gf.nodes))
    return out


def ratios_by_type(ratios: dict) -> str:
    """{(weight type, threads): ratio} as 'q8_0 1T 1.06, 2T 1.12; q4_0 ...' in the order measured."""
    return "; ".join(f"{ty} " + ", ".join(f"{nt}T {r:.2f}" for (ty2, nt), r in ratios.items() if ty2 == ty)
                     for ty in dict.fromkeys(ty for ty, _ in ratios))


def fmt(t):
    return f"{t * 1e6:9.1f}us" if t < 1e-3 else f"{t * 1e3:9.2f}ms"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma separated")
    ap.add_argument("--filter", default="",
                    help="only rows whose op name or shape label contains this (case-insensitive), e.g. "
                         "'weights' for the half / block-type matrix x vector rows")
    ap.add_argument("--contention", action="store_true", help="only the contention rows")
    ap.add_argument("--no-contention", action="store_true", help="skip the contention rows")
    ap.add_argument("--write", action="store_true",
                    help="write the tables and a machine line into bench/RESULTS.md (its own section)")
    ap.add_argument("--budget", type=float, default=0.0, metavar="SECONDS",
                    help="stop starting new rows after this many seconds (0: no limit); the rows left out "
                         "are counted at the end (minigraph bench --quick uses it)")
    args = ap.parse_args(argv)
    reps, min_time = (5, 0.02) if args.quick else (15, 0.05)
    threads = [int(t) for t in args.threads.split(",")]
    cmd = "python bench/ops.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine0 = results.machine_line()
    t_start = time.time()
    skipped = []

    def over_budget() -> bool:
        return args.budget > 0 and time.time() - t_start > args.budget
    if go is None:
        print(f"ggml not available ({GGML_ERROR}); ratios against ggml are omitted")
    cases = [c for c in all_cases(args.quick) if not args.filter or args.filter.upper() in f"{c[0]} {c[1]}".upper()]
    out = []      # the quiet table's lines
    worst = None
    gemm = None
    weights = {}  # (weight type, threads) -> ggml/minigraph of the matrix x vector rows
    prefill = {}  # the same for the matrix x matrix rows
    if not args.contention:
        bw = copy_bandwidth()
        out.append(f"NumPy copy bandwidth (read + write): {bw / 1e9:.1f} GB/s; {numpy_threads(1)}")
        out.append(f"{'op':9s} {'shape':48s} {'T':>2s} {'minigraph':>11s} {'ggml':>11s} {'numpy':>11s} "
                   f"{'ggml/mg':>8s} {'np/mg':>8s} {'GB/s':>6s} {'%copy':>6s}")
        print(out[0])
        print(out[1])
        for case in cases:
            if over_budget():
                skipped.append(case[0] + " " + case[1])
                continue
            for nt in threads:
                t = bench_case(case, nt, reps, min_time)
                mg_t = t["minigraph"]
                g = t.get("ggml")
                rg = g / mg_t if g else float("nan")
                rn = t["numpy"] / mg_t
                moved = case[4]
                gbs = f"{moved / mg_t / 1e9:6.1f} {moved / mg_t / bw:6.0%}" if moved else f"{'-':>6s} {'-':>6s}"
                line = (f"{case[0]:9s} {case[1]:48s} {nt:2d} {fmt(mg_t)} {fmt(g) if g else '        -':>11s} "
                        f"{fmt(t['numpy'])} {rg:8.2f} {rn:8.2f} {gbs}")
                print(line, flush=True)
                out.append(line)
                if g and (worst is None or rg < worst[0]):
                    worst = (rg, case[0], case[1], nt)
                if g and " weights " in case[1]:
                    (weights if case[1].endswith("x1") else prefill)[(case[1].split()[0], nt)] = rg
                if case[0] == "MUL_MAT" and case[1] == "4096x4096 by 4096x512" and (gemm is None or nt >= gemm[1]):
                    gemm = (rn, nt)
        if not args.filter and not over_budget():
            for nt in threads:
                mg.backend("cpu").set_n_threads(nt)
                steps = decode_graph_step()
                (t_full, n_nodes), (t_tiny, _) = steps[1024], steps[8]
                line = (f"24-layer decode graph ({n_nodes} nodes, n_embd 1024), {nt} threads: {fmt(t_full)} per step; "
                        f"outside kernels ~{fmt(t_tiny)} ({t_tiny / t_full:.0%} of the step, "
                        f"{t_tiny / n_nodes * 1e6:.2f} us per node)")
                print(line, flush=True)
                out.append(line)
    cont_lines, cworst, slower = [], None, []
    if not args.no_contention and len(threads) > 0:
        # per-call timing needs fewer rounds (every call is a sample)
        cont_lines, cworst, slower = contention_rows(cases, threads, 3 if args.quick else 7, min_time,
                                                     over_budget)
    tail = []
    if skipped:
        tail.append(f"budget: {args.budget:.0f} s reached, {len(skipped)} of {len(cases)} rows not measured "
                    f"(without --budget every row runs)")
    if gemm:
        tail.append(f"gemm: numpy/minigraph at 4096x4096x512: {gemm[0]:.2f} ({gemm[1]} threads)")
    if cont_lines:
        if cworst:
            tail.append(f"contention: worst {cworst[3]}-thread/1-thread ratio: {cworst[0]:.2f} "
                        f"({cworst[1]} at {cworst[2]}; rows slower than ggml under contention: {len(slower)})")
        elif len(threads) < 2:
            tail.append("contention: worst 2-thread/1-thread ratio: n/a (one thread count only)")
        else:
            tail.append("contention: worst 2-thread/1-thread ratio: n/a (no contention row within the budget)")
    if weights:
        tail.append("weights 4096x4096 x vector, ggml/minigraph (target >= 1.0 for q8_0, q4_0, q4_k): "
                    + ratios_by_type(weights))
    if prefill:
        tail.append("weights 2048x2048 x 512 columns, ggml/minigraph (ggml's own CPU path, as this ggml "
                    "runs it; llama.cpp repacks q4_K weights: bench/e2e.py): " + ratios_by_type(prefill))
    if worst:
        tail.append(f"min ratio ggml/minigraph: {worst[0]:.2f} ({worst[1]} at {worst[2]}, {worst[3]} threads)")
    elif not args.contention:
        tail.append("min ratio ggml/minigraph: n/a (ggml not available)")
    for ln in tail:
        print(ln)
    if args.write:
        title = "## Op rows, script-written (`bench/ops.py --write`)" if not args.filter else \
            f"## Op rows matching '{args.filter}', script-written (`bench/ops.py --write --filter {args.filter}`)"
        text = [title, "",
                "Command: " + results.run_line(cmd, time.time() - t_start, machine0) +
                " (Load average: other jobs on this machine, not counting the benchmark's own busy process.)", ""]
        cores = len(os.sched_getaffinity(0))
        if max(os.getloadavg()[0], float(machine0.rsplit("load average ", 1)[1].split(",")[0])) > cores:
            text += [f"The machine was shared and loaded during this run (a load average above its {cores} cores: "
                     f"other processes held cores), so absolute times are inflated and noisy; the ratios, "
                     f"measured alternately in one process, are the figures to compare.", ""]
        if out:
            text += ["Rows without the benchmark's busy process (medians of alternating repetitions; the "
                     "machine's other load is whatever the load average says):", "", "```", *out, "```", ""]
        if cont_lines:
            text += ["Contention rows (one busy-loop process spinning a core; per-call medians and 90th "
                     "percentiles; T/1T = minigraph's median against its own 1-thread median):", "",
                     "```", *cont_lines, "```", ""]
        text += ["```", *tail, "```"]
        write_results("\n".join(text), filter_=args.filter)


if __name__ == "__main__":
    main()
