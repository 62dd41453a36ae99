"""Every registered op is kept by everyone: each backend (ref, cpu, cuda) runs it or declares
why not, it has test cases, a ggml translation (or a declared reason there is none) and a meta
split rule. Each check is also shown to catch a made-up op that nobody implemented."""
import pytest

from minigraph.registry import OPS, GgmlCall, NotInGgml, OpDef, Out, Src
from minigraph.testing import coverage


def test_every_backend_runs_every_op_or_says_why_not():
    assert coverage.kernel_problems() == []


def test_every_op_has_test_cases():
    assert coverage.case_problems() == []


def test_every_op_has_a_ggml_translation_or_a_reason():
    assert coverage.ggml_problems() == []


def test_every_op_has_a_meta_split_rule():
    assert coverage.split_problems() == []


def _fake(name="FAKE_OP", **kw):
    return OpDef(name, ("a",), {}, lambda a: Out(a.type, a.ne), sources=(Src("a"),), **kw)


def test_a_new_op_without_kernels_cases_translation_or_rule_is_reported():
    ops = dict(OPS, FAKE_OP=_fake())
    tables = coverage.backend_tables()
    problems = coverage.kernel_problems(ops, tables)
    for backend in ("ref", "cpu", "cuda"):
        assert f"{backend}: FAKE_OP has no kernel and no declared reason (UNSUPPORTED)" in problems
    assert coverage.case_problems(ops) == ["FAKE_OP has no test cases (CaseGen on the op, or @case in op_cases)"]
    assert any("FAKE_OP has no ggml translation" in p for p in coverage.ggml_problems(ops))
    assert any("FAKE_OP declares split=None" in p for p in coverage.split_problems(ops))


def test_declared_reasons_are_accepted_and_must_not_be_empty():
    ops = {"FAKE_OP": _fake(ggml=NotInGgml("minigraph-only"))}
    tables = {"cpu": (set(), {"FAKE_OP": "no C kernel yet"})}
    assert coverage.kernel_problems(ops, tables) == []
    assert coverage.ggml_problems(ops) == []
    assert coverage.kernel_problems(ops, {"cpu": (set(), {"FAKE_OP": " "})}) != []
    assert coverage.ggml_problems({"FAKE_OP": _fake(ggml=NotInGgml(""))}) != []
    bad_arg = {"FAKE_OP": _fake(ggml=GgmlCall("fake", ("a", "nope")))}
    assert coverage.ggml_problems(bad_arg) == ["FAKE_OP: ggml argument 'nope' is neither a source, a param nor '@ne'"]


def test_a_kernel_for_an_unknown_op_is_reported():
    assert coverage.kernel_problems({}, {"cuda": ({"NOT_AN_OP"}, {})}) == [
        "cuda: a kernel is registered for NOT_AN_OP, which is not a registered op"]


@pytest.mark.parametrize("name", sorted(OPS))
def test_declaration_is_consistent(name):
    d = OPS[name]
    assert d.srcs == tuple(s.name for s in d.sources)
    for s in d.sources:
        assert not (s.dest and s.inplace), f"{name}: source {s.name} is both dest and inplace"
