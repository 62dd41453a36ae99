"""minigraph reuse: graph reuse on, off and validated on the same stream, the reason for every
rebuild, and (validated) the first node whose bytes differ when a reused graph goes wrong."""
from __future__ import annotations

import time
from collections import Counter

import numpy as np

from .args import int_at_least
from .errors import FAILED
from .output import emit_json, finite
from .session import add_model_flags, make_runner, setup

MODES = ("reuse", "rebuild", "validated")


def add_parser(sub):
    p = sub.add_parser("reuse", help="graph reuse on, off and validated, with the reason for every rebuild",
                       description="Decode the same stream three times: reusing graphs, rebuilding every "
                       "ubatch, and reusing with every reused step checked against a fresh build. Prints "
                       "builds, reuses, host time per step, why each graph was rebuilt, and the validator's "
                       "verdict (on a mismatch: the first node whose bytes differ).")
    add_model_flags(p)
    p.add_argument("--steps", type=int_at_least(1), default=30,
                   help="decode steps after the prompt (default 30; every 7th is 2 tokens, a new shape)")
    p.set_defaults(fn=cmd_reuse)


def _median_ms(times) -> float:
    return finite(np.median(times)) * 1e3 if len(times) else 0.0


def _run_mode(model, devices, args, mode, stream):
    from minigraph.models.runner import ReuseMismatch
    r = make_runner(model, devices, args, reuse=mode != "rebuild", validate=mode == "validated", atomic=False)
    times, mismatch = [], ""
    try:
        for toks in stream:
            t0 = time.perf_counter()
            r.decode_seq_tokens({0: toks})
            times.append(time.perf_counter() - t0)
    except ReuseMismatch as e:
        mismatch = str(e)
    exec_t = []
    if r.prev is not None:            # the last graph, run again alone: the execution time
        for _ in range(5):
            t0 = time.perf_counter()
            r.prev.sched.graph_compute(r.prev.gf)
            exec_t.append(time.perf_counter() - t0)
    step_ms = _median_ms(times[1:])
    host_ms = max(step_ms - _median_ms(exec_t), 0.0) if exec_t else 0.0
    reasons = Counter(r.stats.rebuild_reasons)
    return {"builds": r.stats.builds, "reuses": r.stats.reuses, "host_ms_per_step": host_ms,
            "step_ms": step_ms, "decode_calls_done": len(times), "ubatches": r.stats.ubatches,
            "rebuild_reasons": [{"reason": k, "count": v} for k, v in reasons.items()]}, mismatch


def cmd_reuse(args):
    devices, model, label = setup(args, runners=3, state_copies=1, max_tokens=6)   # validated: one snapshot
    rng = np.random.default_rng(args.seed or 0)
    stream = [[int(x) for x in rng.integers(0, model.n_vocab, 6)]]
    for i in range(args.steps):
        stream.append([int(x) for x in rng.integers(0, model.n_vocab, 2 if i % 7 == 6 else 1)])
    out, first_diff = {}, ""
    for mode in MODES:
        out[mode], mismatch = _run_mode(model, devices, args, mode, stream)
        first_diff = first_diff or mismatch
    res = {"model": label, "gguf": args.gguf or "", "devices": [d.name for d in devices],
           "decode_calls": len(stream), "ubatches": out["reuse"]["ubatches"], "builds": out["reuse"]["builds"], "reuses": out["reuse"]["reuses"],
           "rebuild_reasons": out["reuse"]["rebuild_reasons"],
           "host_ms_per_step_reuse": out["reuse"]["host_ms_per_step"],
           "host_ms_per_step_rebuild": out["rebuild"]["host_ms_per_step"],
           "validator": "fail" if first_diff else "pass", "first_difference": first_diff, "modes": out}
    if args.json:
        emit_json("reuse", res)
    else:
        print(f"{label}: {len(stream)} decode calls = {res['ubatches']} ubatches of at most {args.ubatch} tokens "
              f"(a 6-token prompt, then 1-token steps; a 2-token step every 7th forces a new shape)")
        print(f"{'mode':10s} {'builds':>7s} {'reuses':>7s} {'step ms':>8s} {'host ms':>8s}")
        for m, v in out.items():
            print(f"{m:10s} {v['builds']:7d} {v['reuses']:7d} {v['step_ms']:8.3f} {v['host_ms_per_step']:8.3f}")
        print("why graphs were rebuilt (reuse on):")
        for item in out["reuse"]["rebuild_reasons"]:
            print(f"  {item['count']:4d}x {item['reason']}")
        print(f"validator: {res['validator']}" + (f": {first_diff}" if first_diff else " (reuse on == fresh build, bit for bit)"))
    return 0 if not first_diff else FAILED
