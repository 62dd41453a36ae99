"""Public op functions document themselves from the registry.

`@public(NAME, example)` on a function like `mg.mul_mat` composes its docstring from, in order:
its own summary (the function's docstring, written by hand), the op's shape rule in ne order
(`OpDef.shape`, or the function's own `shape=` when its arguments fix part of the rule, as
`view_2d` does for VIEW), the op's sources with their roles and its typed params (from the
declaration), and a runnable example. Every piece is written once: the README's op table reads
the same `OpDef.shape`, and the tests run every example as a doctest."""
from __future__ import annotations

import inspect
import textwrap

from ..registry import OPS, OpDef

# the line every example starts with, so that `help(mg.x)` shows a snippet one can paste
EXAMPLE_SETUP = ">>> import minigraph as mg; ctx = mg.Context()"
WIDTH = 96          # the shape rule is wrapped to this width (help() indents it by 4 more)


def source_roles(d: OpDef) -> str:
    """'a (inplace), b' : the sources in ggml's src order with their roles."""
    def one(s):
        roles = [r for r, on in (("optional", s.optional), ("dest", s.dest), ("inplace", s.inplace)) if on]
        return s.name + (f" ({', '.join(roles)})" if roles else "")
    return ", ".join(one(s) for s in d.sources) or "none"


def _role_notes(d: OpDef) -> list[str]:
    notes = [f"The result is a view of {s} and is written into its memory." for s in d.dest_sources]
    notes += [f"inplace=True: the result is a view of {s} and is written into its memory."
              for s in d.inplace_sources]
    if d.is_view:
        notes.append("A view: computes nothing and aliases a's memory.")
    return notes


def compose_doc(summary: str, d: OpDef, example: str, shape: str | None = None) -> str:
    """The full docstring of a public function that builds op ``d``."""
    params = ", ".join(f"{p}: {t.__name__}" for p, t in d.params.items()) or "none"
    lines = [inspect.cleandoc(summary or ""), "",
             textwrap.fill(f"Shape (ne order): {shape or d.shape}", WIDTH, subsequent_indent="    ",
                           break_on_hyphens=False),
             f"Builds {d.name}: sources {source_roles(d)} (ggml's src order); params {params}."]
    lines += _role_notes(d)
    lines += ["", "Example:", "    " + EXAMPLE_SETUP]
    lines += ["    " + ln for ln in textwrap.dedent(example).strip("\n").splitlines()]
    return "\n".join(lines) + "\n"


def public(opname: str, example: str, shape: str | None = None):
    """Mark a function as the public builder of ``opname`` and give it its composed docstring.
    ``example``: doctest lines after EXAMPLE_SETUP (``>>> ...`` and the expected output)."""
    def deco(fn):
        fn.__doc__ = compose_doc(fn.__doc__, OPS[opname], example, shape)
        fn.op_name = opname
        return fn
    return deco
