"""The op table of the README, generated from the registry and the op test table:

    python -m minigraph.testing.optable

It lives in minigraph.testing, not the core, because it counts the op cases (minigraph.testing.op_cases):
the core never imports the test layer."""
from __future__ import annotations

from minigraph import ops as _ops  # noqa: F401  (fills the registry)
from minigraph.registry import OPS
from minigraph.testing.op_cases import CASES


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
