"""minigraph check: the op table on every backend asked for (and real ggml), each cell ok, fail or
skip (the case is not meant for that column)."""
from __future__ import annotations

import sys

import numpy as np

from .args import int_at_least
from .errors import fail
from .output import emit_json

CHECK_COLUMNS = ("ref", "cpu", "cuda:0", "ggml")     # "ggml": real ggml, the oracle
CELL = {True: "ok", False: "fail", None: "skip"}


def add_parser(sub):
    p = sub.add_parser("check", help="the op table on every available backend and real ggml",
                       description="Run every op case on each column and compare it with the reference "
                       "backend; exit status 1 when a cell fails or a column named in --backends cannot run.")
    p.add_argument("--backends", default=None, help="comma-separated columns, e.g. ref,cpu,cuda:0,ggml "
                   "(ggml: real ggml); default: all, and those this machine cannot run are listed as "
                   "not run; a named one that cannot run makes the exit status 1")
    p.add_argument("--seeds", type=int_at_least(1), default=2, help="random inputs per case (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema: minigraph/cli/schema.json)")
    p.set_defaults(fn=cmd_check)


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
            fail(f"bad backend {name!r} in --backends: {e}")
        except Exception as e:            # a known kind this machine cannot run (no GPU, no extension)
            out[name] = f"{type(e).__name__}: {e}"
            continue
        out[be.name] = be
    return out


def _check_cell(case, col, runner, ref, seeds) -> bool | None:
    """True: every seed agrees with the reference; False: one does not (or raises); None: the
    case is not meant for this column (real ggml refuses it)."""
    from minigraph.testing.op_cases import compare, missing_types, run_built
    if col == "ggml" and not case.ggml:
        return None
    if col != "ggml" and missing_types(case, runner):     # a weight type its kernels do not take
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
        fail(f"--backends {args.backends!r}: no column named (write e.g. ref,cpu)")
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
        emit_json("check", {"columns": cols, "rows": {cid: [CELL[c] for c in cells] for cid, cells in rows},
                            "cases": len(rows), "failed": n_fail, "not_run": not_run})
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
