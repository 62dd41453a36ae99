"""Flag types and the checks made before anything runs: each bad value is one line naming the
flag, what was given and what is allowed (exit status 2)."""
from __future__ import annotations

import argparse
import os
import re
import sys


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block), exit status 2."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def int_at_least(low: int):
    """An argparse type: an integer >= low, else a one-line error naming the rule."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """An argparse type: a size like 512M, 2G, 1.5G, 4096 (bytes; K/M/G/T are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size > 0 such as 512M or 2G, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2)])
byte_size.__name__ = "size"


def writable_path(flag: str, path: str | None) -> None:
    """A file the command will write: its folder must exist (checked before any work)."""
    from .errors import fail
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        fail(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        fail(f"{flag} {path}: the folder {folder} is not writable")
