"""Check the layer rule (pyproject.toml, [tool.importlinter]) with lint-imports.

    python scripts/lint_layers.py [lint-imports options, e.g. --verbose]

Why not plain `lint-imports`: in the source tree (and in the editable install) backends/ and
models/ sit next to minigraph/, and only pyproject's package-dir mapping makes them
minigraph.backends and minigraph.models. lint-imports finds a package by walking its folder, so it
would not see them. This script lays out the installed package in a temporary folder (symlinks to
the sources, following the mapping) and runs lint-imports there. Exit status: lint-imports'
(non-zero when a contract is broken)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
SKIP = {"__pycache__"}


def package_dirs() -> dict[str, Path]:
    """{package name: source folder}, shallowest first (a package before its subpackages)."""
    mapping = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    return {pkg: ROOT / src for pkg, src in sorted(mapping.items(), key=lambda kv: kv[0].count("."))}


def lay_out(dest_root: Path) -> None:
    """The installed layout under dest_root: one real folder per mapped package, holding links
    to its source folder's entries (a mapped subpackage gets its own folder, so it wins)."""
    for pkg, src in package_dirs().items():
        dest = dest_root.joinpath(*pkg.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for entry in src.iterdir():
            if entry.name in SKIP or (dest / entry.name).exists():
                continue
            try:
                (dest / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
            except OSError:          # no symlinks here (some Windows setups): copy instead
                (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, dest / entry.name)


def lint_imports_command() -> list[str]:
    """The lint-imports of this Python's environment (its bin folder), else the one on PATH."""
    here = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    found = here or shutil.which("lint-imports")
    if found is None:
        raise SystemExit("lint-imports not found: pip install -e '.[test]' (import-linter is in the test extra)")
    return [found]


def run_lint(layout: Path, args=(), **kw) -> subprocess.CompletedProcess:
    """lint-imports with pyproject's contracts on the layout in `layout` (see lay_out)."""
    # the laid-out package must shadow the editable install: first on the path, and the cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(layout), os.environ.get("PYTHONPATH")]))}
    cmd = lint_imports_command() + ["--no-cache", str(PYPROJECT), *args]
    return subprocess.run(cmd, cwd=layout, env=env, **kw)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="minigraph-layers-") as tmp:
        lay_out(Path(tmp))
        return run_lint(Path(tmp), argv).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
