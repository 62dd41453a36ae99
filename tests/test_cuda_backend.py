"""The CUDA backend on a real GPU: the op table (every case, three seeds, guard bytes around every
intermediate) and the extra cases against the reference, bad indices, the scheduler's copies.

The whole module skips, with the reason, where CuPy is not installed or no CUDA device is visible.
The same checks run on the CPU emulator in tests/test_cuda_compile.py."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _unavailable():
    try:
        import cupy
    except ImportError:
        return "CuPy not installed (pip install 'minigraph[cuda]')"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # no driver, driver too old for this CuPy, no device
        return f"no CUDA device ({e})"
    return None if n > 0 else "no CUDA device"


_REASON = _unavailable()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

import minigraph as mg                                # noqa: E402
from minigraph.testing.op_cases import CASES, missing_types   # noqa: E402

import minigraph.backends.cuda as cuda                          # noqa: E402
from minigraph.testing import cuda_selftest as selftest                    # noqa: E402


def fresh():
    return cuda.CudaBackend(0)


def test_device_by_name():
    be = mg.backend("cuda:0")
    assert be.name == "cuda:0" and isinstance(be, cuda.CudaBackend)
    assert mg.backend("cuda") is be


@pytest.mark.parametrize("case", CASES + selftest.EXTRA_CASES, ids=lambda c: c.id)
def test_case_against_reference(case):
    if missing_types(case, cuda.CudaBackend):
        pytest.skip(missing_types(case, cuda.CudaBackend))
    for seed in selftest.SEEDS:
        err = selftest.run_case(case, seed, fresh)
        assert err is None, err


def test_bad_index_leaves_destination_untouched():
    assert selftest.check_bad_index_leaves_destination(fresh) == []


def test_scheduler_copies_between_host_and_device():
    assert selftest.check_scheduler_copies(fresh) == []


def test_strided_write_and_read_round_trip():
    assert selftest.check_strided_write_read(fresh) == []
