"""GET_ROWS of a side copy (Tensor.set_side_copy: a whole-graph output nobody reads during the
compute) runs on the cpu backend as GET_ROWS:side_copy, split by bytes and written with streaming
stores: every byte equals the NumPy reference's GET_ROWS, for rows that do and do not end on a
4 KiB unit or a cache line, repeated indices and several planes, on 1 thread and on 2 with the copy
split into every chunk it allows; a gather it cannot take (another output type) stays plain
GET_ROWS; a bad index is refused (the index check runs first)."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph.tensor import Context
from minigraph.testing.op_cases import Built, run_built

cpu = pytest.importorskip("minigraph.backends.cpu")
if cpu.lib is None:  # pragma: no cover
    pytest.skip(f"cpu extension not built: {cpu._IMPORT_ERROR}", allow_module_level=True)


def run(backend, build, seed):
    """(the gather's bytes, the kernels the cpu plan ran) for the graph build(b, rng) on backend."""
    b = Built(Context())
    b.out(build(b, np.random.default_rng(seed)).set_side_copy())
    be = backend if isinstance(backend, mg.Backend) else mg.backend(backend)
    graphs = []
    out, = run_built(b, be, graph_hook=graphs.append)
    kernels = []
    if isinstance(be, cpu.CpuBackend):
        plan = be.get_plan(graphs[0].nodes, graphs[0].cache)
        kernels = [cpu.ffi.string(cpu.lib.mg_op_name(plan.records[i].op)).decode() for i in range(plan.n)]
    return out.tobytes(), kernels


def gather(ne0, n_rows, idx, planes=1, type=mg.f32, padded=False):
    def build(b, rng):
        if padded:   # rows with a gap after each: not dense as a whole, each row still is
            base = b.leaf(type, (ne0 + 5, n_rows, planes), rng=rng)
            src = mg.view_3d(base, ne0, n_rows, planes, base.nb[1], base.nb[2], 0)
        else:
            src = b.leaf(type, (ne0, n_rows, planes), rng=rng)
        ids = b.leaf(mg.i32, (len(idx) // planes, planes), data=np.asarray(idx, np.int32))
        return mg.get_rows(src, ids)
    return build


@pytest.mark.parametrize("ne0,n_rows,idx,planes", [
    (70000, 3, [2, 0], 1),            # rows of 280,000 bytes: units split inside a row
    (1025, 5, [4, 4, 1, 0, 3], 1),    # 4,100-byte rows: every unit straddles two rows
    (1024, 4, [3, 1, 2], 1),          # rows of exactly one unit
    (37, 6, [5, 0, 5, 2, 1, 1], 2),   # short rows, two planes (indices per plane)
])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_side_copy_equals_get_rows(ne0, n_rows, idx, planes, n_threads, request):
    be = cpu.CpuBackend(500 + n_threads).set_n_threads(n_threads)
    if n_threads > 1:                                  # every 4 KiB unit a chunk of its own
        cpu.lib.mg_set_chunking(0, 0)
        request.addfinalizer(lambda: cpu.lib.mg_set_chunking(-1, -1))
    build = gather(ne0, n_rows, idx, planes)
    want, _ = run("ref", build, seed=ne0)
    got, kernels = run(be, build, seed=ne0)
    assert kernels == ["GET_ROWS:side_copy"]
    assert got == want


@pytest.mark.parametrize("case", ["f16 rows to f32", "padded rows"])
def test_gathers_the_side_copy_cannot_take_stay_get_rows(case):
    build = gather(3000, 3, [1, 2], type=mg.f16) if case == "f16 rows to f32" else \
        gather(3000, 3, [1, 2], padded=True)
    want, _ = run("ref", build, seed=1)
    got, kernels = run("cpu", build, seed=1)
    assert got == want
    assert kernels == (["GET_ROWS"] if case == "f16 rows to f32" else ["GET_ROWS:side_copy"])


def test_side_copy_refuses_a_bad_index():
    with pytest.raises(mg.OpError, match=r"GET_ROWS .*index 7 .* out of range \[0, 3\)"):
        run("cpu", gather(3000, 3, [1, 7]), seed=2)


def test_a_mamba2_decode_step_makes_its_side_copies_in_the_scan(monkeypatch):
    """mamba2 decode on cpu with its sequences in their cells: the side copy of each layer's s rows
    is made by the SSM_SCAN that reads them (the copy's record only checks indices), and it holds
    exactly those rows' bytes from before the step, while the cache rows themselves move on."""
    from minigraph.models.runner import Runner
    from minigraph.models.zoo import make_model
    fused = []
    plain = cpu.CpuBackend._fused_side_copies
    monkeypatch.setattr(cpu.CpuBackend, "_fused_side_copies",
                        staticmethod(lambda compute: fused.append(plain(compute)) or fused[-1]))
    r = Runner(make_model("mamba2", [mg.backend("cpu")], n_layer=2), mem_size=2, n_rs_seq=0, n_ubatch=8)
    r.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5, 6]})
    fused.clear()
    r.decode_seq_tokens({0: [7], 1: [8]})              # the decode graph's plan
    assert [len(f) for f in fused] == [2], fused       # one fused copy per mamba2 layer
    before = {t: t.numpy().copy() for t in r.prev.witnesses}
    r.decode_seq_tokens({0: [9], 1: [10]})             # the same plan, reused
    ssm = [t for t in r.prev.witnesses if t.name.startswith("cache_s")]
    assert len(ssm) == 2, [t.name for t in r.prev.witnesses]
    for t in ssm:
        old = before[t].reshape(-1, t.ne[0])
        copy = r.prev.witnesses[t].numpy().reshape(-1, t.ne[0])
        assert len(copy) == 2
        for row in copy:
            hits = [i for i, o in enumerate(old) if np.array_equal(row, o)]
            assert hits, f"{t.name}: a side copy row is not a row of the cache before the step"
            assert not np.array_equal(t.numpy().reshape(-1, t.ne[0])[hits[0]], row), "the step left the row as it was"
