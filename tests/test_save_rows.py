"""CpuBackend.save_rows, the undo journal's copy (streaming stores in C above a size, one plan
record shared by the backend's threads): every byte equals NumPy's copy, for dense and strided
rows, at every alignment of source and destination and lengths around the 64-byte line and the
size threshold, on 1 thread and on 2 with the copy split into as many chunks as it allows."""
from __future__ import annotations

import numpy as np
import pytest

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)


@pytest.mark.parametrize("count,n,stride", [(1, 70000, 0), (1, 65536 + 63, 0), (3, 30000, 30000),
                                            (5, 20000, 20033), (257, 300, 512), (2, 40000, 40001)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_save_rows_equals_numpy_copy(count, n, stride, n_threads, request):
    rng = np.random.default_rng(count * n)
    be = cpu.CpuBackend(400 + n_threads).set_n_threads(n_threads)
    if n_threads > 1:                                  # every 4 KiB unit a chunk of its own
        cpu.lib.mg_set_chunking(0, 0)
        request.addfinalizer(lambda: cpu.lib.mg_set_chunking(-1, -1))
    span = (count - 1) * stride + n
    mem = rng.integers(0, 256, span + 200, dtype=np.uint8)
    for src_off in (0, 1, 17, 64):
        rows = np.lib.stride_tricks.as_strided(mem[src_off:src_off + span], shape=(count, n),
                                               strides=(max(stride, n), 1))
        for dst_off in (0, 5, 64):
            arena = np.zeros(count * n + dst_off, np.uint8)
            dst = arena[dst_off:].reshape(count, n)
            be.save_rows([(dst, rows)])
            assert np.array_equal(dst, rows), (src_off, dst_off)
            assert not arena[:dst_off].any()          # nothing written before the destination
