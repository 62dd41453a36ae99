"""The `minigraph` command: run a tiny recurrent model with speculative drafts and rollbacks,
show where slot-order tensors land, experiment with graph reuse, check ops, run benchmarks."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def _fail(msg: str, code: int = 2):
    print(f"minigraph: error: {msg}", file=sys.stderr)
    raise SystemExit(code)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block), exit status 2."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _int_at_least(low: int):
    """An argparse type: an integer >= low, else a one-line error naming the rule."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def _common(p, model=True):
    if model:
        p.add_argument("model", help="mamba2, delta-net, lfm, kda (or toy)")
    p.add_argument("--devices", default="cpu", help="comma-separated devices in priority order, the host last "
                   "(default: cpu); layers are split over them in order")
    p.add_argument("--n-rs-seq", type=_int_at_least(0), default=3, help="rollback depth (K = n_rs_seq + 1 slots)")
    p.add_argument("--slot-order", default="per-layer", choices=["per-layer", "shared-first-layer", "host-input"])
    p.add_argument("--ubatch", type=_int_at_least(1), default=8, help="tokens per ubatch")
    p.add_argument("--threads", type=_int_at_least(0), default=0, help="CPU threads (default: all cores)")
    p.add_argument("--layers", type=_int_at_least(0), default=0, help="number of layers (default: the model's)")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--gguf", default=None, help="load weights from a GGUF file")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _setup(args):
    from minigraph.models.zoo import UsageError, make_model, parse_devices
    if args.gguf and not os.path.isfile(args.gguf):
        _fail(f"--gguf {args.gguf}: no such file")
    try:
        devices = parse_devices(args.devices)
        if args.threads:
            for d in devices:
                if hasattr(d, "set_n_threads"):
                    d.set_n_threads(args.threads)
        kw = {"n_layer": args.layers} if args.layers else {}
        model = make_model(args.model, devices, seed=args.seed, gguf=args.gguf, **kw)
    except UsageError as e:
        _fail(str(e))
    for d in devices:                  # a meta device splits the model by heads where it can
        if hasattr(d, "set_split_state"):
            from minigraph.backends.meta import recipe_for
            d.set_split_state(recipe_for(model))
    return devices, model


def _runner(model, devices, args, **kw):
    from minigraph.models.runner import Runner
    return Runner(model, mem_size=2, n_rs_seq=args.n_rs_seq, n_ubatch=args.ubatch,
                  slot_order=args.slot_order, backends=devices, **kw)


def _state_bytes(runner) -> bytes:
    out = b""
    for il in runner.model.layers:
        for t in (runner.memory.r_l.get(il), runner.memory.s_l.get(il)):
            if t is not None:
                out += t.numpy()[: runner.memory.size].tobytes()   # plane 0: the live state
    return out


