"""minigraph placement: where each conv layer's slot order lives, every cross-device copy with the
reason it exists, the all-reduces of meta devices, and a drawing of the scheduled graph."""
from __future__ import annotations

import re

from .args import writable_path
from .errors import FAILED, fail
from .output import emit_json
from .session import add_model_flags, make_runner, setup
from .transfers import planned_allreduces

# --focus presets: a name for a part of the graph -> how to find its nodes
FOCUS_PRESETS = {
    "conv-store": "the conv state stores (SET_ROWS/CPY into cache_r_l*) and their slot orders",
    "copies": "the nodes that read a cross-device copy",
}


def add_parser(sub):
    p = sub.add_parser("placement", help="where each conv layer's slot order lives and what is copied",
                       description="Schedule one ubatch's graph and report where each tensor runs, "
                       "every cross-device copy and why it exists, and the all-reduces of meta devices.")
    add_model_flags(p)
    p.add_argument("--compare", action="store_true", help="the three slot-order strategies side by side")
    p.add_argument("--dot", default=None, metavar="FILE", help="write the scheduled graph as DOT")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="write the scheduled graph as PNG (with Graphviz's dot, else matplotlib); its DOT "
                        "source is written beside it as FILE with .dot for .png, and both are named")
    p.add_argument("--focus", default=None, metavar="PART",
                   help="draw only part of the graph (with each node's direct neighbours): "
                        + "; ".join(f"{k}: {v}" for k, v in FOCUS_PRESETS.items())
                        + "; anything else is a regular expression on node names")
    p.add_argument("--verbose", action="store_true", help="also list every node's device and cause")
    p.add_argument("--compare-ggml", action="store_true",
                   help="also ask ggml's own scheduler (ggml_backend_sched) to place the same graph over the same "
                        "devices (ggml devices only, ending with ggml:cpu) and list every node it places "
                        "differently, with minigraph's cause, and both split and copy counts")
    p.set_defaults(fn=cmd_placement)


def _check_drawing_flags(args):
    writable_path("--dot", args.dot)
    writable_path("--png", args.png)
    if args.png and not args.png.endswith(".png"):
        fail(f"--png {args.png}: the file name must end in .png")
    if args.focus and not (args.dot or args.png):
        fail("--focus: only with --dot or --png (it chooses what is drawn)")
    if args.focus and args.focus not in FOCUS_PRESETS:
        try:
            re.compile(args.focus)
        except re.error as e:
            fail(f"--focus {args.focus!r}: neither a preset ({', '.join(FOCUS_PRESETS)}) nor a valid "
                 f"regular expression ({e})")
    if args.png:
        from minigraph.draw import png_tool
        if png_tool() is None:
            fail("--png: needs Graphviz's dot program (apt-get install graphviz) or matplotlib "
                 "(pip install 'minigraph[viz]'); --dot writes the DOT text without either")


def focus_ids(gf, sched, focus: str) -> set:
    """The tensor ids --focus names."""
    if focus == "conv-store":
        ids = set()
        for n in gf.nodes:
            if n.op in ("SET_ROWS", "CPY") and n.view_src is not None and \
                    (n.view_src.name or "").startswith("cache_r_l"):
                ids.add(n.id)
                ids.update(s.id for s in n.srcs.values())
        return ids
    if focus == "copies":
        return {n.id for n in gf.nodes if n.id in sched.replaced}
    rx = re.compile(focus)
    return {t.id for t in gf.leafs + gf.nodes if rx.search(t.name or t.label)}


def _placement(model, devices, args, strategy):
    r = make_runner(model, devices, args, reuse=False)
    r.slot_order = strategy
    res = r.schedule_only({0: list(range(min(args.ubatch, 4)))})
    sched = res.sched
    rep = sched.placement_report()
    layers = []
    for n in res.gf.nodes:
        if n.op != "SET_ROWS" and n.op != "CPY":
            continue
        dst = n.view_src
        if dst is None or not dst.name.startswith("cache_r_l"):
            continue
        order = sched.scheduled.srcs_of(n).get("c")   # the copy it reads, under this schedule
        info = {"layer": dst.name, "store_device": sched.backend_of(n).name}
        if order is None:
            info.update(slot_order="", order_device="", copied=False, copy="")
        else:
            orig = sched.copy_src.get(order.id, order)
            info.update(slot_order=orig.name or orig.label, order_device=sched.backend_of(orig).name,
                        copied=orig is not order, copy=order.name if orig is not order else "")
        layers.append(info)
    kv_stores, kq_masks = _kv_placement(res.gf, sched)
    slot_copies = [c for c in rep.copies if c.reason == "slot order"]
    n_reduce, reduce_bytes = planned_allreduces(devices, res.gf, sched.scheduled)
    return res, rep, {
        "slot_order_copies": len(slot_copies), "copies": rep.n_copies, "copy_bytes": rep.copy_bytes,
        "all_reduces": n_reduce, "all_reduce_bytes": reduce_bytes,
        "transfers": rep.n_copies + n_reduce, "transfer_bytes": rep.copy_bytes + reduce_bytes,
        "splits": len(rep.splits), "layers": layers, "kv_stores": kv_stores, "kq_masks": kq_masks,
        "slot_order_copy_list": [{"copy": c.copy, "tensor": c.tensor, "src_device": c.src_device,
                                  "dst_device": c.dst_device, "nbytes": c.nbytes,
                                  "used_by_splits": c.used_by_splits} for c in slot_copies],
    }


