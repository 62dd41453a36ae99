"""minigraph bench: the op, model and reuse benchmarks of the source tree's bench/ folder, one
after the other, each announced with its number and followed by its time."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from .errors import FAILED, fail

SCRIPTS = ("ops", "models", "reuse")
# --quick keeps the whole command near a minute: each script stops starting rows after its share
# (reuse is short already); run a script itself for every row
QUICK_BUDGET_S = {"ops": 18, "models": 18}


def add_parser(sub):
    p = sub.add_parser("bench", help="the op, model and reuse benchmarks",
                       description="Run bench/ops.py, bench/models.py and bench/reuse.py from the source "
                       "tree (an editable install), showing which one runs and how long each took.")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and a time budget per script: all three in about a minute")
    p.add_argument("--only", choices=SCRIPTS, default=None, help="run just one of the benchmarks")
    p.set_defaults(fn=cmd_bench)


def cmd_bench(args):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    names = [args.only] if args.only else list(SCRIPTS)
    scripts = [os.path.join(root, "bench", n + ".py") for n in names]
    scripts = [s for s in scripts if os.path.exists(s)]
    if not scripts:
        fail("the benchmarks live in the source tree's bench/ folder; run from a checkout installed "
             "with pip install -e .", FAILED)
    rc, t_all = 0, time.perf_counter()
    for i, s in enumerate(scripts, 1):
        rel = os.path.relpath(s, root)
        print(f"== [{i}/{len(scripts)}] {rel}{' --quick' if args.quick else ''}", flush=True)
        t0 = time.perf_counter()
        name = os.path.splitext(os.path.basename(s))[0]
        extra = ["--quick"] if args.quick else []
        if args.quick and name in QUICK_BUDGET_S:
            extra += ["--budget", str(QUICK_BUDGET_S[name])]
        code = subprocess.call([sys.executable, s] + extra)
        print(f"== [{i}/{len(scripts)}] {rel}: {'done' if code == 0 else f'FAILED (exit status {code})'} "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        rc |= code
    if len(scripts) > 1:
        print(f"== all benchmarks: {time.perf_counter() - t_all:.1f} s", flush=True)
    return 1 if rc else 0
