"""The benchmark scripts of bench/ as modules for the tests (bench/ is not a package: each script
runs as `python bench/NAME.py`)."""
from __future__ import annotations

import importlib.util
import os

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def path(name: str) -> str:
    return os.path.join(BENCH, f"{name}.py")


def load(name: str):
    """bench/NAME.py, imported afresh as the module bench_NAME."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
