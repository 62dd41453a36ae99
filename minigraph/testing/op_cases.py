"""The op test table, as ggml's test-backend-ops keeps it: for every registered op, cases that
build a small graph on random shapes with contiguous, strided, permuted and overlapping-view
inputs and random (never zero) data. Tests, the oracle comparison and `minigraph check` all run
this one table."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import minigraph.ops as _ops  # noqa: F401
from minigraph.registry import OPS, build
from minigraph.tensor import Context, Tensor, contiguous_strides
from minigraph.types import DType, f16, f32, i32, i64

import minigraph as mg


@dataclass
class Built:
    ctx: Context
    data: dict = field(default_factory=dict)    # leaf tensor -> NumPy array (NumPy order)
    outs: list = field(default_factory=list)    # tensors to compare (outputs and destinations)
    masks: dict = field(default_factory=dict)   # out index -> bool mask of elements to compare

    def leaf(self, type: DType, ne, data=None, rng=None) -> Tensor:
        t = self.ctx.new_tensor(type, ne)
        self.data[t] = random_data(rng, type, t.ne) if data is None else np.asarray(data, type.np_dtype).reshape(_held_shape(t))
        return t

    def input(self, rng, type: DType, ne, layout: str = "contig") -> Tensor:
        """A tensor of extents ne (ggml order) with the given memory layout:
        contig; strided (padded rows/planes, non-zero offset); permuted (a permute view of a
        differently laid-out leaf); transposed (dims 0 and 1 swapped in memory)."""
        ne = tuple(ne) + (1,) * (4 - len(ne))
        if layout == "contig":
            return self.leaf(type, ne, rng=rng)
        if layout == "strided":
            base = self.leaf(type, (ne[0] + 3, ne[1] + 1, ne[2], ne[3]), rng=rng)
            return mg.view_4d(base, *ne, base.nb[1], base.nb[2], base.nb[3], 2 * type.size + base.nb[1] * (1 if ne[1] > 0 else 0))
        if layout in ("permuted", "transposed"):
            axes = (1, 0, 2, 3) if layout == "transposed" else tuple(int(x) for x in rng.permutation(4))
            while layout == "permuted" and axes == (0, 1, 2, 3):
                axes = tuple(int(x) for x in rng.permutation(4))
            base = self.leaf(type, tuple(ne[axes[i]] for i in range(4)), rng=rng)
            return mg.permute(base, *axes)
        raise ValueError(layout)

    def out(self, t: Tensor, mask=None) -> Tensor:
        if mask is not None:
            self.masks[len(self.outs)] = mask
        self.outs.append(t)
        return t


def _held_shape(t: Tensor) -> tuple:
    """The 4-D NumPy shape of a leaf's data: values, bf16 bits, or rows of raw blocks."""
    if t.type.is_quantized:
        return (t.ne[3], t.ne[2], t.ne[1], t.row_size())
    return tuple(reversed(t.ne))


def random_data(rng, type: DType, ne) -> np.ndarray:
    shape = tuple(reversed(ne))
    if not type.numpy_native:          # bf16 bits or raw blocks of never-zero values
        x = rng.uniform(-1.0, 1.0, shape)
        x = np.where(np.abs(x) < 1e-3, 0.5, x).astype(np.float32)
        raw = mg.quantize(x, type)
        return raw.view(type.np_dtype).reshape(shape) if not type.is_quantized else raw
    if type.is_float:
        x = rng.uniform(-1.0, 1.0, shape)
        x = np.where(np.abs(x) < 1e-3, 0.5, x)     # never zero
        return x.astype(type.np_dtype)
    return rng.integers(-50, 50, shape).astype(type.np_dtype)


@dataclass
class Case:
    op: str
    name: str
    make: Callable[[np.random.Generator], Built]
    exact: bool = False        # copies and index ops compare bit for bit
    nmse: float = 1e-7         # float tolerance against the reference
    ggml: bool = True          # real ggml can run it (see note where False)
    note: str = ""
    types: tuple = ()          # bf16 / block types (by name) its compute nodes read

    @property
    def id(self):
        return f"{self.op}:{self.name}"


CASES: list[Case] = []


def case(op: str, name: str, exact=False, nmse=1e-7, ggml=True, note="", types=()):
    def deco(fn):
        CASES.append(Case(op, name, fn, exact, nmse, ggml, note, tuple(types)))
        return fn
    return deco


def missing_types(case: Case, backend) -> str | None:
    """Why ``backend`` does not run ``case`` (a bf16 or block type it declares no kernels for,
    see Backend.wide_types), or None: tests skip such a case with this reason."""
    lacking = [t for t in case.types if t not in getattr(backend, "wide_types", ())]
    if not lacking:
        return None
    name = backend.__name__ if isinstance(backend, type) else backend.name
    return f"{case.id}: backend {name} has no kernels for {', '.join(lacking)} (Backend.wide_types)"


