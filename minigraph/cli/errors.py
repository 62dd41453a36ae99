"""How the command fails: one line on stderr naming the flag and the rule, and an exit status
(2: bad input, 1: the work itself failed)."""
from __future__ import annotations

import sys

USAGE = 2       # the input was wrong: nothing ran
FAILED = 1      # the input was fine, the work failed (a refused rollback, a validator mismatch)


def fail(msg: str, code: int = USAGE):
    print(f"minigraph: error: {msg}", file=sys.stderr)
    raise SystemExit(code)
