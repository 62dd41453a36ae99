"""Every environment variable minigraph reads, in one table, and the one place they are read.

Each variable has a type (flag: a boolean; int; text), a default and a meaning. Flags accept
1/0, true/false, yes/no, on/off (any case); any other value is an error naming the variable and
the values allowed, so a typo is never silently taken as "off". An empty value means the default.

This module imports nothing but the standard library: the CPU kernels' build script
(backends/cpu/build.py) loads it by path at build time, before minigraph is importable."""
from __future__ import annotations

import os
from dataclasses import dataclass


class EnvError(ValueError):
    """An environment variable with a value its type does not allow."""


@dataclass(frozen=True)
class Variable:
    name: str
    type: str          # "flag", "int" or "text"
    default: object
    meaning: str
    when: str = "run"  # "run": read while running; "build": read when `pip install` compiles the kernels


VARIABLES = [
    Variable("MINIGRAPH_TRACEBACK", "flag", False,
             "the minigraph command shows a traceback instead of a one-line error"),
    Variable("MINIGRAPH_GRAPH_REUSE", "flag", True,
             "the runner reuses the previous graph when it can (off: rebuild every ubatch)"),
    Variable("MINIGRAPH_GRAPH_REUSE_CHECK", "flag", False,
             "validate every reused step against a fresh build (slow; for debugging reuse)"),
    Variable("MINIGRAPH_SCHED_DEBUG", "int", 0,
             "print splits and copies when a graph is scheduled (2: every node's device and cause too)"),
    Variable("MINIGRAPH_PORTABLE", "flag", False,
             "compile the CPU kernels without -march=native", when="build"),
    Variable("MINIGRAPH_ASAN", "flag", False,
             "compile the CPU kernels with AddressSanitizer", when="build"),
    Variable("MINIGRAPH_LIBGGML", "text", "",
             "directory of the ggml libraries the ggml backend loads (default: llama-cpp-python's llama_cpp/lib)"),
    Variable("CXX", "text", "g++",
             "the C++ compiler the CUDA emulation builds its kernels with"),
]
BY_NAME = {v.name: v for v in VARIABLES}

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _parse(var: Variable, text: str):
    if var.type == "flag":
        word = text.lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        raise EnvError(f"{var.name}={text!r}: expected one of {'/'.join(TRUE_WORDS + FALSE_WORDS)}")
    if var.type == "int":
        try:
            return int(text)
        except ValueError:
            raise EnvError(f"{var.name}={text!r}: expected an integer") from None
    return text


def get(name: str, environ=None):
    """The value of a variable of the table, parsed by its type; the default when it is unset or
    empty. Raises EnvError for a value its type does not allow, KeyError for a name not in the table."""
    var = BY_NAME[name]
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return var.default
    return _parse(var, text)


def check_all(environ=None) -> None:
    """Parse every variable that is set: the first bad value raises EnvError (the command line
    calls this before doing anything, so a typo stops it at once)."""
    for var in VARIABLES:
        get(var.name, environ)


def table(when: str | None = None) -> str:
    """The table as aligned text (for `minigraph --help`)."""
    rows = [v for v in VARIABLES if when is None or v.when == when]
    width = max(len(v.name) for v in rows)
    out = []
    for v in rows:
        default = {True: "on", False: "off"}.get(v.default, v.default) if v.type == "flag" else v.default
        extra = " (build time)" if v.when == "build" else ""
        out.append(f"  {v.name:{width}s}  {v.type:4s} default {default!s:4s} {v.meaning}{extra}")
    return "\n".join(out)
