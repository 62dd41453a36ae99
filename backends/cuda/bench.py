"""Bandwidth of the CUDA backend's data-movement ops, against a plain device-to-device copy.

    python -m backends.cuda.bench            # on cuda:0, large sizes (a few seconds on an H200)
    python -m backends.cuda.bench --emu      # tiny sizes on the CPU emulator (checks the script)

Each op runs as a one-node graph through CudaBackend.compute_nodes (argument packing, index
checks and all), timed on the GPU with cupyx.profiler.benchmark. GB/s counts the bytes the op
must read plus the bytes it writes; "of copy" is that rate over a device-to-device copy
(cudaMemcpyAsync) of a 256 MiB buffer, also read + write. The index ops are timed twice: as they
run (the index check waits for its flag on the host) and without the check (the kernel alone).
Every result is checked against the reference once before timing.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import numpy as np

import minigraph as mg
from minigraph.backends.cuda import CudaBackend


class Timer:
    def __init__(self, emu: bool, repeat: int):
        self.emu, self.repeat = emu, repeat

    def __call__(self, fn) -> float:
        """Seconds per call (median of GPU times on a device)."""
        if self.emu:
            fn()
            t0 = time.perf_counter()
            for _ in range(self.repeat):
                fn()
            return (time.perf_counter() - t0) / self.repeat
        from cupyx.profiler import benchmark
        r = benchmark(fn, n_repeat=self.repeat, n_warmup=3)
        return float(np.median(r.gpu_times[0]))


def copy_bandwidth(be, timer, nbytes) -> tuple[float, float]:
    """(seconds, GB/s read + write) of a device-to-device copy of nbytes (cudaMemcpyAsync)."""
    a = be.dev.alloc(nbytes)
    b = be.dev.alloc(nbytes)
    pa, pb = be.dev.ptr(a), be.dev.ptr(b)
    t = timer(lambda: be.dev.memcpy(pb, pa, nbytes))
    return t, 2 * nbytes / t / 1e9


def graph(be, outs, data: dict):
    """Allocate the contexts' leaves on be, fill them, run once; returns the compute nodes."""
    ctxs = {t.ctx for t in data}
    for c in ctxs:
        mg.alloc_ctx_tensors(c, be)
    for t, arr in data.items():
        t.set(arr)
    gf = mg.Graph()
    for o in outs:
        o.set_output()
        gf.build_forward_expand(o)
    be.graph_compute(gf)
    be.synchronize()
    return gf.nodes


@contextlib.contextmanager
def unchecked(be):
    """Skip the device-side index check (and its wait for the flag): the kernel alone."""
    be._check_indices = lambda *a: True
    try:
        yield
    finally:
        del be._check_indices


def rnd(rng, shape, dtype=np.float32):
    return rng.uniform(-1, 1, shape).astype(dtype)