def rshape(rng, lo=1, hi=6, dims=4):
    return tuple(int(x) for x in rng.integers(lo, hi + 1, dims))


LAYOUTS = ("contig", "strided", "permuted", "transposed")

# ---------------------------------------------------------------------------------------------
# views (they compute nothing: the cases read them back through a cont, and write through them)


@case("VIEW", "windows_overlap", exact=True)
def _(rng):
    b = Built(Context())
    n_cols, n, ch = 3, int(rng.integers(2, 7)), int(rng.integers(1, 5))
    x = b.leaf(f32, (n_cols + n, ch, 2), rng=rng)
    kw = min(n, 4)
    w = mg.view_4d(x, n_cols, kw, ch, 2, 4, x.nb[1], x.nb[2], (n - kw + 1) * 4)
    b.out(mg.cont(w))
    return b


@case("VIEW", "view_2d_3d_1d", exact=True)
def _(rng):
    b = Built(Context())
    x = b.leaf(f32, rshape(rng, 2, 6), rng=rng)
    b.out(mg.cont(mg.view_2d(x, x.ne[0] - 1, x.ne[1], x.nb[1], 4)))
    b.out(mg.cont(mg.view_3d(x, 1, x.ne[1], x.ne[2], x.nb[1], x.nb[2], 0)))
    b.out(mg.cont(mg.view_1d(x, x.ne[0], x.nb[1])))
    return b


@case("RESHAPE", "reshape_nd", exact=True)
def _(rng):
    b = Built(Context())
    ne = rshape(rng, 1, 5)
    x = b.leaf(f32, ne, rng=rng)
    y = mg.reshape_2d(x, ne[0] * ne[1], ne[2] * ne[3])
    b.out(mg.cont(mg.transpose(y)))
    b.out(mg.add(mg.reshape_3d(x, ne[0], ne[1] * ne[2], ne[3]), mg.reshape_1d(mg.view_1d(x, ne[0], 0), ne[0])))
    b.out(mg.cont(mg.reshape_4d(x, ne[3], ne[2], ne[1], ne[0])))
    return b


@case("PERMUTE", "permute_random", exact=True)
def _(rng):
    b = Built(Context())
    x = b.leaf(f32, rshape(rng, 1, 5), rng=rng)
    axes = [int(a) for a in rng.permutation(4)]
    b.out(mg.cont(mg.permute(x, *axes)))
    return b


@case("CONT", "transpose_tiles", exact=True)
def _(rng):
    """A transpose wide enough for whole 8x8 tiles and their partial edges (the small random
    shapes above rarely reach one)."""
    b = Built(Context())
    x = b.leaf(f32, (int(rng.integers(9, 41)), int(rng.integers(9, 41)), int(rng.integers(1, 3))), rng=rng)
    b.out(mg.cont(mg.transpose(x)))
    return b


@case("TRANSPOSE", "transpose", exact=True)
def _(rng):
    b = Built(Context())
    x = b.leaf(f32, rshape(rng, 1, 6, 3), rng=rng)
    b.out(mg.cont(mg.transpose(x)))
    return b


# ---------------------------------------------------------------------------------------------
# copies

for _layout in LAYOUTS:
    @case("CONT", _layout, exact=True)
    def _(rng, _layout=_layout):
        b = Built(Context())
        t = [f32, f16, i32][int(rng.integers(0, 3))]
        b.out(mg.cont(b.input(rng, t, rshape(rng, 1, 6), _layout)))
        return b

    @case("CPY", _layout, exact=True)
    def _(rng, _layout=_layout):
        b = Built(Context())
        ne = rshape(rng, 1, 5)
        src = b.input(rng, f32, ne, _layout)
        dst = b.leaf(f32, (ne[1], ne[0], ne[3] * ne[2]), rng=rng)     # other shape, same count
        b.out(mg.cpy(src, dst))
        b.out(dst)
        return b

    @case("CONCAT", _layout, exact=True)
    def _(rng, _layout=_layout):
        b = Built(Context())
        dim = int(rng.integers(0, 4))
        ne_a = list(rshape(rng, 1, 4))
        ne_b = list(ne_a)
        ne_b[dim] = int(rng.integers(1, 4))
        t = [f32, f16, i32][int(rng.integers(0, 3))]
        b.out(mg.concat(b.input(rng, t, ne_a, _layout), b.input(rng, t, ne_b, "contig"), dim))
        return b


