"""The op table of the README, generated from the registry (each op's declaration, its shape rule
in words included) and the op test table:

    python -m minigraph.testing.optable

It lives in minigraph.testing, not the core, because it counts the op cases (minigraph.testing.op_cases):
the core never imports the test layer."""
from __future__ import annotations

from minigraph import ops as _ops  # noqa: F401  (fills the registry)
from minigraph.ops.public import source_roles
from minigraph.registry import OPS, GgmlCall, NotInGgml
from minigraph.testing.op_cases import CASES


def _ggml(d) -> str:
    if isinstance(d.ggml, NotInGgml):
        return f"not in ggml: {d.ggml.reason}"
    if isinstance(d.ggml, GgmlCall) and d.ggml.fn:
        return f"`ggml_{d.ggml.fn}`"
    return "custom" if isinstance(d.ggml, GgmlCall) else "-"


def markdown_table() -> str:
    rows = ["| op | sources (ggml src order) | params | shape (ne order) | kind | ggml | meta split | test cases |",
            "|---|---|---|---|---|---|---|---|"]
    for name in sorted(OPS):
        d = OPS[name]
        params = ", ".join(f"{p}: {t.__name__}" for p, t in d.params.items()) or "-"
        kind = "view" if d.is_view else "compute"
        n = sum(1 for c in CASES if c.op == name)
        srcs = source_roles(d) if d.sources else "-"
        # a code span keeps '*' literal; a '|' would still end the cell
        shape = "`" + d.shape.replace("|", "\\|") + "`" if d.shape else "-"
        rows.append(f"| `{name}` | {srcs} | {params} | {shape} | {kind} | {_ggml(d)} | {d.split or '-'} | {n} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