def _read_as(sched, n, role: str) -> dict:
    """What node n reads as `role` under the schedule: the tensor's name, where it was made, and
    the copy it reads when the two devices differ."""
    got = sched.scheduled.srcs_of(n).get(role)
    if got is None:
        return {"name": "", "device": "", "copied": False, "copy": ""}
    orig = sched.copy_src.get(got.id, got)
    return {"name": orig.name or orig.label, "device": sched.backend_of(orig).name,
            "copied": orig is not got, "copy": got.name if orig is not got else ""}


def _kv_placement(gf, sched) -> tuple[list, list]:
    """The attention layers' KV writes (SET_ROWS into cache_k_l* / cache_v_l*, with the index
    input each reads) and their masks (each SOFT_MAX reading inp_kq_mask), per device."""
    stores, masks = [], []
    for n in gf.nodes:
        dst = n.view_src if n.op == "SET_ROWS" else None
        name = (dst.name or "") if dst is not None else ""
        if name.startswith(("cache_k_l", "cache_v_l")):
            stores.append({"tensor": name, "store_device": sched.backend_of(n).name, "idxs": _read_as(sched, n, "c")})
        if n.op == "SOFT_MAX":
            m = _read_as(sched, n, "mask")
            if m["name"].startswith("inp_kq_mask"):
                masks.append({"node": n.name or n.label, "device": sched.backend_of(n).name, "mask": m})
    return stores, masks


def _from(x: dict) -> str:
    return f"{x['name']} from {x['device']}" + (f", copied as {x['copy']}" if x["copied"] else ", not copied")


def _draw(res, args) -> list:
    from minigraph.draw import draw
    only = focus_ids(res.gf, res.sched.scheduled, args.focus) if args.focus else None
    if only is not None and not only:
        fail(f"--focus {args.focus!r}: no node of this graph matches")
    written = []
    for path in filter(None, [args.dot, args.png]):
        try:
            written += [p for p in draw(res.gf, path, sched=res.sched, only=only) if p not in written]
        except (RuntimeError, OSError) as e:
            fail(f"drawing {path}: {e}", FAILED)
    return written


def cmd_placement(args):
    from minigraph.models.graph import SLOT_ORDERS
    _check_drawing_flags(args)
    devices, model, label = setup(args, runners=3 if args.compare else 1, max_tokens=4)
    strategies = list(SLOT_ORDERS) if args.compare else [args.slot_order]
    results = {s: _placement(model, devices, args, s) for s in strategies}
    written = _draw(results[strategies[0]][0], args) if (args.dot or args.png) else []
    if args.json:
        common = {"model": label, "gguf": args.gguf or "", "devices": [d.name for d in devices], "files_written": written}
        if args.compare:
            emit_json("placement", {**common, "strategies": {s: v[2] for s, v in results.items()}})
        else:
            s = strategies[0]
            res, rep, summary = results[s]
            meta = [d.split_report(res.gf, res.sched) for d in devices if hasattr(d, "split_report")]
            emit_json("placement", {**common, "slot_order": s, **summary, "report": rep.to_dict(),
                                    "split_states": meta})
        return 0
    for s in strategies:
        res, rep, summary = results[s]
        print(f"== {label}, slot order {s}: {summary['splits']} splits, {summary['transfers']} transfers "
              f"({summary['transfer_bytes']} bytes): {summary['copies']} copies ({summary['copy_bytes']} bytes, "
              f"{summary['slot_order_copies']} of them slot-order copies), {summary['all_reduces']} all-reduces "
              f"({summary['all_reduce_bytes']} bytes)")
        for L in summary["layers"]:
            where = "no slot order (n_rs_seq = 0)" if not L["slot_order"] else \
                f"slot order {L['slot_order']} on {L['order_device']}" + (f", copied as {L['copy']}" if L["copied"] else ", not copied")
            print(f"  {L['layer']:14s} store on {L['store_device']:7s} {where}")
        for K in summary["kv_stores"]:
            print(f"  {K['tensor']:14s} store on {K['store_device']:7s} index {_from(K['idxs'])}")
        for M in summary["kq_masks"]:
            print(f"  {'kq_mask':14s} read on {M['device']:8s} by {M['node']}: {_from(M['mask'])}")
        if not args.compare:
            print(rep.format(nodes=args.verbose))
            if rep.copies:
                print("why copies exist: " + "; ".join(f"{k}: {v}" for k, v in _reasons_used(rep).items()))
            for d in devices:          # meta devices: every tensor's split state and the all-reduces
                if hasattr(d, "format_split_report"):
                    print(d.format_split_report(res.gf, res.sched))
    if args.compare:
        print(f"\n{'strategy':20s} {'slot-order copies':>18s} {'copies':>7s} {'all-reduces':>12s} {'bytes':>8s}")
        for s in strategies:
            sm = results[s][2]
            print(f"{s:20s} {sm['slot_order_copies']:18d} {sm['copies']:7d} {sm['all_reduces']:12d} "
                  f"{sm['transfer_bytes']:8d}")
    if args.compare_ggml:
        for s in strategies:
            res = results[s][0]
            print(f"== ggml's scheduler, slot order {s}")
            print(compare_with_ggml(res, devices))
    for path in written:
        print(f"wrote {path}")
    return 0


def compare_with_ggml(res, devices) -> str:
    from minigraph.backends.ggml.sched_compare import compare
    from minigraph.errors import OpError
    try:
        return compare(res.gf, res.sched.scheduled, devices).format()
    except OpError as e:
        fail(str(e))


def _reasons_used(rep) -> dict:
    from minigraph.report import COPY_REASONS
    return {c.reason: COPY_REASONS.get(c.reason, "") for c in rep.copies}



