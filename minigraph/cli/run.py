"""minigraph run: decode a synthetic stream with speculative drafts and rollbacks, then check the
final state against a run that only ever saw the accepted tokens."""
from __future__ import annotations

import sys
import time
from collections import Counter

import numpy as np

from .args import int_at_least
from .errors import FAILED, fail
from .output import emit_json, finite
from .session import add_model_flags, make_runner, setup
from .transfers import allreduce_counters


def add_parser(sub):
    p = sub.add_parser("run", help="decode a synthetic stream with speculative drafts and rollbacks",
                       description="Decode a synthetic token stream with speculative drafts: each step "
                       "decodes a draft, accepts a random prefix and rolls the rest back; at the end the "
                       "state must equal that of a run that saw only the accepted tokens.")
    add_model_flags(p)
    p.add_argument("--draft", type=int_at_least(1), default=None,
                   help="max draft length per step (default: n_rs_seq, at least 1)")
    p.add_argument("--steps", type=int_at_least(0), default=20, help="speculative steps (default 20)")
    p.add_argument("--reeval", action="store_true",
                   help="on a refused rollback, re-evaluate from scratch instead of failing")
    p.add_argument("--verbose", action="store_true", help="also say why each graph was rebuilt")
    p.set_defaults(fn=cmd_run)


def cmd_run(args):
    from minigraph.models.runner import DecodeError
    longest_draft = args.draft if args.draft is not None else max(args.n_rs_seq, 1)
    devices, model, label = setup(args, runners=2, max_tokens=max(8, longest_draft))
    rng = np.random.default_rng(args.seed or 0)
    r = make_runner(model, devices, args)
    draft = args.draft if args.draft is not None else max(r.n_rs_seq, 1)
    prompt = [int(x) for x in rng.integers(0, model.n_vocab, 8)]
    accepted = list(prompt)
    chunks = [list(prompt)]          # the ubatches a run that never saw a rejected token decodes
    t0 = time.perf_counter()
    r.decode_seq_tokens({0: prompt})
    progress = args.steps >= 50 and not args.json
    for step in range(args.steps):
        d = int(rng.integers(1, draft + 1))
        toks = [int(x) for x in rng.integers(0, model.n_vocab, d)]
        n_accept = int(rng.integers(1, d + 1))
        r.decode_seq_tokens({0: toks})
        k = d - n_accept
        if k > 0 and not r.rollback(0, k):
            if not args.reeval:
                fail(f"rollback of {k} tokens refused: {r.memory.last_refusal} "
                     f"(use --draft <= --n-rs-seq, or --reeval to re-evaluate from scratch)", FAILED)
            r.memory.seq_rm(0, -1, -1)                 # re-evaluate the accepted history
            r.forget_graph("re-evaluation after a refused rollback (--reeval)")
            r.decode_seq_tokens({0: accepted + toks[:n_accept]})
            chunks = [accepted + toks[:n_accept]]
        else:
            chunks.append(toks[:n_accept])
        accepted += toks[:n_accept]
        if progress and (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  step {step + 1}/{args.steps}: {len(accepted)} tokens accepted", file=sys.stderr)
    elapsed = time.perf_counter() - t0
    last = r.decode_seq_tokens({0: [0]})[0]
    n_reduce, reduce_bytes = allreduce_counters(devices)     # before the reference run adds its own
    # the state check: a run that never saw a rejected token (same ubatches otherwise, so the
    # same kernels run on the same shapes) must end in the same state, bit for bit
    ref = make_runner(model, devices, args)
    try:
        for c in chunks:
            ref.decode_seq_tokens({0: c})
        ref_last = ref.decode_seq_tokens({0: [0]})[0]
        ok = np.array_equal(last, ref_last) and r.live_state_bytes() == ref.live_state_bytes()
    except DecodeError:
        ok = False
    st = r.stats
    n_steps = max(1, len(st.copies))
    copies = sum(c for c, _ in st.copies) / n_steps
    copy_bytes = sum(b for _, b in st.copies) / n_steps
    reasons = Counter(st.rebuild_reasons)
    out = {
        "model": label, "gguf": args.gguf or "", "devices": [d.name for d in devices], "n_rs_seq": r.n_rs_seq,
        "ubatch": r.n_ubatch, "slot_order": args.slot_order, "steps": args.steps,
        "tokens": st.tokens, "tokens_accepted": len(accepted), "seconds": finite(elapsed),
        "tokens_per_s": finite(st.tokens / elapsed) if elapsed > 0 else 0.0,
        "builds": st.builds, "reuses": st.reuses,
        "rebuild_reasons": [{"reason": k, "count": v} for k, v in reasons.items()],
        "copies_per_step": float(copies), "copy_bytes_per_step": float(copy_bytes),
        "all_reduces_per_step": n_reduce / n_steps, "all_reduce_bytes_per_step": reduce_bytes / n_steps,
        "transfers_per_step": copies + n_reduce / n_steps,
        "transfer_bytes_per_step": copy_bytes + reduce_bytes / n_steps,
        "rollbacks": st.rollbacks, "rollbacks_refused": st.rollbacks_refused,
        "state_check": "pass" if ok else "fail",
    }
    if args.json:
        emit_json("run", out)
    else:
        print(f"{label} on {','.join(out['devices'])}: n_rs_seq={r.n_rs_seq}, ubatch {r.n_ubatch}, "
              f"slot order {args.slot_order}" + (f", weights from {args.gguf}" if args.gguf else ""))
        print(f"  tokens decoded      {st.tokens} ({len(accepted)} accepted) in {elapsed:.2f} s = {out['tokens_per_s']:.1f} tokens/s")
        print(f"  graphs              {st.builds} builds, {st.reuses} reuses")
        if args.verbose:
            for why, n in reasons.items():
                print(f"    rebuilt {n:4d}x: {why}")
        print(f"  transfers           {out['transfers_per_step']:.1f} per step, "
              f"{out['transfer_bytes_per_step']:.0f} bytes per step")
        print(f"    cross-device copies {copies:.1f} per step, {copy_bytes:.0f} bytes per step")
        print(f"    all-reduces         {out['all_reduces_per_step']:.1f} per step, "
              f"{out['all_reduce_bytes_per_step']:.0f} bytes per step")
        print(f"  rollbacks           {st.rollbacks} done, {st.rollbacks_refused} refused")
        print(f"  state check         {out['state_check']} (against a run that saw only the accepted tokens)")
    return 0 if ok else FAILED