@case("CONCAT", "dim0_transposed_operands", exact=True)
def _(rng):
    """A conv layer's input: history rows joined to a prefill's tokens transposed to channel rows,
    either operand (or both) dense along dim 1, with runs of rows and tokens on and off multiples
    of 8."""
    b = Built(Context())
    ne1, ne2, ne3 = int(rng.integers(1, 41)), int(rng.integers(1, 4)), int(rng.integers(1, 3))
    ne_a, ne_b = int(rng.integers(1, 21)), int(rng.integers(1, 41))
    t = [f32, i32][int(rng.integers(0, 2))]
    lay_a, lay_b = [("strided", "transposed"), ("transposed", "contig"), ("transposed", "transposed")][int(rng.integers(0, 3))]
    b.out(mg.concat(b.input(rng, t, (ne_a, ne1, ne2, ne3), lay_a), b.input(rng, t, (ne_b, ne1, ne2, ne3), lay_b), 0))
    return b


@case("CPY", "f32_to_f16_view_dst", exact=True)
def _(rng):
    b = Built(Context())
    src = b.leaf(f32, (4, 3), rng=rng)
    dst = b.leaf(f16, (6, 5), rng=rng)
    b.out(mg.cpy(src, mg.view_2d(dst, 4, 3, dst.nb[1], 2 * 2)))
    b.out(dst)
    return b


@case("CPY", "rows_into_wider_rows", exact=True)
def _(rng):
    """Source rows of a few elements (a window of each channel's columns) into the dense rows of
    a wider tensor, several source rows to each: the conv history store's shape."""
    b = Built(Context())
    n_cols, ch, n_seqs = int(rng.integers(1, 5)), int(rng.integers(2, 40)), int(rng.integers(1, 5))
    x = b.leaf(f32, (n_cols + 2, ch, n_seqs), rng=rng)
    s = b.leaf(f32, (3 * n_cols * ch, n_seqs + 1), rng=rng)
    window = mg.view_3d(x, n_cols, ch, n_seqs, x.nb[1], x.nb[2], 2 * 4)
    cells = mg.view_2d(s, n_cols * ch, n_seqs, s.nb[1], s.nb[1] + n_cols * ch * 4)
    b.out(mg.cpy(window, cells))
    b.out(s)
    return b


for _from, _to in [(f32, f16), (f16, f32), (f32, i32), (i32, f32)]:
    @case("CPY", f"cast_{_from.name}_{_to.name}", exact=True)
    def _(rng, _from=_from, _to=_to):
        b = Built(Context())
        ne = rshape(rng, 1, 6)
        if _from == i32:
            x = b.leaf(_from, ne, rng=rng)
        else:
            vals = rng.uniform(-40, 40, tuple(reversed(ne)))     # fractions: f->i truncates toward 0
            x = b.leaf(_from, ne, data=vals)
        b.out(mg.cast(x, _to))
        return b


@case("REPEAT", "tile", exact=True)
def _(rng):
    b = Built(Context())
    ne = rshape(rng, 1, 3)
    reps = rshape(rng, 1, 3)
    x = b.leaf(f32, ne, rng=rng)
    b.out(mg.repeat_4d(x, *(n * r for n, r in zip(ne, reps))))
    like = b.ctx.new_tensor(f32, [n * r for n, r in zip(ne, reps)])
    b.out(mg.repeat(x, like))
    return b


# ---------------------------------------------------------------------------------------------
# index ops

for _ti in (i32, i64):
    for _layout in ("contig", "strided"):
        @case("SET_ROWS", f"{_ti.name}_{_layout}", exact=True)
        def _(rng, _ti=_ti, _layout=_layout):
            b = Built(Context())
            ne0, n_rows, n_set = int(rng.integers(1, 7)), int(rng.integers(3, 9)), None
            n_set = int(rng.integers(1, n_rows + 1))
            ne2, ne3 = int(rng.integers(1, 4)), int(rng.integers(1, 3))
            c1 = [d for d in range(1, ne2 + 1) if ne2 % d == 0][int(rng.integers(0, 2)) % len([d for d in range(1, ne2 + 1) if ne2 % d == 0])]
            c2 = [d for d in range(1, ne3 + 1) if ne3 % d == 0][-1]
            dst = b.leaf(f32, (ne0, n_rows, ne2, ne3), rng=rng)
            src = b.input(rng, f32, (ne0, n_set, ne2, ne3), _layout)
            idx = np.stack([rng.permutation(n_rows)[:n_set] for _ in range(c1 * c2)]).reshape(c2, c1, n_set)
            c = b.leaf(_ti, (n_set, c1, c2), data=idx)
            b.out(mg.set_rows(dst, src, c))
            b.out(dst)
            return b