def bench_ops(be, timer, scale: int, rng):
    """Yields (name, shape text, bytes moved, seconds, ok)."""
    # cont of a transposed square f32
    n = 4096 // scale
    ctx = mg.Context()
    x = ctx.new_tensor_2d(mg.f32, n, n)
    y = mg.cont(mg.transpose(x))
    x_np = rnd(rng, (n, n))
    nodes = graph(be, [y], {x: x_np})
    ok = np.array_equal(y.numpy(), x_np.T)
    yield "cont(transpose)", f"f32 {n}x{n}", 2 * n * n * 4, timer(lambda: be.compute_nodes(nodes)), ok

    # cpy of a transposed square f32 into an existing tensor
    ctx = mg.Context()
    x = ctx.new_tensor_2d(mg.f32, n, n)
    dst = ctx.new_tensor_2d(mg.f32, n, n)
    c = mg.cpy(mg.transpose(x), dst)
    nodes = graph(be, [c], {x: x_np, dst: np.zeros((n, n), np.float32)})
    ok = np.array_equal(dst.numpy(), x_np.T)
    yield "cpy(transpose)", f"f32 {n}x{n}", 2 * n * n * 4, timer(lambda: be.compute_nodes(nodes)), ok

    # concat along dim 0: conv history + new tokens, channels scaled up
    ch, n_t, n_s = 16384 // scale, 512 // scale, 4
    ctx = mg.Context()
    a = ctx.new_tensor_3d(mg.f32, 3, ch, n_s)
    b = ctx.new_tensor_3d(mg.f32, n_t, ch, n_s)
    cc = mg.concat(a, b, 0)
    a_np, b_np = rnd(rng, (n_s, ch, 3)), rnd(rng, (n_s, ch, n_t))
    nodes = graph(be, [cc], {a: a_np, b: b_np})
    ok = np.array_equal(cc.numpy(), np.concatenate([a_np, b_np], axis=2))
    yield "concat dim 0", f"f32 [3|{n_t}, {ch}, {n_s}]", 2 * cc.nelements() * 4, timer(lambda: be.compute_nodes(nodes)), ok

    # set_rows: the conv-state store (overlapping windows into permuted rollback slots)
    n_cols, K, n_seqs, n_new = 3, 4, 4, 4
    ch = 4096 * 64 // scale
    mem = n_seqs + 1
    kw = min(n_new, K)
    ctx = mg.Context()
    s = ctx.new_tensor_2d(mg.f32, n_cols * ch, mem * K)
    xc = ctx.new_tensor_3d(mg.f32, n_cols + n_new, ch, n_seqs)
    order = ctx.new_tensor_1d(mg.i32, kw)
    windows = mg.view_4d(xc, n_cols, kw, ch, n_seqs, 4, xc.nb[1], xc.nb[2], (n_new - kw + 1) * 4)
    slots = mg.view_4d(s, n_cols, K, ch, n_seqs, mem * s.nb[1], n_cols * 4, s.nb[1], s.nb[1])
    sr = mg.set_rows(slots, windows, order)
    s_np = rnd(rng, (mem * K, n_cols * ch))
    xc_np = rnd(rng, (n_seqs, ch, n_cols + n_new))
    order_np = np.arange(kw, dtype=np.int32)[::-1].copy()
    nodes = graph(be, [sr], {s: s_np, xc: xc_np, order: order_np})
    want = _reference_of(sr, s, {s: s_np, xc: xc_np, order: order_np})
    ok = np.array_equal(s.numpy(), want)
    nbytes = 2 * n_cols * kw * ch * n_seqs * 4
    shape = f"n_cols={n_cols} K={K} ch={ch} n_seqs={n_seqs}"
    yield "set_rows (conv store)", shape, nbytes, timer(lambda: be.compute_nodes(nodes)), ok
    with unchecked(be):
        yield "  same, no index check", shape, nbytes, timer(lambda: be.compute_nodes(nodes)), ok

    # get_rows: gather rows of a large table
    ne0, n_rows, n_get = 4096, 65536 // scale, 16384 // scale
    ctx = mg.Context()
    tab = ctx.new_tensor_2d(mg.f32, ne0, n_rows)
    ids = ctx.new_tensor_1d(mg.i32, n_get)
    gr = mg.get_rows(tab, ids)
    tab_np = rnd(rng, (n_rows, ne0))
    ids_np = rng.integers(0, n_rows, n_get).astype(np.int32)
    nodes = graph(be, [gr], {tab: tab_np, ids: ids_np})
    ok = np.array_equal(gr.numpy(), tab_np[ids_np])
    shape = f"f32 rows of {ne0}, {n_get} of {n_rows}"
    yield "get_rows", shape, 2 * n_get * ne0 * 4, timer(lambda: be.compute_nodes(nodes)), ok
    with unchecked(be):
        yield "  same, no index check", shape, 2 * n_get * ne0 * 4, timer(lambda: be.compute_nodes(nodes)), ok

    # ssm_conv
    d_conv, d_inner, n_t, n_s = 4, 4096 // scale, 512 // scale, 4
    ctx = mg.Context()
    sx = ctx.new_tensor_3d(mg.f32, d_conv - 1 + n_t, d_inner, n_s)
    w = ctx.new_tensor_2d(mg.f32, d_conv, d_inner)
    yc = mg.ssm_conv(sx, w)
    sx_np, w_np = rnd(rng, (n_s, d_inner, d_conv - 1 + n_t)), rnd(rng, (d_inner, d_conv))
    nodes = graph(be, [yc], {sx: sx_np, w: w_np})
    want = _reference_of(yc, yc, {sx: sx_np, w: w_np})
    ok = float(np.max(np.abs(yc.numpy() - want))) <= 1e-5
    nbytes = (sx.nelements() + yc.nelements() + w.nelements()) * 4
    yield "ssm_conv", f"d_conv={d_conv} d_inner={d_inner} n_t={n_t} n_s={n_s}", nbytes, \
        timer(lambda: be.compute_nodes(nodes)), ok


def _reference_of(out, read, data):
    """Run the graph of `out` on the reference backend with copies of the same leaf data, and
    return the contents of `read` (a leaf or out)."""
    from minigraph.registry import build
    ref = type(mg.backend("ref"))()
    mapping = {}   # the same graph rebuilt on fresh leaves

    def clone(t):
        if t.id in mapping:
            return mapping[t.id]
        if t.op == "NONE" and t.view_src is None:
            c = mg.Context()
            n = c.new_tensor(t.type, t.ne)
            mg.alloc_ctx_tensors(c, ref)
            n.set(data[t])
        else:
            n = build(t.op, **{k: clone(v) for k, v in t.srcs.items()}, **t.params)
        mapping[t.id] = n
        return n
    o = clone(out)
    gf = mg.Graph()
    gf.build_forward_expand(o)
    ref.graph_compute(gf)
    return mapping[read.id].numpy() if read is not out else o.numpy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emu", action="store_true", help="tiny sizes on the CPU emulator (no GPU needed)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.emu:
        from minigraph.backends.cuda.emu import EmuDevice
        be = CudaBackend(args.device, device=EmuDevice())
        scale, copy_bytes, repeat = 64, 1 << 20, 2
    else:
        be = mg.backend(f"cuda:{args.device}")
        scale, copy_bytes, repeat = 1, 256 << 20, args.repeat
    timer = Timer(args.emu, repeat)
    print(f"device: {be.name} ({be.dev.name})", flush=True)
    t, copy_gbs = copy_bandwidth(be, timer, copy_bytes)
    print(f"device-to-device copy of {copy_bytes >> 20} MiB: {t * 1e6:.1f} us, {copy_gbs:.1f} GB/s (read + write)",
          flush=True)
    rows = []
    failed = []
    for name, shape, nbytes, secs, ok in bench_ops(be, timer, scale, rng):
        gbs = nbytes / secs / 1e9
        rows.append((name, shape, nbytes / 2 ** 20, secs * 1e6, gbs, gbs / copy_gbs, "ok" if ok else "WRONG"))
        print(f"  {name}: {secs * 1e6:.1f} us, {gbs:.1f} GB/s, {'ok' if ok else 'WRONG RESULT'}", flush=True)
        if not ok:
            failed.append(name)
    head = ("op", "shape", "MiB moved", "us", "GB/s", "of copy", "check")
    table = [head] + [(r[0], r[1], f"{r[2]:.1f}", f"{r[3]:.1f}", f"{r[4]:.1f}", f"{r[5]:.0%}", r[6]) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    print()
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s (device-to-device copy of {copy_bytes >> 20} MiB, read + write)")
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if failed:
        print(f"WRONG RESULTS: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
