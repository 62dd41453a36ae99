"""The op table (minigraph.testing.op_cases) on every available backend, with guard bytes around every
intermediate; plus the coverage check that every registered op has cases and kernels."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import CASES, compare, ops_without_cases, run_built
from minigraph.registry import OPS

SEEDS = (0, 1, 2)


def fresh_backends():
    """Fresh instances (so guard settings do not leak) of every backend this machine has."""
    out = [("ref", lambda: type(mg.backend("ref"))())]
    try:
        cpu = mg.backend("cpu")
        out.append(("cpu", lambda: type(cpu)(9)))
    except Exception:
        pass
    try:
        cuda = mg.backend("cuda:0")          # only where CuPy and a GPU are present
        out.append(("cuda", lambda: type(cuda)(0)))
    except Exception:
        pass
    return out


@pytest.mark.parametrize("backend_name,make_backend", fresh_backends(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case_against_reference_with_guards(case, backend_name, make_backend):
    for seed in SEEDS:
        be = make_backend()
        be.guard = 64
        graphs = []
        built = case.make(np.random.default_rng(seed))
        actual = run_built(built, be, graph_hook=graphs.append)
        assert be.guards_intact(graphs[0]), f"{case.id} seed {seed}: a kernel wrote outside its tensor"
        expected_built = case.make(np.random.default_rng(seed))
        expected = run_built(expected_built, type(mg.backend("ref"))())
        for t, arr in built.data.items():
            assert np.any(arr != 0) or arr.size == 0 or not t.type.is_float, "cases never use all-zero data"
        err = compare(case, built, actual, expected)
        assert err is None, f"{case.id} seed {seed} on {backend_name}: {err}"


def test_every_op_has_cases_and_a_reference():
    assert ops_without_cases() == []
    for name, d in OPS.items():
        assert d.is_view or d.reference is not None, f"{name} has no NumPy reference"


def test_case_data_is_never_all_zero():
    for case in CASES:
        built = case.make(np.random.default_rng(0))
        for t, arr in built.data.items():
            if arr.size and t.type.is_float:
                assert np.count_nonzero(arr) == arr.size, f"{case.id}: zero in leaf data"
