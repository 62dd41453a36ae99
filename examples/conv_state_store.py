"""Run the conv-state store (models/conv_state.py) and print which window landed in which rollback slot.

    python examples/conv_state_store.py [--device cpu|ref] [--n 5] [--n-cols 3] [--n-rs-seq 2]

Each conv_x column holds its own column number (plus 1000*channel and 0.1*seq, so nothing is
zero), so a slot's contents say which columns it received."""
from __future__ import annotations

import argparse

import numpy as np

import minigraph as mg
from minigraph.models.conv_state import conv_state_store


def default_device() -> str:
    try:
        mg.backend("cpu")
        return "cpu"
    except Exception:       # the C extension is not built: fall back to the NumPy reference
        return "ref"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="ref, cpu, cpu:N (default: cpu when built)")
    ap.add_argument("--n", type=int, nargs="+", default=[5, 1], help="tokens per sequence in each ubatch")
    ap.add_argument("--n-cols", type=int, default=3, help="conv history columns (d_conv - 1)")
    ap.add_argument("--n-rs-seq", type=int, default=2, help="rollback depth; K = n_rs_seq + 1 slots")
    ap.add_argument("--channels", type=int, default=2)
    ap.add_argument("--n-seqs", type=int, default=2)
    ap.add_argument("--mem-size", type=int, default=4)
    ap.add_argument("--head", type=int, default=1)
    args = ap.parse_args(argv)
    be = mg.backend(args.device or default_device())
    K = args.n_rs_seq + 1
    nc, ch, ns, mem, head = args.n_cols, args.channels, args.n_seqs, args.mem_size, args.head
    if head + ns > mem:
        ap.error(f"head + n_seqs = {head + ns} exceeds mem_size {mem}")

    wctx = mg.Context()
    s = wctx.new_tensor_2d(mg.f32, nc * ch, mem * K).set_name("r_l")      # the layer's r cache
    mg.alloc_ctx_tensors(wctx, be)
    s.set(np.full((mem * K, nc * ch), -1.0, np.float32))                  # -1 = never written

    print(f"device {be.name}: n_cols={nc}, channels={ch}, n_seqs={ns}, mem_size={mem}, head={head}, "
          f"n_rs_seq={args.n_rs_seq} (K={K})")
    ok = True
    for n in args.n:
        ctx = mg.Context()
        conv_x = ctx.new_tensor_3d(mg.f32, nc + n, ch, ns).set_name("conv_x")
        gf = mg.Graph()
        conv_state_store(gf, s, conv_x, nc, 0, head, mem, args.n_rs_seq)
        mg.alloc_ctx_tensors(ctx, be)
        col = np.arange(nc + n, dtype=np.float32)
        x = col[None, None, :] + 1000 * np.arange(ch)[None, :, None] + 0.1 * (1 + np.arange(ns))[:, None, None]
        conv_x.set(x.astype(np.float32))
        be.graph_compute(gf)

        Kw = min(n, K) if args.n_rs_seq > 0 else 1
        print(f"\nubatch n={n}: Kw={Kw}, slot order {list(range(Kw - 1, -1, -1))}, "
              f"windows start at columns {[n - (Kw - 1) + w for w in range(Kw)] if args.n_rs_seq else [n]}")
        state = s.numpy()                        # [mem*K, nc*ch]
        for j in range(K):
            for q in range(ns):
                row = state[j * mem + head + q].reshape(ch, nc)[0]    # channel 0's columns
                what = "untouched" if np.all(row == -1) else f"columns {int(row[0])}..{int(row[-1])}"
                expect = f"columns {n - j}..{n - j + nc - 1}" if j < Kw else None
                mark = "" if j < Kw or what == "untouched" else "  (stale: not written by this ubatch)"
                if expect is not None and what != expect:
                    mark, ok = f"  MISMATCH (expected {expect})", False
                print(f"  slot {j} ({j} tokens back) seq {q}: row {j * mem + head + q}: {what}{mark}")
    print("\nall slots as predicted (slot j = the n_cols columns ending j tokens before the end)" if ok
          else "\nMISMATCH: a slot does not hold the n_cols columns ending j tokens before the end")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