@case("SET_ROWS", "f16_dst", exact=True)
def _(rng):
    b = Built(Context())
    dst = b.leaf(f16, (5, 6), rng=rng)
    src = b.leaf(f32, (5, 3), rng=rng)
    c = b.leaf(i64, (3,), data=rng.permutation(6)[:3])
    b.out(mg.set_rows(dst, src, c))
    b.out(dst)
    return b


@case("SET_ROWS", "overlapping_windows_into_permuted_slots", exact=True)
def _(rng):
    """The conv-state store, in small: overlapping source rows, permuted destination."""
    b = Built(Context())
    n_cols, n, ch, n_seqs, K, mem = 3, int(rng.integers(1, 6)), 2, 2, 3, 4
    kw = min(n, K)
    s = b.leaf(f32, (n_cols * ch, mem * K), rng=rng)
    x = b.leaf(f32, (n_cols + n, ch, n_seqs), rng=rng)
    order = b.leaf(i32, (kw,), data=np.arange(kw)[::-1])
    windows = mg.view_4d(x, n_cols, kw, ch, n_seqs, 4, x.nb[1], x.nb[2], (n - kw + 1) * 4)
    slots = mg.view_4d(s, n_cols, K, ch, n_seqs, mem * s.nb[1], n_cols * 4, s.nb[1], 1 * s.nb[1])
    b.out(mg.set_rows(slots, windows, order))
    b.out(s)
    return b


for _layout in ("contig", "strided"):
    @case("GET_ROWS", _layout, exact=True)
    def _(rng, _layout=_layout):
        b = Built(Context())
        ne0, n_rows, ne2, ne3 = (int(v) for v in rshape(rng, 1, 5))
        n_rows += 1
        t = [f32, f16, i32][int(rng.integers(0, 3))]
        a = b.input(rng, t, (ne0, n_rows, ne2, ne3), _layout)
        n_get = int(rng.integers(1, 7))
        ids = b.leaf(i32, (n_get, ne2, ne3), data=rng.integers(0, n_rows, (ne3, ne2, n_get)))
        b.out(mg.get_rows(a, ids))
        return b


@case("ARANGE", "arange", exact=True)
def _(rng):
    b = Built(Context())
    start = float(rng.integers(-5, 5))
    step = float(rng.choice([0.5, 1.0, 3.0]))
    b.out(mg.arange(b.ctx, start, start + float(rng.integers(1, 20)), step))
    return b


# ---------------------------------------------------------------------------------------------
# elementwise and reductions

# generic builders: an op declares which one makes its cases (registry.CaseGen, e.g.
# `cases("unary", data=np.abs)` on SQRT); each builder registers that op's cases here.

def _unary_cases(d, exact=False, data=None):
    """contig and strided inputs, and the in-place form on an intermediate."""
    for layout in ("contig", "strided"):
        @case(d.name, layout, exact=exact, nmse=1e-12)
        def _(rng, layout=layout):
            b = Built(Context())
            x = b.input(rng, f32, rshape(rng, 1, 6), layout)
            if data is not None:
                b.data[x.root()] = data(b.data[x.root()])
            b.out(build(d.name, a=x, inplace=False))
            return b

    @case(d.name, "inplace", exact=exact, nmse=1e-12)
    def _(rng):
        b = Built(Context())
        x = b.leaf(f32, rshape(rng, 1, 6), rng=rng)
        if data is not None:
            b.data[x] = data(b.data[x])
        y = mg.add(x, x)   # an intermediate to work in place on
        b.out(build(d.name, a=y, inplace=True))
        return b


def _binary_cases(d, exact=False):
    """b broadcast over a (each extent of a a multiple of b's), contig and strided."""
    for layout in ("contig", "strided"):
        @case(d.name, f"broadcast_{layout}", exact=exact, nmse=1e-12)
        def _(rng, layout=layout):
            b = Built(Context())
            ne_b = rshape(rng, 1, 3)
            reps = rshape(rng, 1, 3)
            a = b.input(rng, f32, [n * r for n, r in zip(ne_b, reps)], layout)
            bb = b.input(rng, f32, ne_b, layout)
            b.out(build(d.name, a=a, b=bb, inplace=False))
            return b


def _row_cases(d, **params):
    """Row ops over dim 0: rows up to 40 wide, contig and strided."""
    for layout in ("contig", "strided"):
        @case(d.name, layout, nmse=1e-12)
        def _(rng, layout=layout):
            b = Built(Context())
            b.out(build(d.name, a=b.input(rng, f32, rshape(rng, 1, 40, 1) + rshape(rng, 1, 4, 3), layout), **params))
            return b


