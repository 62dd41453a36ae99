"""The op table of the README, generated from the registry:  python -m minigraph.optable"""
from __future__ import annotations

from . import ops as _ops  # noqa: F401
from .testing.op_cases import CASES
from .registry import OPS


def markdown_table() -> str:
    rows = ["| op | sources (ggml src order) | params | kind | test cases |", "|---|---|---|---|---|"]
    for name in sorted(OPS):
        d = OPS[name]
        params = ", ".join(f"{p}: {t.__name__}" for p, t in d.params.items()) or "-"
        kind = "view" if d.is_view else "compute"
        n = sum(1 for c in CASES if c.op == name)
        rows.append(f"| `{name}` | {', '.join(d.srcs) or '-'} | {params} | {kind} | {n} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
