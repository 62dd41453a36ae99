"""The `minigraph` command: the parser, and how it ends (one line per error, status 2 for bad
input, quiet on a closed pipe and on Ctrl-C)."""
from __future__ import annotations

import os
import sys

from . import bench, check, interrupt, placement, quantize, reuse, rpc_server, run
from .args import Parser

DESCRIPTION = ("Run tiny recurrent models with speculative drafts and rollbacks, show where "
               "slot-order tensors land and what crosses devices, experiment with graph reuse, "
               "check ops against real ggml, and run benchmarks.")

EXIT_CODES = """exit status: 0 ok; 1 the work failed (a state check, a refused rollback, a validator
mismatch, a failed op); 2 bad input (a flag, a model name, a file, the memory estimate);
130 interrupted (Ctrl-C); 141 stdout closed early (e.g. piped into head)."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("minigraph")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> Parser:
    from minigraph import env
    import argparse
    ap = Parser(prog="minigraph", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=f"environment variables (flags take 1/0, true/false, yes/no, on/off):\n{env.table()}"
                       f"\n\n{EXIT_CODES}")
    ap.add_argument("--version", action="version", version=f"minigraph {version()}",
                    help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for module in (run, placement, reuse, check, bench, quantize, rpc_server):
        module.add_parser(sub)
    return ap


def _quiet_stdout():
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv=None) -> int:
    with interrupt.handled() as ctrl_c:
        return _main(argv, ctrl_c)


def _main(argv, ctrl_c) -> int:
    from minigraph import env
    try:
        env.check_all()
    except env.EnvError as e:
        print(f"minigraph: error: {e}", file=sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(argv)
        return args.fn(args)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        return ctrl_c.report()
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except Exception as e:            # one clear line, not a traceback
        if env.get("MINIGRAPH_TRACEBACK"):
            raise
        print(f"minigraph: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
