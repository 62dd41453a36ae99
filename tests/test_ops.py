"""The op table (minigraph.testing.op_cases) on every available backend, with guard bytes around every
intermediate; plus the check that every registered op has cases and a reference (the full
coverage check is tests/test_op_coverage.py). ref and cpu always run; cuda runs where CuPy and a
device are present and is skipped with the reason elsewhere."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.testing.op_cases import CASES, compare, missing_types, ops_without_cases, run_built
from minigraph.registry import OPS

SEEDS = (0, 1, 2)


def _cuda_unavailable() -> str | None:
    """Why the cuda backend is not expected here (None: CuPy and a device are present, so it
    must load and pass). The emulated device runs the same table in tests/test_cuda_compile.py."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'minigraph[cuda]'); the emulator runs cuda's kernels in test_cuda_compile.py"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # no driver, driver too old, no device
        return f"no CUDA device ({e}); the emulator runs cuda's kernels in test_cuda_compile.py"
    return None if n > 0 else "no CUDA device; the emulator runs cuda's kernels in test_cuda_compile.py"


def _make(kind):
    """A fresh instance (so guard settings do not leak). cpu is always expected: a broken C build
    fails every cpu case with its load error instead of dropping the backend."""
    if kind == "ref":
        return type(mg.backend("ref"))()
    if kind == "cpu":
        import minigraph.backends.cpu as cpu
        return cpu.CpuBackend(9)
    import minigraph.backends.cuda as cuda
    return cuda.CudaBackend(0)


def fresh_backends():
    out = [pytest.param("ref", id="ref"), pytest.param("cpu", id="cpu")]
    why = _cuda_unavailable()
    out.append(pytest.param("cuda", id="cuda", marks=pytest.mark.skip(reason=why) if why else ()))
    return out


def test_cpu_backend_loads():
    import minigraph.backends.cpu as cpu
    assert cpu.lib is not None, cpu.REBUILD_HINT.format(err=cpu._IMPORT_ERROR)


@pytest.mark.parametrize("backend_name", fresh_backends())
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case_against_reference_with_guards(case, backend_name):
    why = missing_types(case, _make(backend_name))
    if why:
        pytest.skip(why)
    for seed in SEEDS:
        be = _make(backend_name)
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
            if arr.size and t.type.is_quantized:     # raw blocks: a zero byte is fine, a zero block is not
                values = mg.dequantize(arr.reshape(-1, arr.shape[-1]), t.type).reshape(-1, t.type.blck_size)
                assert np.all(np.any(values != 0, axis=1)), f"{case.id}: a zero block in leaf data"
            elif arr.size and t.type == mg.bf16:
                assert np.count_nonzero(mg.dequantize(arr.view(np.uint8), mg.bf16)) == arr.size, f"{case.id}: zero"
            elif arr.size and t.type.is_float:
                assert np.count_nonzero(arr) == arr.size, f"{case.id}: zero in leaf data"
