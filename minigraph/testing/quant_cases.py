"""Op cases for the half-precision and block types (get_rows, mul_mat's src0, cpy/cast), each
tagged with the types its compute nodes read (`Case.types`): a backend runs a tagged case only
when its `wide_types` names them all, and the tests skip it elsewhere with that reason, so a
backend turns the cases on by declaring its kernels' types."""
from __future__ import annotations

import numpy as np

import minigraph as mg
from minigraph.tensor import Context
from minigraph.testing.op_cases import Built, case
from minigraph.types import bf16, f16, f32, i32, q4_0, q4_k, q6_k, q8_0

WEIGHT_TYPES = (f16, bf16, q8_0, q4_0, q4_k, q6_k)


def _wide(t, op="GET_ROWS"):
    """The tag: bf16 and block types always, f16 as mul_mat's src0 (see Backend.wide_types)."""
    return (t.name,) if not t.numpy_native or op == "MUL_MAT" else ()


def _k(rng, t):
    """A row length: 1..3 blocks (K-quants 1..2 super-blocks), or any length for half types."""
    if t.blck_size == 1:
        return int(rng.integers(33, 97))
    return t.blck_size * int(rng.integers(1, 4 if t.blck_size == 32 else 3))


for _t in WEIGHT_TYPES:
    @case("MUL_MAT", f"{_t.name}_weights", nmse=1e-10, types=_wide(_t, "MUL_MAT"))
    def _(rng, _t=_t):
        b = Built(Context())
        K, M, N = _k(rng, _t), int(rng.integers(2, 9)), int(rng.integers(1, 6))
        B2, r2 = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        a = b.leaf(_t, (K, M, B2, 1), rng=rng)
        x = b.leaf(f32, (K, N, B2 * r2, 1), rng=rng)
        b.out(mg.mul_mat(a, x))
        return b

    @case("MUL_MAT", f"{_t.name}_row_view", nmse=1e-10, types=_wide(_t, "MUL_MAT"))
    def _(rng, _t=_t):
        """Rows 1.. of a larger weight (a view starting on a row, so on a block boundary)."""
        b = Built(Context())
        K, M, N = _k(rng, _t), int(rng.integers(3, 9)), int(rng.integers(1, 5))
        w = b.leaf(_t, (K, M + 2), rng=rng)
        a = mg.view_2d(w, K, M, w.nb[1], w.nb[1])
        x = b.leaf(f32, (K, N), rng=rng)
        b.out(mg.mul_mat(a, x))
        return b

    @case("GET_ROWS", f"{_t.name}_rows", exact=True, types=_wide(_t))
    def _(rng, _t=_t):
        b = Built(Context())
        K, R, n, ne2 = _k(rng, _t), int(rng.integers(3, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 3))
        a = b.leaf(_t, (K, R, ne2), rng=rng)
        ids = b.leaf(i32, (n, ne2), data=rng.integers(0, R, (ne2, n)))
        b.out(mg.get_rows(a, ids))
        return b

for _from, _to in ((f32, bf16), (bf16, f32)):
    @case("CPY", f"cast_{_from.name}_{_to.name}", exact=True, types=("bf16",))
    def _(rng, _from=_from, _to=_to):
        b = Built(Context())
        x = b.input(rng, _from, tuple(int(v) for v in rng.integers(1, 6, 4)), "contig")
        b.out(mg.cast(x, _to))
        return b

for _t in (q8_0, q4_0):
    @case("CPY", f"f32_to_{_t.name}", exact=True, types=(_t.name,))
    def _(rng, _t=_t):
        """Quantize a (row-contiguous, strided) f32 tensor into a block destination."""
        b = Built(Context())
        K, M, ne2 = _t.blck_size * int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 3))
        x = b.input(rng, f32, (K, M, ne2, 1), "strided")
        dst = b.leaf(_t, (K, M, ne2), rng=rng)
        b.out(mg.cpy(x, dst))
        return b

    @case("CPY", f"cast_f32_to_{_t.name}_normal", exact=True, types=(_t.name,))
    def _(rng, _t=_t):
        """Normal values, and a row of exact halves (127 sets the scale to 1): ggml's CPU quantizes
        a cpy's rows with its own routine, which rounds q8_0's ties to even (its reference
        quantizer, mg.quantize, rounds them away from zero)."""
        b = Built(Context())
        values = rng.standard_normal((64, 4 * _t.blck_size)) * 3
        ties = np.tile(np.r_[127.0, np.arange(31) - 15.5], 4 * _t.blck_size // 32)
        values[0] = ties
        x = b.leaf(f32, (4 * _t.blck_size, 64), data=values)
        b.out(mg.cast(x, _t))
        return b


for _t in (f16, q4_0, q4_k):
    @case("MUL_MAT", f"{_t.name}_strided_src1_broadcast", nmse=1e-10, types=_wide(_t, "MUL_MAT"))
    def _(rng, _t=_t):
        """src1 with padded rows (converted row by row) and src0 broadcast over dims 2 and 3."""
        b = Built(Context())
        K, M, N = _k(rng, _t), int(rng.integers(2, 7)), int(rng.integers(1, 5))
        a = b.leaf(_t, (K, M, 1, 2), rng=rng)
        x = b.input(rng, f32, (K, N, 2, 4), "strided")
        b.out(mg.mul_mat(a, x))
        return b

    @case("GET_ROWS", f"{_t.name}_rows_of_a_view", exact=True, types=_wide(_t))
    def _(rng, _t=_t):
        """Rows from a view that starts one row into a larger table."""
        b = Built(Context())
        K, R, n = _k(rng, _t), int(rng.integers(3, 8)), int(rng.integers(1, 6))
        table = b.leaf(_t, (K, R + 1), rng=rng)
        rows = mg.view_2d(table, K, R, table.nb[1], table.nb[1])
        ids = b.leaf(i32, (n,), data=rng.integers(0, R, n))
        b.out(mg.get_rows(rows, ids))
        return b
