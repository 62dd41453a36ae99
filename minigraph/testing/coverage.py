"""What the registry promises and who keeps it: for every op, a kernel (or a declared reason
not to) on each backend, test cases, and a ggml translation (or a declared reason there is none).
tests/test_op_coverage.py turns every problem listed here into a failure."""
from __future__ import annotations

from minigraph.registry import OPS, GgmlCall, NotInGgml


def backend_tables() -> dict:
    """backend name -> (implemented op names, {unsupported op: reason}). Importing a backend
    module needs no device; the CPU one needs its C extension (its load error is raised)."""
    import minigraph.backends.cpu as cpu
    import minigraph.backends.cuda as cuda
    if cpu.lib is None:
        raise RuntimeError(cpu.REBUILD_HINT.format(err=cpu._IMPORT_ERROR))
    ref = {n for n, d in OPS.items() if d.reference is not None}
    return {"ref": (ref, {}), "cpu": (cpu.implemented_ops(), cpu.UNSUPPORTED),
            "cuda": (cuda.implemented_ops(), cuda.UNSUPPORTED)}


def kernel_problems(ops=None, tables=None) -> list[str]:
    ops = OPS if ops is None else ops
    tables = backend_tables() if tables is None else tables
    out = []
    for backend, (done, unsupported) in tables.items():
        for name, d in sorted(ops.items()):
            if d.is_view:
                continue
            if name in done and name in unsupported:
                out.append(f"{backend}: {name} is implemented and also declared unsupported")
            elif name not in done and not unsupported.get(name, "").strip():
                out.append(f"{backend}: {name} has no kernel and no declared reason (UNSUPPORTED)")
        for name in sorted(set(done) - set(ops)):
            out.append(f"{backend}: a kernel is registered for {name}, which is not a registered op")
    return out


def case_problems(ops=None, cases=None) -> list[str]:
    from minigraph.testing.op_cases import CASES
    ops = OPS if ops is None else ops
    have = {c.op for c in (CASES if cases is None else cases)}
    return [f"{name} has no test cases (CaseGen on the op, or @case in op_cases)"
            for name in sorted(ops) if name not in have]


def ggml_problems(ops=None) -> list[str]:
    ops = OPS if ops is None else ops
    out = []
    for name, d in sorted(ops.items()):
        g = d.ggml
        if isinstance(g, NotInGgml):
            if not g.reason.strip():
                out.append(f"{name} is declared not in ggml without a reason")
        elif not isinstance(g, GgmlCall):
            out.append(f"{name} has no ggml translation (OpDef.ggml = GgmlCall(...) or NotInGgml(reason))")
        elif g.override is None and not g.fn:
            out.append(f"{name}: its GgmlCall names no function and no override")
        elif g.override is None:
            for a in g.args:
                if a != "@ne" and a not in d.srcs and a not in d.params:
                    out.append(f"{name}: ggml argument '{a}' is neither a source, a param nor '@ne'")
    return out


def split_problems(ops=None) -> list[str]:
    from minigraph.backends.meta.split_state import SPLIT_RULES
    ops = OPS if ops is None else ops
    return [f"{name} declares split={d.split!r}, which the meta backend has no rule for"
            for name, d in sorted(ops.items()) if d.split not in SPLIT_RULES]
