"""The public API can be discovered: `help(mg)` lists every op's function (`__all__`), and each
op function's help shows its shape rule in ne order and an example that runs."""
import doctest
import pydoc
import re

import pytest

import minigraph as mg
from minigraph.registry import OPS


def public_functions() -> dict:
    """{name: function} for every op function in mg.__all__ (they carry the op they build)."""
    return {n: getattr(mg, n) for n in mg.__all__ if hasattr(getattr(mg, n, None), "op_name")}


def test_every_name_in_all_exists():
    missing = [n for n in mg.__all__ if not hasattr(mg, n)]
    assert not missing, f"mg.__all__ names what minigraph does not define: {missing}"
    assert len(set(mg.__all__)) == len(mg.__all__), "mg.__all__ lists a name twice"


def test_every_registered_op_has_a_public_function():
    by_op: dict[str, list[str]] = {}
    for name, fn in public_functions().items():
        by_op.setdefault(fn.op_name, []).append(name)
    missing = sorted(set(OPS) - set(by_op))
    assert not missing, f"ops without a public function in mg.__all__: {missing}"


def test_the_core_names_are_public():
    for name in ("Context", "Tensor", "Graph", "Backend", "backend", "Scheduler", "OpError", "f32", "DType"):
        assert name in mg.__all__, name


def test_help_lists_the_op_functions():
    text = pydoc.render_doc(mg, renderer=pydoc.plaintext)
    for name in ("mul_mat", "ssm_conv", "set_rows", "silu", "view_4d"):
        assert re.search(rf"\b{name}\(", text), f"help(minigraph) does not list {name}"


@pytest.mark.parametrize("name", sorted(public_functions()))
def test_op_function_documents_shape_and_example(name):
    doc = public_functions()[name].__doc__ or ""
    shape = re.search(r"^Shape \(ne order\): (.+?)\nBuilds ", doc, re.M | re.S)   # the rule may wrap
    assert shape and "->" in shape.group(1) and "[" in shape.group(1), \
        f"mg.{name}'s docstring needs its shape rule in ne order ('Shape (ne order): ... -> [...]')"
    assert ">>>" in doc or "e.g." in doc, f"mg.{name}'s docstring needs an example"


@pytest.mark.parametrize("name", sorted(public_functions()))
def test_op_function_example_runs(name):
    fn = public_functions()[name]
    tests = doctest.DocTestFinder(recurse=False).find(fn, name, globs={})
    assert tests and tests[0].examples, f"mg.{name} has no doctest example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out = []
    for t in tests:
        runner.run(t, out=out.append)
    assert runner.failures == 0, "".join(out)


def test_every_op_declares_its_shape_rule():
    """The README's op table shows OpDef.shape: every op has one, in ne order."""
    missing = [name for name, d in OPS.items() if "->" not in d.shape]
    assert not missing, f"ops without a shape rule in words (@op(..., shape=...)): {missing}"