BUILDERS = {"unary": _unary_cases, "binary": _binary_cases, "rows": _row_cases}

for _d in list(OPS.values()):
    for _gen in _d.case_gens:
        BUILDERS[_gen.builder](_d, **_gen.options)


@case("SCALE", "scale_and_bias", nmse=1e-12)
def _(rng):
    b = Built(Context())
    x = b.input(rng, f32, rshape(rng, 1, 6), "contig")
    b.out(mg.scale(x, float(rng.uniform(-2, 2))))
    b.out(mg.scale_bias(x, float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2))))
    return b


@case("SCALE", "slot_order_chain", exact=True)
def _(rng):
    """The per-layer slot order: arange -> scale_bias(-1, K-1) -> cast(i32) -> tail view."""
    b = Built(Context())
    K = int(rng.integers(1, 9))
    kw = int(rng.integers(1, K + 1))
    rev = mg.cast(mg.scale_bias(mg.arange(b.ctx, 0.0, float(K), 1.0), -1.0, float(K - 1)), i32)
    b.out(rev)
    b.out(mg.cont(mg.view_1d(rev, kw, (K - kw) * 4)))
    return b


@case("SCALE", "inplace_zero_row", exact=True)
def _(rng):
    """build_rs's zero row: scale_inplace(view_1d(states, ...), 0) writes through into the state."""
    b = Built(Context())
    s = b.leaf(f32, (5, 4), rng=rng)
    z = int(rng.integers(0, 4))
    b.out(mg.scale_inplace(mg.view_1d(s, 5, z * s.nb[1]), 0.0))
    b.out(s)
    return b


def _soft_max_input(b, rng, ne, layout):
    """An input ggml calls contiguous (soft_max requires it) in three layouts: contig; window (a
    dense view at an offset inside a larger buffer, data on both sides); permuted (a permute view
    that moves only a unit dim, so it stays dense)."""
    if layout == "contig":
        return b.leaf(f32, ne, rng=rng)
    if layout == "window":
        n = int(np.prod(ne))
        base = b.leaf(f32, (n + 7,), rng=rng)
        nb = contiguous_strides(f32, ne)
        return mg.view_4d(base, *ne, *nb[1:], 3 * 4)
    base = b.leaf(f32, (ne[0], 1, ne[1], ne[3]), rng=rng)   # layout == "permuted" (needs ne[2] == 1)
    return mg.permute(base, 0, 2, 1, 3)


def _causal_mask(rng, ne):
    """Random f32 mask rows with -inf past the diagonal (column 0 always finite)."""
    m = rng.uniform(-1.0, 1.0, tuple(reversed(ne)))
    m = np.where(np.abs(m) < 1e-3, 0.5, m)
    i1, i0 = np.arange(ne[1])[:, None], np.arange(ne[0])[None, :]
    return np.where(i0 > i1 + ne[0] // 2, -np.inf, m).astype(np.float32)


for _layout, _with_mask in (("contig", False), ("contig", True), ("window", True), ("permuted", True)):
    @case("SOFT_MAX", f"{_layout}{'_mask_broadcast' if _with_mask else ''}", nmse=1e-12)
    def _(rng, _layout=_layout, _with_mask=_with_mask):
        b = Built(Context())
        ne0, ne1 = int(rng.integers(1, 41)), int(rng.integers(1, 6))
        m2, m3 = (int(v) for v in rshape(rng, 1, 2, 2))
        r2, r3 = (int(v) for v in rshape(rng, 1, 3, 2))
        ne = (ne0, ne1, 1 if _layout == "permuted" else m2 * r2, m3 * r3)
        a = _soft_max_input(b, rng, ne, _layout)
        mask = None
        if _with_mask:
            m_ne = (ne0, ne1 + int(rng.integers(0, 3)), 1 if _layout == "permuted" else m2, m3)
            mask = _soft_max_input(b, rng, m_ne, "window" if _layout == "window" else "contig")
            if _layout != "window":   # a window's rows are cut from a 1-D buffer: finite values
                b.data[mask.root()] = _causal_mask(rng, mask.root().ne)
        b.out(mg.soft_max_ext(a, mask, float(rng.uniform(0.1, 2.0)), 0.0))
        return b


for _layout in ("contig", "strided"):
    @case("MUL_MAT", f"broadcast_{_layout}", nmse=1e-10)
    def _(rng, _layout=_layout):
        b = Built(Context())
        k, m, n = (int(v) for v in rshape(rng, 1, 33, 3))
        a2, a3 = (int(v) for v in rshape(rng, 1, 2, 2))
        r2, r3 = (int(v) for v in rshape(rng, 1, 2, 2))
        a = b.input(rng, f32, (k, m, a2, a3), _layout)
        x = b.input(rng, f32, (k, n, a2 * r2, a3 * r3), _layout)
        b.out(mg.mul_mat(a, x))
        return b


# ---------------------------------------------------------------------------------------------
# recurrent ops

@case("SSM_CONV", "conv", nmse=1e-12)
def _(rng):
    b = Built(Context())
    d_conv, d_inner, n_t, n_s = int(rng.integers(2, 5)), int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 4))
    x = b.leaf(f32, (d_conv - 1 + n_t, d_inner, n_s), rng=rng)
    c = b.leaf(f32, (d_conv, d_inner), rng=rng)
    b.out(mg.ssm_conv(x, c))
    return b


