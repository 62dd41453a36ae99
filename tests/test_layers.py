"""The architecture's rules, checked on every run:

- imports only point down, core < backends < testing < models < cli (lint-imports with the
  contracts in pyproject.toml, through scripts/lint_layers.py), and that check is not vacuous;
- the core stays under 3,000 lines of code;
- library code raises clear errors instead of using `assert` (python -O strips asserts)."""
from __future__ import annotations

import ast
import importlib.util
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE_LIMIT = 3000
LIBRARY = ("minigraph", "backends", "models")


def _lint_layers():
    spec = importlib.util.spec_from_file_location("lint_layers", ROOT / "scripts" / "lint_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _lint(layout: Path):
    return _lint_layers().run_lint(layout, capture_output=True, text=True, timeout=120)


def test_imports_only_point_down(tmp_path):
    _lint_layers().lay_out(tmp_path)
    p = _lint(tmp_path)
    assert p.returncode == 0, f"a layer imports upward (python scripts/lint_layers.py):\n{p.stdout}\n{p.stderr}"


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path):
    """The check above must fail on a violation: plant a lazy core -> models import in a copy."""
    _lint_layers().lay_out(tmp_path)
    report = tmp_path / "minigraph" / "report.py"
    text = report.read_text()
    report.unlink()                  # a link to the source: replace it, never write through it
    report.write_text(text + "\n\ndef _upward():\n    from minigraph.models import zoo\n    return zoo\n")
    p = _lint(tmp_path)
    assert p.returncode != 0, p.stdout
    assert "minigraph.report -> minigraph.models.zoo" in p.stdout, p.stdout


def core_files() -> list[Path]:
    """The core: everything in minigraph/ except the command line, the test layer and the block
    codecs. minigraph/quants is a layer of its own below the core (it imports only NumPy): ggml's
    quantizers are long, fixed arithmetic that the graph machinery never reads, so they are not
    counted against the core's size."""
    pkg = ROOT / "minigraph"
    return sorted(p for p in pkg.rglob("*.py")
                  if p.relative_to(pkg).parts[0] not in ("cli", "__main__.py", "testing", "quants"))


def lines_of_code(source: str) -> int:
    """Lines holding code, as cloc counts Python: no blank lines, no comments, no docstrings."""
    docstring_lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstring_lines.update(range(first.lineno, first.end_lineno + 1))
    not_code = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                tokenize.ENDMARKER}
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in not_code:
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(code_lines - docstring_lines)


def test_lines_of_code_counts_only_code():
    src = '"""doc\nstring"""\n\n# comment\nx = 1  # trailing\n\ndef f():\n    """doc"""\n    return (1,\n            2)\n'
    assert lines_of_code(src) == 4       # x = 1, def, return and its continuation


def test_core_is_under_3000_lines_of_code():
    counts = {p.relative_to(ROOT).as_posix(): lines_of_code(p.read_text()) for p in core_files()}
    total = sum(counts.values())
    print(f"core: {total} lines of code in {len(counts)} files (limit {CORE_LIMIT})")
    biggest = ", ".join(f"{f} {n}" for f, n in sorted(counts.items(), key=lambda kv: -kv[1])[:5])
    assert total < CORE_LIMIT, f"the core has {total} lines of code (limit {CORE_LIMIT}); biggest: {biggest}"


def test_library_code_raises_instead_of_asserting():
    found = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += [f"{rel}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.Assert)]
    assert not found, ("assert in library code (stripped by python -O): raise ValueError / mg.OpError "
                       "naming the tensor, key or flag and the rule instead: " + ", ".join(found))
