"""bench/RESULTS.md's sections. Each benchmark script writes its report into sections of its own,
between an HTML comment that opens it and one that closes it, both naming the script and what
the run covered (`bench/ops.py --write --filter weights`, `bench/e2e.py --write (mamba2)`): a
run replaces only its own section, so the file holds nothing but reports the scripts wrote."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "RESULTS.md")


def markers(tag: str) -> tuple[str, str]:
    """The opening and closing comments of the section `tag` names (say 'bench/models.py --write')."""
    return (f"<!-- {tag}: begin (this section is rewritten by the script) -->", f"<!-- {tag}: end -->")


def _span(doc: str, begin: str, end: str):
    """(start, stop) of the section between begin and end in doc, its line end included; None
    when it is not there."""
    if begin not in doc or end not in doc:
        return None
    b = doc.index(end) + len(end)
    return doc.index(begin), b + (doc[b:b + 1] == "\n")


def remove_section(begin: str, end: str, path: str = RESULTS):
    """Take the section between begin and end (and the blank line after it) out of the file."""
    with open(path) as f:
        doc = f.read()
    span = _span(doc, begin, end)
    if span is not None:
        a, b = span
        b += doc[b:b + 1] == "\n" and (a == 0 or doc[a - 1:a] == "\n")   # and the blank line after
        with open(path, "w") as f:
            f.write(doc[:a] + doc[b:])


def replace_section(begin: str, end: str, text: str, path: str = RESULTS, before: str | None = None):
    """Put text between begin and end in the file at path: in place of that section when it is
    there, else just before the line `before` (when given and present), else at the end."""
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    try:
        with open(path) as f:
            doc = f.read()
    except FileNotFoundError:
        doc = ""
    span = _span(doc, begin, end)
    if span is not None:
        doc = doc[:span[0]] + block + doc[span[1]:]
    elif before is not None and f"\n{before}" in doc:
        i = doc.index(f"\n{before}") + 1
        doc = doc[:i] + block + "\n" + doc[i:]
    else:
        doc = (doc.rstrip("\n") + "\n\n" if doc.strip() else "") + block
    with open(path, "w") as f:
        f.write(doc)


def commit() -> str:
    """The checkout's short commit ('?' outside git), for the line saying what ran."""
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def cpu_name() -> str:
    """'<CPU model> (<widest SIMD>)'. The SIMD level is named because the C kernels are built for
    the host (-march=native) and take other paths on AVX-512 than on AVX2: two machines with the
    same model name can run different code."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name") and model == "unknown CPU":
                    model = ln.split(":", 1)[1].strip()
                elif ln.startswith("flags") and not flags:
                    flags = set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2" if flags else "SIMD unknown"
    return f"{model} ({simd})"


def machine_line() -> str:
    """'Machine: <CPU model> (<widest SIMD>), <n> cores, load average a, b, c' (see cpu_name)."""
    model = cpu_name()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cores = os.cpu_count()
    la = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"Machine: {model}, {cores} cores, load average {la}"


class Tee:
    """A stdout that also keeps what is printed (`text`), for contextlib.redirect_stdout: a script
    that prints its report as it measures writes the same report into its section afterwards."""

    def __init__(self, out):
        self.out, self.parts = out, []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return self.out.write(s)

    def flush(self):
        self.out.flush()

    @property
    def text(self) -> str:
        return "".join(self.parts)


def run_line(cmd: str, wall_s: float, machine_at_start: str) -> str:
    """'`cmd` at commit C; wall W s. <machine line> at the start; <load average> at the end.'"""
    return (f"`{cmd.strip()}` at commit {commit()}; wall {wall_s:.0f} s. {machine_at_start} at the start; "
            f"{machine_line().split(', load average ')[1]} at the end.")


def write_report(script: str, argv: list, text: str, wall_s: float, machine_at_start: str,
                 path: str = RESULTS, title: str | None = None):
    """A run's report as its script's section (`<script> --write`): a title, the command, commit,
    wall time and the machine line at the start and the end, then the report as printed."""
    begin, end = markers(f"{script} --write")
    cmd = " ".join(["python", script] + [a for a in argv if a != "--write"])
    replace_section(begin, end, f"# {title or script}\n\n{run_line(cmd, wall_s, machine_at_start)}\n\n"
                    f"```\n{text.strip()}\n```", path)


def run_and_write(script: str, argv, title: str, run, write: bool = True, path: str = RESULTS):
    """run(); when write, what it prints is also written as the script's section (write_report).
    argv None: the command line's."""
    if not write:
        return run()
    argv = list(sys.argv[1:] if argv is None else argv)
    machine0, t0 = machine_line(), time.perf_counter()
    out = Tee(sys.stdout)
    with contextlib.redirect_stdout(out):
        rv = run()
    write_report(script, argv, out.text, time.perf_counter() - t0, machine0, path=path, title=title)
    return rv