@case("SSM_CONV", "concat_input_strided_seqs", nmse=1e-12)
def _(rng):
    b = Built(Context())
    d_conv, d_inner, n_t, n_s = 4, int(rng.integers(1, 7)), int(rng.integers(1, 5)), 2
    hist = b.input(rng, f32, (d_conv - 1, d_inner, n_s), "strided")
    xt = b.input(rng, f32, (n_t, d_inner, n_s), "transposed")
    c = b.leaf(f32, (d_conv, d_inner), rng=rng)
    b.out(mg.ssm_conv(mg.concat(hist, xt, 0), c))
    return b


def _ssm_scan_built(rng, K, n_t, mamba1=False):
    b = Built(Context())
    d_state, head_dim, n_group = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 3))
    n_head, n_seqs = n_group * int(rng.integers(1, 3)), int(rng.integers(1, 4))
    rows = n_seqs + 2
    s = b.leaf(f32, (d_state, head_dim, n_head, rows), rng=rng)
    x = b.leaf(f32, (head_dim, n_head, n_t, n_seqs), rng=rng)
    dt = b.leaf(f32, (n_head, n_t, n_seqs), data=rng.uniform(-3, 3, (n_seqs, n_t, n_head)))
    A = b.leaf(f32, (d_state if mamba1 else 1, n_head), data=-rng.uniform(0.1, 1.0, (n_head, d_state if mamba1 else 1)))
    B = b.leaf(f32, (d_state, n_group, n_t, n_seqs), rng=rng)
    C = b.leaf(f32, (d_state, n_group, n_t, n_seqs), rng=rng)
    ids = b.leaf(i32, (n_seqs,), data=rng.permutation(rows)[:n_seqs])
    y = mg.ssm_scan(s, x, dt, A, B, C, ids, K)
    ny = x.nelements()
    per_slot = d_state * head_dim * n_head * n_seqs
    mask = np.zeros(y.nelements(), bool)
    mask[: ny + min(n_t, K) * per_slot] = True    # slots >= n_t are left unwritten
    b.out(y, mask=mask)
    return b


@case("SSM_SCAN", "mamba2_K1", nmse=1e-10)
def _(rng):
    return _ssm_scan_built(rng, 1, int(rng.integers(1, 6)))


@case("SSM_SCAN", "mamba2_K4_snapshots", nmse=1e-10)
def _(rng):
    return _ssm_scan_built(rng, 4, int(rng.integers(1, 7)))


@case("SSM_SCAN", "mamba1_K1", nmse=1e-10)
def _(rng):
    return _ssm_scan_built(rng, 1, int(rng.integers(1, 5)), mamba1=True)