# -- run -------------------------------------------------------------------------------------
def cmd_run(args):
    from minigraph.models.runner import DecodeError
    devices, model = _setup(args)
    n_vocab = model.n_vocab
    rng = np.random.default_rng(args.seed)
    r = _runner(model, devices, args)
    draft = args.draft if args.draft is not None else max(r.n_rs_seq, 1)
    prompt = [int(x) for x in rng.integers(0, n_vocab, 8)]
    accepted = list(prompt)
    chunks = [list(prompt)]          # the ubatches a run that never saw a rejected token decodes
    t0 = time.perf_counter()
    r.decode_seq_tokens({0: prompt})
    progress = args.steps >= 50 and not args.json
    for step in range(args.steps):
        d = int(rng.integers(1, draft + 1))
        toks = [int(x) for x in rng.integers(0, n_vocab, d)]
        n_accept = int(rng.integers(1, d + 1))
        r.decode_seq_tokens({0: toks})
        k = d - n_accept
        if k > 0 and not r.rollback(0, k):
            if not args.reeval:
                _fail(f"rollback of {k} tokens refused: {r.memory.last_refusal} "
                      f"(use --draft <= --n-rs-seq, or --reeval to re-evaluate from scratch)", 1)
            r.memory.seq_rm(0, -1, -1)                 # re-evaluate the accepted history
            r.prev = None
            r.decode_seq_tokens({0: accepted + toks[:n_accept]})
            chunks = [accepted + toks[:n_accept]]
        else:
            chunks.append(toks[:n_accept])
        accepted += toks[:n_accept]
        if progress and (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  step {step + 1}/{args.steps}: {len(accepted)} tokens accepted", file=sys.stderr)
    elapsed = time.perf_counter() - t0
    last = r.decode_seq_tokens({0: [0]})[0]
    # the state check: a run that never saw a rejected token (same ubatches otherwise, so the
    # same kernels run on the same shapes) must end in the same state, bit for bit
    ref = _runner(model, devices, args)
    try:
        for c in chunks:
            ref.decode_seq_tokens({0: c})
        ref_last = ref.decode_seq_tokens({0: [0]})[0]
        ok = np.array_equal(last, ref_last) and _state_bytes(r) == _state_bytes(ref)
    except DecodeError:
        ok = False
    st = r.stats
    n_steps = max(1, len(st.copies))
    out = {
        "model": args.model, "devices": [d.name for d in devices], "n_rs_seq": r.n_rs_seq,
        "slot_order": args.slot_order, "steps": args.steps,
        "tokens": st.tokens, "tokens_accepted": len(accepted), "seconds": elapsed,
        "tokens_per_s": st.tokens / elapsed if elapsed > 0 else 0.0,
        "builds": st.builds, "reuses": st.reuses,
        "copies_per_step": sum(c for c, _ in st.copies) / n_steps,
        "copy_bytes_per_step": sum(b for _, b in st.copies) / n_steps,
        "rollbacks": st.rollbacks, "rollbacks_refused": st.rollbacks_refused,
        "state_check": "pass" if ok else "fail",
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.model} on {','.join(out['devices'])}: n_rs_seq={r.n_rs_seq}, slot order {args.slot_order}")
        print(f"  tokens decoded      {st.tokens} ({len(accepted)} accepted) in {elapsed:.2f} s = {out['tokens_per_s']:.1f} tokens/s")
        print(f"  graphs              {st.builds} builds, {st.reuses} reuses")
        print(f"  cross-device copies {out['copies_per_step']:.1f} per step, {out['copy_bytes_per_step']:.0f} bytes per step")
        print(f"  rollbacks           {st.rollbacks} done, {st.rollbacks_refused} refused")
        print(f"  state check         {out['state_check']} (against a run that saw only the accepted tokens)")
    return 0 if ok else 1


# -- placement -------------------------------------------------------------------------------
def _placement(model, devices, args, strategy):
    r = _runner(model, devices, args, reuse=False)
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
            info.update(slot_order=None, order_device=None, copied=False)
        else:
            orig = sched.copy_src.get(order.id, order)
            info.update(slot_order=orig.name or orig.label, order_device=sched.backend_of(orig).name,
                        copied=orig is not order, copy=order.name if orig is not order else None)
        layers.append(info)
    slot_copies = [c for c in rep.copies if "slot" in c.tensor]
    return res, rep, layers, {
        "slot_order_copies": len(slot_copies), "copies": rep.n_copies, "copy_bytes": rep.copy_bytes,
        "splits": len(rep.splits), "layers": layers,
        "slot_order_copy_list": [{"tensor": c.tensor, "src_device": c.src_device, "dst_device": c.dst_device,
                                  "nbytes": c.nbytes, "used_by_splits": c.used_by_splits} for c in slot_copies],
    }


def cmd_placement(args):
    import minigraph as mg
    from minigraph.models.graph import SLOT_ORDERS
    devices, model = _setup(args)
    strategies = list(SLOT_ORDERS) if args.compare else [args.slot_order]
    results = {}
    for s in strategies:
        res, rep, layers, summary = _placement(model, devices, args, s)
        results[s] = (res, rep, summary)
    if args.dot or args.png:
        res = results[strategies[0]][0]
        for path in filter(None, [args.dot, args.png]):
            try:
                mg.draw(res.gf, path)
            except RuntimeError as e:
                _fail(str(e), 1)
    if args.json:
        if args.compare:
            print(json.dumps({"model": args.model, "devices": [d.name for d in devices],
                              "strategies": {s: v[2] for s, v in results.items()}}))
        else:
            s = strategies[0]
            meta = [d.split_report(results[s][0].gf, results[s][0].sched) for d in devices if hasattr(d, "split_report")]
            print(json.dumps({"model": args.model, "devices": [d.name for d in devices], "slot_order": s,
                              **results[s][2], "report": results[s][1].to_dict(),
                              **({"split_states": meta} if meta else {})}))
        return 0
    for s in strategies:
        res, rep, summary = results[s]
        print(f"== {args.model}, slot order {s}: {summary['splits']} splits, {summary['copies']} copies "
              f"({summary['copy_bytes']} bytes), {summary['slot_order_copies']} of them slot-order copies")
        for L in summary["layers"]:
            where = "no slot order (n_rs_seq = 0)" if L["slot_order"] is None else \
                f"slot order {L['slot_order']} on {L['order_device']}" + (f", copied as {L['copy']}" if L["copied"] else ", not copied")
            print(f"  {L['layer']:14s} store on {L['store_device']:7s} {where}")
        if not args.compare:
            print(rep.format(nodes=args.verbose))
            for d in devices:          # meta devices: every tensor's split state and the all-reduces
                if hasattr(d, "format_split_report"):
                    print(d.format_split_report(res.gf, res.sched))
    if args.compare:
        print(f"\n{'strategy':20s} {'slot-order copies':>18s} {'copies':>7s} {'bytes':>8s}")
        for s in strategies:
            sm = results[s][2]
            print(f"{s:20s} {sm['slot_order_copies']:18d} {sm['copies']:7d} {sm['copy_bytes']:8d}")
    return 0


# -- reuse -----------------------------------------------------------------------------------
def cmd_reuse(args):
    from minigraph.models.runner import ReuseMismatch
    devices, model = _setup(args)
    rng = np.random.default_rng(args.seed)
    stream = [[int(x) for x in rng.integers(0, model.n_vocab, 6)]]
    for i in range(args.steps):
        stream.append([int(x) for x in rng.integers(0, model.n_vocab, 2 if i % 7 == 6 else 1)])
    out, first_diff = {}, None
    for mode in ("reuse", "rebuild", "validated"):
        r = _runner(model, devices, args, reuse=mode != "rebuild", validate=mode == "validated", atomic=False)
        times = []
        try:
            for toks in stream:
                t0 = time.perf_counter()
                r.decode_seq_tokens({0: toks})
                times.append(time.perf_counter() - t0)
        except ReuseMismatch as e:
            first_diff = str(e)
        exec_t = []
        for _ in range(5):
            t0 = time.perf_counter()
            r.prev.sched.graph_compute(r.prev.gf)
            exec_t.append(time.perf_counter() - t0)
        host = max(float(np.median(times[1:])) - float(np.median(exec_t)), 0.0)
        out[mode] = {"builds": r.stats.builds, "reuses": r.stats.reuses, "host_ms_per_step": host * 1e3,
                     "step_ms": float(np.median(times[1:])) * 1e3}
    res = {"model": args.model, "steps": len(stream), "builds": out["reuse"]["builds"],
           "reuses": out["reuse"]["reuses"], "host_ms_per_step_reuse": out["reuse"]["host_ms_per_step"],
           "host_ms_per_step_rebuild": out["rebuild"]["host_ms_per_step"],
           "validator": "fail" if first_diff else "pass", "first_difference": first_diff, "modes": out}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{args.model}: {len(stream)} ubatches (decode steps, a 2-token step every 7th forces a new shape)")
        print(f"{'mode':10s} {'builds':>7s} {'reuses':>7s} {'step ms':>8s} {'host ms':>8s}")
        for m, v in out.items():
            print(f"{m:10s} {v['builds']:7d} {v['reuses']:7d} {v['step_ms']:8.3f} {v['host_ms_per_step']:8.3f}")
        print(f"validator: {res['validator']}" + (f" — {first_diff}" if first_diff else " (reuse on == fresh build, bit for bit)"))
    return 0 if not first_diff else 1


# -- check -----------------------------------------------------------------------------------
CHECK_COLUMNS = ("ref", "cpu", "cuda:0", "ggml")     # "ggml": real ggml, the oracle


def _check_columns(names):
    """Each asked column -> what runs it (a backend, or the ggml oracle module) or, for a column
    that cannot run here, the reason as a string. A name that is no device at all is a usage error."""
    import minigraph as mg
    out = {}
    for name in names:
        if name == "ggml":
            try:
                from minigraph.testing import ggml_oracle
                out[name] = ggml_oracle
            except Exception as e:        # libggml-python missing or its libraries do not load
                out[name] = f"{type(e).__name__}: {e}"
            continue
        try:
            be = mg.backend(name)
        except ValueError as e:           # bad syntax or unknown kind: the user's typo
            _fail(f"bad backend {name!r} in --backends: {e}")
        except Exception as e:            # a known kind this machine cannot run (no GPU, no extension)
            out[name] = f"{type(e).__name__}: {e}"
            continue
        out[be.name] = be
    return out


def _check_cell(case, col, runner, ref, seeds) -> bool | None:
    """True: every seed agrees with the reference; False: one does not (or raises); None: the
    case is not meant for this column (real ggml refuses it)."""
    from minigraph.testing.op_cases import compare, run_built
    if col == "ggml" and not case.ggml:
        return None
    for seed in range(seeds):
        try:
            want = run_built(case.make(np.random.default_rng(seed)), ref)
            b = case.make(np.random.default_rng(seed))
            got = runner.run_in_ggml(b) if col == "ggml" else run_built(b, runner)
            limit = None if case.exact else max(case.nmse, 1e-10)
            if compare(case, b, got, want, nmse_limit=limit) is not None:
                return False
        except Exception:
            return False
    return True


def cmd_check(args):
    import minigraph as mg
    from minigraph.testing.op_cases import CASES
    asked = args.backends is not None
    names = [n.strip() for n in (args.backends or ",".join(CHECK_COLUMNS)).split(",") if n.strip()]
    if not names:
        _fail("--backends is empty")
    columns = _check_columns(names)
    runners = {c: r for c, r in columns.items() if not isinstance(r, str)}
    not_run = {c: r for c, r in columns.items() if isinstance(r, str)}
    ref = mg.backend("ref")
    rows, n_fail = [], 0
    for case in CASES:
        cells = [_check_cell(case, col, runner, ref, args.seeds) for col, runner in runners.items()]
        n_fail += sum(c is False for c in cells)
        rows.append((case.id, cells))
    cols = list(runners)
    if args.json:
        print(json.dumps({"columns": cols, "rows": {cid: c for cid, c in rows}, "failed": n_fail,
                          "not_run": not_run}))
    else:
        w = max(len(cid) for cid, _ in rows)
        if cols:
            print(f"{'case':{w}s}  " + "  ".join(f"{c:6s}" for c in cols))
            mark = {True: "ok", False: "FAIL", None: "-"}
            for cid, cells in rows:
                print(f"{cid:{w}s}  " + "  ".join(f"{mark[c]:6s}" for c in cells))
        print(f"{len(rows)} cases x {len(cols)} columns, {n_fail} failed"
              + (f", {len(not_run)} not run" if not_run else ""))
        for col, why in not_run.items():
            print(f"not run: {col}: {why}")
    if asked and not_run:             # the user named a backend this machine cannot run
        print(f"minigraph: error: could not run {', '.join(not_run)} (asked for with --backends)", file=sys.stderr)
        return 1
    return 0 if n_fail == 0 else 1


# -- bench -----------------------------------------------------------------------------------
def cmd_bench(args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = [args.only + ".py"] if args.only else ["ops.py", "models.py", "reuse.py"]
    scripts = [os.path.join(root, "bench", n) for n in names]
    scripts = [s for s in scripts if os.path.exists(s)]
    if not scripts:
        _fail("the benchmarks live in the source tree's bench/ folder; run from a checkout installed with pip install -e .", 1)
    rc = 0
    for s in scripts:
        print(f"== {os.path.relpath(s, root)}", flush=True)
        rc |= subprocess.call([sys.executable, s] + (["--quick"] if args.quick else []))
    return rc


def main(argv=None) -> int:
    ap = _Parser(prog="minigraph", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="decode a synthetic stream with speculative drafts and rollbacks")
    _common(p)
    p.add_argument("--draft", type=_int_at_least(1), default=None, help="max draft length (default: n_rs_seq)")
    p.add_argument("--steps", type=_int_at_least(0), default=20)
    p.add_argument("--reeval", action="store_true", help="on a refused rollback, re-evaluate from scratch instead of failing")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("placement", help="where each conv layer's slot order lives and what is copied")
    _common(p)
    p.add_argument("--compare", action="store_true", help="the three slot-order strategies side by side")
    p.add_argument("--dot", default=None, help="write the scheduled graph as DOT")
    p.add_argument("--png", default=None, help="write the scheduled graph as PNG")
    p.add_argument("--verbose", action="store_true", help="also list every node's device and cause")
    p.set_defaults(fn=cmd_placement)
    p = sub.add_parser("reuse", help="graph reuse on, off and validated")
    _common(p)
    p.add_argument("--steps", type=_int_at_least(1), default=30)
    p.set_defaults(fn=cmd_reuse)
    p = sub.add_parser("check", help="the op table on every available backend and real ggml")
    p.add_argument("--backends", default=None, help="comma-separated columns, e.g. ref,cpu,cuda:0,ggml "
                   "(ggml: real ggml); default: all, and those this machine cannot run are listed as "
                   "not run; a named one that cannot run makes the exit status 1")
    p.add_argument("--seeds", type=_int_at_least(1), default=2)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("bench", help="the op, model and reuse benchmarks")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["ops", "models", "reuse"], default=None)
    p.set_defaults(fn=cmd_bench)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except SystemExit:
        raise
    except Exception as e:            # one clear line, not a traceback
        if os.environ.get("MINIGRAPH_TRACEBACK"):
            raise
        print(f"minigraph: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
