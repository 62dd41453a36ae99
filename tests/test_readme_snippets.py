"""Every README snippet runs as written.

Each ```python block is run whole in a fresh interpreter (cwd = the repository root). Commands are
the lines of ```sh / ```bash blocks and the `$ ...` lines of transcript blocks (a bare ``` block
showing a command and what it prints); each one is run, and the ones that need what a test run must
not use (a network to install from, a GPU, the whole suite again) are skipped with the reason."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TIMEOUT_S = 300

# commands a test run does not repeat, and why (matched against the command line)
NOT_RUN = [
    (re.compile(r"-m venv|pip install"), "creates a virtual environment and installs from a package index"),
    (re.compile(r"-m pytest"), "runs the whole test suite (this test is part of it)"),
    (re.compile(r"\bcuda\b|--gpu"), "needs a GPU"),
    (re.compile(r"rpc-server|ggml:rpc://"), "starts, or needs, RPC servers that run until stopped "
     "(tests/test_ggml_backend.py starts two on free ports and runs these commands against them)"),
]


def blocks(text: str) -> list[tuple[str, str, int]]:
    """(info string, body, first line number) of every fenced block."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        out.append((m.group(1), "\n".join(lines[i + 1:j]), i + 2))
        i = j + 1
    return out


def python_blocks() -> list[tuple[int, str]]:
    return [(line, body) for info, body, line in blocks(open(README).read()) if info in ("python", "py")]


def commands() -> list[tuple[int, str]]:
    """(line number, command) of every shell command the README shows."""
    out = []
    for info, body, line in blocks(open(README).read()):
        for k, text in enumerate(body.split("\n")):
            if info in ("sh", "bash", "shell", "console") and text.strip() and not text.startswith("#"):
                out.append((line + k, text.strip().removeprefix("$ ")))
            elif info == "" and text.startswith("$ "):
                out.append((line + k, text[2:].strip()))
    return out


def argv_of(command: str) -> list[str]:
    """The command for this interpreter: `minigraph` is the installed entry point, `python` and
    `.venv/bin/python` are the interpreter running the tests."""
    argv = shlex.split(command)
    head = argv[0]
    if head in ("minigraph", ".venv/bin/minigraph"):
        return [sys.executable, "-m", "minigraph.cli", *argv[1:]]
    if head in ("python", "python3", ".venv/bin/python"):
        return [sys.executable, *argv[1:]]
    return argv


def test_the_readme_has_snippets_to_check():
    assert python_blocks() and len(commands()) >= 5


@pytest.mark.parametrize("line,code", python_blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_python_block_runs(line, code):
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"README.md line {line}: the python block fails:\n{p.stderr}"


@pytest.mark.parametrize("line,command", commands(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_command_runs(line, command):
    for pattern, reason in NOT_RUN:
        if pattern.search(command):
            print(f"README.md line {line}: not run ({reason}): {command}")
            pytest.skip(f"{reason}: {command}")
    if any(op in command for op in ("&&", "|", ";", ">")):
        pytest.fail(f"README.md line {line}: give one command per line so it can be checked: {command}")
    p = subprocess.run(argv_of(command), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"README.md line {line}: `{command}` exits {p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert p.stdout.strip(), f"README.md line {line}: `{command}` printed nothing"