def _gdn_built(rng, K, kda: bool):
    b = Built(Context())
    S, H_k = int(rng.integers(1, 9)), int(rng.integers(1, 3))
    H = H_k * int(rng.integers(1, 3))
    T, n_seqs = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    def unit_rows(shape):
        x = rng.uniform(-1, 1, shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = b.leaf(f32, (S, H_k, T, n_seqs), data=unit_rows((n_seqs, T, H_k, S)))
    k = b.leaf(f32, (S, H_k, T, n_seqs), data=unit_rows((n_seqs, T, H_k, S)))
    v = b.leaf(f32, (S, H, T, n_seqs), rng=rng)
    g = b.leaf(f32, (S if kda else 1, H, T, n_seqs), data=-rng.uniform(0.01, 1.0, (n_seqs, T, H, S if kda else 1)))
    beta = b.leaf(f32, (1, H, T, n_seqs), data=rng.uniform(0.1, 0.9, (n_seqs, T, H, 1)))
    st = b.leaf(f32, (S, S, H, n_seqs), rng=rng)
    out = mg.gated_delta_net(q, k, v, g, beta, st, K)
    n_o = S * H * T * n_seqs
    mask = np.zeros(out.nelements(), bool)
    mask[: n_o + min(T, K) * S * S * H * n_seqs] = True
    b.out(out, mask=mask.reshape(tuple(reversed(out.ne[:2]))))
    return b


@case("GATED_DELTA_NET", "scalar_gate_K1", nmse=1e-10)
def _(rng):
    return _gdn_built(rng, 1, False)


@case("GATED_DELTA_NET", "scalar_gate_K3", nmse=1e-10)
def _(rng):
    return _gdn_built(rng, 3, False)


@case("GATED_DELTA_NET", "kda_gate_K3", nmse=1e-10)
def _(rng):
    return _gdn_built(rng, 3, True)


# ---------------------------------------------------------------------------------------------
# rope


def _rope_input(b, rng, ne, layout):
    """a for ROPE in the layouts llama.cpp feeds it: contig; strided (a view with padded rows and
    planes, as a slice of a fused QKV projection); permuted (heads and tokens swapped in memory,
    dim 0 kept dense, as rope after a permute)."""
    if layout == "permuted":
        base = b.leaf(f32, (ne[0], ne[2], ne[1], ne[3]), rng=rng)
        return mg.permute(base, 0, 2, 1, 3)
    return b.input(rng, f32, ne, layout)


def _rope_built(rng, mode, layout, yarn=False, freq_factors=False):
    from minigraph.ops.rope import MULTI_MODES
    b = Built(Context())
    half = int(rng.integers(1, 9))
    n0 = 2 * half + int(rng.integers(0, 2)) * 2 * int(rng.integers(0, 3))   # sometimes dims past n_dims
    ne = (n0, int(rng.integers(1, 5)), int(rng.integers(1, 6)), int(rng.integers(1, 3)))
    n_dims = 2 * int(rng.integers(1, half + 1))
    a = _rope_input(b, rng, ne, layout)
    multi = mode in MULTI_MODES
    pos = b.leaf(i32, ((4 if multi else 1) * ne[2],), data=rng.integers(0, 3000, (4 if multi else 1) * ne[2]))
    c = None
    if freq_factors:
        n_ff = n_dims // 2 + int(rng.integers(0, 3))
        c = b.leaf(f32, (n_ff,), data=rng.uniform(0.5, 4.0, n_ff))
    fl = dict(n_ctx_orig=int(rng.integers(512, 8192)), freq_base=float(rng.choice([10000.0, 500000.0, 1e6])),
              freq_scale=float(rng.uniform(0.1, 1.0)) if yarn else 1.0, ext_factor=float(rng.uniform(0.5, 1.0)) if yarn else 0.0,
              attn_factor=float(rng.uniform(0.5, 1.5)), beta_fast=32.0, beta_slow=1.0)
    if multi:
        pairs = n_dims // 2
        cut = sorted(int(x) for x in rng.integers(0, pairs + 1, 2))
        sections = [max(cut[0], 1), cut[1] - cut[0], pairs - cut[1]]
        sections.append(int(rng.integers(0, 2)) if sum(sections) < n0 else 0)   # ggml: sum <= ne0
        b.out(mg.rope_multi(a, pos, c, n_dims, sections, mode, **fl))
    else:
        b.out(mg.rope_ext(a, pos, c, n_dims, mode, **fl))
    return b


for _mode, _mname in ((0, "normal"), (2, "neox")):
    for _layout in ("contig", "strided", "permuted"):
        @case("ROPE", f"{_mname}_{_layout}", nmse=1e-10)
        def _(rng, _mode=_mode, _layout=_layout):
            return _rope_built(rng, _mode, _layout)

    @case("ROPE", f"{_mname}_yarn_freq_factors", nmse=1e-10)
    def _(rng, _mode=_mode):
        return _rope_built(rng, _mode, "strided", yarn=True, freq_factors=True)

for _mode, _mname in ((8, "mrope"), (40, "imrope")):
    for _layout in ("contig", "permuted"):
        @case("ROPE", f"{_mname}_{_layout}", nmse=1e-10)
        def _(rng, _mode=_mode, _layout=_layout):
            return _rope_built(rng, _mode, _layout)


# ---------------------------------------------------------------------------------------------
# attention


def _fa_built(rng, layout, mask=True, softcap=False, alibi=False):
    """flash_attn_ext on random shapes: contig leaves; or llama.cpp's layout (q a permute of
    [D_k, n_head, n_q], k and v views of the first n_kv rows of larger caches: strided heads)."""
    b = Built(Context())
    dk, dv = int(rng.integers(1, 33)), int(rng.integers(1, 33))
    n_q, n_kv, n_seq = int(rng.integers(1, 6)), int(rng.integers(1, 13)), int(rng.integers(1, 3))
    n_kv_head, group = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    n_head = n_kv_head * group
    if layout == "contig":
        q = b.leaf(f32, (dk, n_q, n_head, n_seq), rng=rng)
        k = b.leaf(f32, (dk, n_kv, n_kv_head, n_seq), rng=rng)
        v = b.leaf(f32, (dv, n_kv, n_kv_head, n_seq), rng=rng)
    else:
        q = mg.permute(b.leaf(f32, (dk, n_head, n_q, n_seq), rng=rng), 0, 2, 1, 3)
        n_ctx = n_kv + int(rng.integers(1, 5))
        kc = b.leaf(f32, (dk, n_ctx, n_kv_head, n_seq), rng=rng)
        vc = b.leaf(f32, (dv, n_ctx, n_kv_head, n_seq), rng=rng)
        k = mg.view_4d(kc, dk, n_kv, n_kv_head, n_seq, kc.nb[1], kc.nb[2], kc.nb[3], 0)
        v = mg.view_4d(vc, dv, n_kv, n_kv_head, n_seq, vc.nb[1], vc.nb[2], vc.nb[3], 0)
    m = None
    if mask:
        m2 = n_head if alibi or rng.integers(0, 2) else 1
        m_ne = (n_kv + int(rng.integers(0, 3)), n_q + int(rng.integers(0, 3)), m2, 1)
        vals = rng.uniform(-1.0, 1.0, tuple(reversed(m_ne)))
        i1, i0 = np.arange(m_ne[1])[:, None], np.arange(m_ne[0])[None, :]
        vals = np.where(i0 > i1 + n_kv - n_q, -np.inf, vals)   # causal over the last n_q positions
        m = b.leaf(f16, m_ne, data=vals)
    b.out(mg.flash_attn_ext(q, k, v, m, float(rng.uniform(0.05, 1.0)), float(rng.uniform(1.0, 8.0)) if alibi else 0.0,
                            float(rng.uniform(5.0, 30.0)) if softcap else 0.0))
    return b


for _name, _kw in (("contig_nomask", dict(layout="contig", mask=False)), ("contig_mask", dict(layout="contig")),
                   ("cache_views_mask", dict(layout="cache")), ("softcap", dict(layout="cache", softcap=True)),
                   ("alibi", dict(layout="contig", alibi=True))):
    @case("FLASH_ATTN_EXT", _name, nmse=1e-10)
    def _(rng, _kw=_kw):
        return _fa_built(rng, **_kw)


def cases_for(op: str) -> list[Case]:
    return [c for c in CASES if c.op == op]


def ops_without_cases() -> list[str]:
    return sorted(set(OPS) - {c.op for c in CASES})


def run_built(b: Built, backend, graph_hook=None) -> list[np.ndarray]:
    """Allocate the leaves on ``backend``, fill them, compute, and read every out back."""
    from minigraph.backend import alloc_ctx_tensors
    from minigraph.graph import Graph
    alloc_ctx_tensors(b.ctx, backend)
    for t, arr in b.data.items():
        t.set(arr)
    gf = Graph()
    for o in b.outs:
        o.set_output()
        gf.build_forward_expand(o)
    if graph_hook is not None:
        graph_hook(gf)
    backend.graph_compute(gf)
    return [o.numpy() for o in b.outs]


from minigraph.testing import quant_cases as _quant_cases  # noqa: E402,F401  (adds the typed cases)


def nmse(actual: np.ndarray, expected: np.ndarray) -> float:
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    denom = float(np.sum(e * e))
    err = float(np.sum((a - e) ** 2))
    return err / denom if denom > 0 else err


def compare(case: Case, b: Built, actual: list, expected: list, nmse_limit: float | None = None) -> str | None:
    """None when they agree under the case's rule, else a one-line reason."""
    limit = case.nmse if nmse_limit is None else nmse_limit
    for i, (a, e) in enumerate(zip(actual, expected)):
        m = b.masks.get(i)
        if m is not None:
            a, e = a[m], e[m]
        if a.shape != e.shape:
            return f"out {i}: shape {a.shape} != {e.shape}"
        if case.exact or a.dtype.kind != "f":
            if not np.array_equal(a.view(np.uint8) if a.dtype.kind == "f" else a,
                                  e.view(np.uint8) if e.dtype.kind == "f" else e):
                bad = np.argwhere(a != e)[:3].tolist()
                return f"out {i}: not bit-exact, first differences at {bad}"
        else:
            err = nmse(a, e)
            if not err <= limit:
                return f"out {i}: NMSE {err:.3g} > {limit:.3g}"
    return None
