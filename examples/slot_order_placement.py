"""The three slot-order strategies on two devices: where each conv layer's order lives, what is
copied between the devices, and a drawing of the graph coloured by device.

    python examples/slot_order_placement.py [--model toy] [--png placement.png]

per-layer (llama.cpp's conv-state store refactor) builds the order next to every set_rows: no copies. shared-first-layer
builds one on the first conv layer's device: every layer elsewhere copies its tail view.
host-input fills one input on the host: each other device copies it once."""
from __future__ import annotations

import argparse

import minigraph as mg
from minigraph.models.graph import SLOT_ORDERS
from minigraph.models.runner import Runner
from minigraph.models.zoo import layer_devices, make_model


def schedule_one_ubatch(model, devices, strategy, n_rs_seq=3, n_tokens=4):
    """Build and schedule one prefill ubatch's graph (no compute) under a slot-order strategy."""
    runner = Runner(model, mem_size=2, n_rs_seq=n_rs_seq, slot_order=strategy, backends=devices, reuse=False)
    return runner.schedule_only({0: list(range(n_tokens))})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="toy")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--png", default=None, help="also draw the host-input graph (DOT beside it)")
    args = ap.parse_args(argv)
    devices = [mg.backend("cpu:1"), mg.backend("cpu:0")]          # priority order, host last
    model = make_model(args.model, devices, n_layer=args.layers)
    print(f"{args.model}: layers on {[d.name for d in layer_devices(devices, args.layers)]}")
    print(f"{'strategy':20s} {'slot-order copies':>17s} {'all copies':>10s}  slot-order copies (tensor: from -> to, splits)")
    results = {}
    for strategy in SLOT_ORDERS:
        res = schedule_one_ubatch(model, devices, strategy)
        rep = res.sched.placement_report()
        slot = [c for c in rep.copies if "slot" in c.tensor]
        results[strategy] = (res, slot)
        desc = "; ".join(f"{c.tensor}: {c.src_device} -> {c.dst_device}, {c.used_by_splits}" for c in slot) or "-"
        print(f"{strategy:20s} {len(slot):17d} {rep.n_copies:10d}  {desc}")
    if args.png:
        try:
            files = mg.draw(results["host-input"][0].gf, args.png)
            print("wrote", ", ".join(files))
        except RuntimeError as e:          # no Graphviz and no matplotlib: the DOT is still there
            print(f"no PNG: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
