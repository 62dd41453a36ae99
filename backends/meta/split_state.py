"""Split states of ggml's meta backend (ggml-backend-meta.cpp): how one logical
tensor is spread over the simple devices of a meta device, and the rules that derive every
tensor's state from its sources.

A state is an axis (AXIS_0..3: each device holds a slice along that dim; MIRRORED: every device
holds the whole tensor; PARTIAL: every device holds a full-shape partial sum) plus, for a split,
the per-device extents of each segment and how often each segment repeats along the axis. Along
the split axis the logical index space is laid out as

    for segment s: for repeat r in range(nr[s]): for device j: ne[s][j] elements

and device j holds its pieces in the same order, concatenated. Weights and caches get their
state from a user callback; everything else derives it with ggml's per-op rules (views in the
six-step order including the permuted-view rule). A tensor whose state cannot be derived
raises OpError naming it and the rule that failed; every tensor records the rule that set it.

Deviations from ggml (each turns a silent mis-computation or an abort into a checked rule):
  * ARANGE (and any other source-less op) is MIRRORED (the per-layer slot order is built from one).
  * A tensor without elements is MIRRORED ("empty"); ggml marks it UNKNOWN and aborts when it
    is used as a source (build_rs's zero-row view has 0 elements when no cell needs zeroing).
  * reshape/cont/cpy/contiguous views: when ggml's rule puts the split on a result dim that cuts
    through the source's per-device chunks (its second branch), the chunks each device holds are
    checked to be the same before and after; ggml would compute garbage otherwise. (The other
    branches are left alone: ggml's rules erase repeats, e.g. after mul_mat or ssm_conv, so a
    state's logical layout may differ from the physical one the per-device kernels rely on.)
  * A write-through node (cpy into a view, set_rows, in-place op) must have its destination's
    state, since it *is* that memory (ggml checks this only for set_rows).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

from minigraph.errors import OpError
from minigraph.registry import OPS
from minigraph.sources import srcs_of
from minigraph.tensor import MAX_DIMS, Tensor

AXIS_0, AXIS_1, AXIS_2, AXIS_3 = 0, 1, 2, 3
MIRRORED = 10
PARTIAL = 11
NONE = 98
UNKNOWN = 99

_AXIS_NAMES = {0: "AXIS_0", 1: "AXIS_1", 2: "AXIS_2", 3: "AXIS_3", MIRRORED: "MIRRORED",
               PARTIAL: "PARTIAL", NONE: "NONE", UNKNOWN: "UNKNOWN"}


def axis_name(axis: int) -> str:
    return _AXIS_NAMES.get(axis, f"?{axis}")


@dataclass(frozen=True)
class SplitState:
    """axis, and for a split: ne[s][j] = extent of segment s on device j, nr[s] = repeats."""
    axis: int
    ne: tuple = ()
    nr: tuple = (1,)

    # -- constructors ---------------------------------------------------------------------
    @staticmethod
    def mirrored() -> "SplitState":
        return SplitState(MIRRORED)

    @staticmethod
    def partial() -> "SplitState":
        return SplitState(PARTIAL)

    @staticmethod
    def split(axis: int, shares: Sequence[int], nr: int = 1) -> "SplitState":
        """One segment: device j holds shares[j] elements of axis per repeat."""
        if not 0 <= axis < MAX_DIMS:
            raise ValueError(f"split axis must be 0..3, got {axis}")
        return SplitState(axis, (tuple(int(x) for x in shares),), (int(nr),))

    @staticmethod
    def segmented(axis: int, segments: Sequence[Sequence[int]], nr: Sequence[int] | None = None) -> "SplitState":
        """Several segments (e.g. a fused QKV weight: Q, K and V each split on their own)."""
        segs = tuple(tuple(int(x) for x in s) for s in segments)
        nr = tuple(int(x) for x in (nr if nr is not None else [1] * len(segs)))
        if len(nr) != len(segs) or not segs:
            raise ValueError("segmented: one repeat count per segment, at least one segment")
        return SplitState(axis, segs, nr)

    # -- queries --------------------------------------------------------------------------
    @property
    def is_split(self) -> bool:
        return 0 <= self.axis < MAX_DIMS

    @property
    def n_segments(self) -> int:
        return len(self.ne)

    def n_dev(self) -> int:
        return len(self.ne[0]) if self.ne else 0

    def share(self, j: int) -> int:
        """Elements of the split axis device j holds (all segments and repeats)."""
        return sum(seg[j] * r for seg, r in zip(self.ne, self.nr))

    def shares(self) -> tuple:
        return tuple(self.share(j) for j in range(self.n_dev()))

    def total(self) -> int:
        return sum(self.shares())

    def equal(self, other: "SplitState") -> bool:
        """ggml's split_states_equal: same axis and the same per-device totals."""
        if self.axis != other.axis:
            return False
        if not self.is_split:
            return True
        return self.shares() == other.shares()

    def chunks(self, j: int) -> list:
        """(global start, local start, length) of device j's pieces along the axis."""
        out, g, l = [], 0, 0
        for seg, r in zip(self.ne, self.nr):
            for _ in range(r):
                for jj, n in enumerate(seg):
                    if jj == j and n:
                        out.append((g, l, n))
                        l += n
                    g += n
        return out

    def local_coord(self, g: int, j: int) -> int:
        """Device j's coordinate for the global coordinate g of the split axis: the start of
        device j's piece of the (segment, repeat) block holding g, plus g's offset inside the
        block scaled by device j's share of the block (ggml's proportional view offsets)."""
        G, L = 0, 0
        for seg, r in zip(self.ne, self.nr):
            B = sum(seg)
            for _ in range(r):
                if G <= g < G + B:
                    w = g - G
                    if (w * seg[j]) % B:
                        raise OpError(f"offset {g} along the split axis is not aligned to device {j}'s "
                                      f"share {seg[j]} of a block of {B}")
                    return L + w * seg[j] // B
                G += B
                L += seg[j]
        if g == G:
            return L
        raise OpError(f"coordinate {g} is outside the split axis of {G} elements")

    def __str__(self) -> str:
        if not self.is_split:
            return axis_name(self.axis)
        if self.n_segments == 1 and self.nr[0] == 1:
            return f"{axis_name(self.axis)} {{{','.join(map(str, self.ne[0]))}}}"
        segs = ",".join(f"[{','.join(map(str, s))}]x{r}" for s, r in zip(self.ne, self.nr))
        return f"{axis_name(self.axis)} {{{segs}}}"

    __repr__ = __str__


def even_shares(total: int, n_dev: int, granule: int = 1) -> tuple:
    """Split total elements over n_dev devices in whole granules, the first devices taking the
    remainder (e.g. heads of head_dim elements)."""
    if granule <= 0 or total % granule:
        raise OpError(f"cannot split {total} elements in granules of {granule}")
    units = total // granule
    base, rem = divmod(units, n_dev)
    return tuple((base + (1 if j < rem else 0)) * granule for j in range(n_dev))


# -- the derivation -----------------------------------------------------------------------------

@dataclass
class Entry:
    state: SplitState        # as sources see it (ggml's assume_sync = true)
    own: SplitState          # the node's own result (assume_sync = false): PARTIAL before the all-reduce
    rule: str                # which rule set it
    sig: tuple               # the tensor fields it was derived from (ggml's memcmp cache check)


class _Fail(Exception):
    def __init__(self, rule: str, why: str):
        super().__init__(why)
        self.rule, self.why = rule, why


def is_copy_leaf(t: Tensor) -> bool:
    """A scheduler copy (Tensor without a context named 'device#source#n'): holds whole data."""
    return t.ctx is None and "#" in (t.name or "")


def _src_list(t: Tensor) -> list:
    """Sources in ggml's src[] order (None where absent)."""
    if t.op == "NONE":
        return []
    srcs = srcs_of(t)
    return [srcs.get(name) for name in OPS[t.op].srcs]


def _sig(t: Tensor, srcs) -> tuple:
    buf = t.root().buffer
    return (t.op, t.ne, t.nb, t.view_offs, id(t.view_src), tuple(id(s) for s in srcs),
            buf.usage if buf is not None else None, tuple(sorted(t.flags)), t.name)


SplitCallback = Callable[[Tensor, int], "SplitState | int | None"]


class SplitStates:
    """Derives and caches split states over n_dev devices.

    callback(tensor, n_dev) gives the state of weights and caches (leaves that are neither graph
    inputs nor scheduler copies): a SplitState, an axis (split evenly) or None (= MIRRORED).
    """

    def __init__(self, n_dev: int, callback: SplitCallback | None = None):
        if n_dev < 1:
            raise ValueError("a meta device needs at least one simple device")
        self.n_dev = n_dev
        self.callback = callback
        self._cache: "weakref.WeakKeyDictionary[Tensor, Entry]" = weakref.WeakKeyDictionary()

    def set_callback(self, callback: SplitCallback | None):
        self.callback = callback
        self._cache = weakref.WeakKeyDictionary()

    # -- public ---------------------------------------------------------------------------
    def entry(self, t: Tensor) -> Entry:
        e = self._valid(t)
        if e is not None:
            return e
        for u in self._topo(t):
            if self._valid(u) is None:
                self._cache[u] = self._derive(u)
        return self._cache[t]

    def state(self, t: Tensor, assume_sync: bool = True) -> SplitState:
        e = self.entry(t)
        return e.state if assume_sync else e.own

    def rule(self, t: Tensor) -> str:
        return self.entry(t).rule

    def derive(self, tensors) -> dict:
        """Entries of every tensor given (e.g. gf.leafs + gf.nodes), in order."""
        return {t.id: self.entry(t) for t in tensors}

    def forget(self, t: Tensor):
        self._cache.pop(t, None)

    # -- internals ------------------------------------------------------------------------
    def _valid(self, t: Tensor):
        e = self._cache.get(t)
        if e is not None and e.sig == _sig(t, _src_list(t)):
            return e
        return None

    def _topo(self, t: Tensor) -> list:
        order, seen, stack = [], set(), [(t, False)]
        while stack:
            u, done = stack.pop()
            if done:
                order.append(u)
                continue
            if u.id in seen:
                continue
            seen.add(u.id)
            stack.append((u, True))
            for s in _src_list(u):
                if s is not None and s.id not in seen and self._valid(s) is None:
                    stack.append((s, False))
        return order

    def _derive(self, t: Tensor) -> Entry:
        srcs = _src_list(t)
        sig = _sig(t, srcs)
        try:
            own, state, rule = self._rules(t, srcs)
        except _Fail as f:
            raise OpError(f"split state of {t.op} {t.label}: rule '{f.rule}' failed: {f.why}") from None
        except OpError as e:
            raise OpError(f"split state of {t.op} {t.label}: {e}") from None
        return Entry(state, own, rule, sig)

    def _leaf(self, t: Tensor):
        if t.is_input:
            return SplitState.mirrored(), "leaf: graph input -> MIRRORED"
        if is_copy_leaf(t):
            return SplitState.mirrored(), "leaf: scheduler copy -> MIRRORED"
        st = self.callback(t, self.n_dev) if self.callback is not None else None
        if st is None:
            return SplitState.mirrored(), "leaf: callback gave none -> MIRRORED"
        if isinstance(st, int) and not isinstance(st, SplitState):
            st = SplitState.split(st, even_shares(t.ne[st], self.n_dev))
        if st.is_split:
            if st.n_dev() != self.n_dev or any(len(s) != self.n_dev for s in st.ne):
                raise _Fail("callback", f"state {st} is not over {self.n_dev} devices")
            if st.total() != t.ne[st.axis]:
                raise _Fail("callback", f"state {st} covers {st.total()} elements of axis {st.axis}, "
                                        f"the tensor has {t.ne[st.axis]} (ne={list(t.ne)})")
        elif st.axis not in (MIRRORED, PARTIAL):
            raise _Fail("callback", f"state {st} is neither a split, MIRRORED nor PARTIAL")
        return st, "leaf: callback"

    def _rules(self, t: Tensor, srcs):
        if t.nelements() == 0:
            m = SplitState.mirrored()
            return m, m, "empty tensor -> MIRRORED"
        if t.op == "NONE" and t.view_src is None:
            st, rule = self._leaf(t)
            return st, st, rule
        ss = [self.state(s) if s is not None else None for s in srcs]
        for s, st in zip(srcs, ss):
            if st is not None and st.axis == UNKNOWN:   # pragma: no cover - never stored
                raise _Fail("sources", f"source {s.label} has no state")
        own, rule = _apply_rule(t, srcs, ss, self.n_dev, assume_sync=False)
        if own.axis == PARTIAL and OPS[t.op].split == "mul_mat":
            state = SplitState.mirrored()
        else:
            state = own
        if own.is_split:
            own = _take_ratio(t, srcs, ss, own, rule, self.n_dev)
            state = own
        _check_write_through(t, srcs, ss, own, rule)
        return own, state, rule


# -- rule helpers -------------------------------------------------------------------------------

def _generic(t, srcs, ss, scalar_only: bool, rule: str) -> SplitState:
    ret = None
    for s, st in zip(srcs, ss):
        if s is None or s is t:
            continue
        if ret is None:
            ret = st
        elif not st.equal(ret):
            raise _Fail(rule, f"sources disagree: {_desc(srcs, ss)}")
    if ret is None:
        raise _Fail(rule, "no sources to take a state from")
    if scalar_only and ret.is_split:
        raise _Fail(rule, f"this op cannot run split; sources: {_desc(srcs, ss)}")
    return ret


def _desc(srcs, ss) -> str:
    return ", ".join(f"{s.label}={st}" for s, st in zip(srcs, ss) if s is not None)


def _per_row(t, srcs, ss, rule) -> SplitState:
    if ss[0].axis == AXIS_0:
        raise _Fail(rule, f"a per-row op cannot take {srcs[0].label} split on axis 0 (rows would be cut)")
    return ss[0]


def _bin_bcast(t, srcs, ss, rule) -> SplitState:
    a, b = ss[0], ss[1]
    if a.is_split and srcs[1].ne[a.axis] == 1 and b.axis == MIRRORED:
        return a
    return _generic(t, srcs, ss, False, rule)


def _concat(t, srcs, ss, rule) -> SplitState:
    dim = t.params["dim"]
    a, b = ss[0], ss[1]
    if a.axis == MIRRORED and b.is_split:
        if b.axis == dim:
            raise _Fail(rule, f"{srcs[1].label} is split along the concat dim {dim}")
        return b
    if b.axis == MIRRORED and a.is_split:
        if a.axis == dim:
            raise _Fail(rule, f"{srcs[0].label} is split along the concat dim {dim}")
        return a
    if a.axis == b.axis and a.axis != dim:
        return a
    return _generic(t, srcs, ss, True, rule)


def _mul_mat(t, srcs, ss, assume_sync, rule) -> SplitState:
    a, b = ss[0], ss[1]
    if a.axis == MIRRORED and b.axis == MIRRORED:
        return SplitState.mirrored()
    if a.axis == AXIS_1 and b.axis == MIRRORED:
        return SplitState(AXIS_0, a.ne[:1], (1,))
    if b.axis == AXIS_1 and a.axis == MIRRORED:
        return b
    if a.axis == AXIS_0 and b.axis == AXIS_0:
        if not a.equal(b):
            raise _Fail(rule, f"both split on axis 0 with different shares: {_desc(srcs, ss)}")
        return SplitState.mirrored() if assume_sync else SplitState.partial()
    raise _Fail(rule, f"no mul_mat rule for {_desc(srcs, ss)} (supported: M*M, A1*M, M*A1, A0*A0)")


def _reshape(t, srcs, ss, rule, cut: list | None = None) -> SplitState:
    src, st = srcs[0], ss[0]
    if not st.is_split:
        return st
    if st.n_segments != 1:
        raise _Fail(rule, f"cannot reshape {src.label} with {st.n_segments} segments ({st})")
    a = st.axis
    if a == src.n_dims() - 1 and st.nr[0] == 1:
        return SplitState(t.n_dims() - 1, ((0,) * st.n_dev(),), (1,))
    base_in = 1
    for d in range(a + 1):
        base_in *= src.ne[d]
    base_in //= st.nr[0]
    base_out = 1
    for d in range(MAX_DIMS):
        base_out *= t.ne[d]
        if base_out % base_in == 0:
            return SplitState(d, ((0,) * st.n_dev(),), (base_out // base_in,))
        if base_out > base_in:
            if st.nr[0] != 1:
                raise _Fail(rule, f"{src.label} ({st}) has repeats that do not map onto ne={list(t.ne)}")
            if cut is not None:
                cut.append(d)        # the new split dim cuts through the old per-device chunks
            return SplitState(d, ((0,) * st.n_dev(),), (1,))
    raise _Fail(rule, f"shape mismatch between {src.label} ne={list(src.ne)} and ne={list(t.ne)}")


def _flat_chunks(t: Tensor, st: SplitState) -> tuple:
    """(period, per-device chunk lengths) of a single-segment split in flattened logical order."""
    inner = 1
    for d in range(st.axis):
        inner *= t.ne[d]
    block = sum(st.ne[0])
    return inner * block, tuple(inner * n for n in st.ne[0])


def _cpy(t, srcs, ss, rule, cut=None) -> SplitState:
    if ss[0].is_split:
        return _reshape(t, srcs, ss, rule, cut)
    return _generic(t, srcs, ss, False, rule)


def _view(t, srcs, ss, rule_out: list, cut=None) -> SplitState:
    src, st = srcs[0], ss[0]
    if t.is_contiguous() and src.is_contiguous():
        rule_out[0] = "view 1: view and source contiguous -> reshape rule"
        return _reshape(t, srcs, ss, rule_out[0], cut)
    axis = st.axis
    same = True
    for d in range(MAX_DIMS):
        if t.ne[d] == 1 and src.ne[d] == 1:
            continue
        if t.nb[d] != src.nb[d]:
            same = False
            break
    if same:
        rule_out[0] = "view 2: same strides as the source -> source state"
        return st
    if not t.is_permuted() and not src.is_permuted() and 0 <= axis < MAX_DIMS - 1:
        rule_out[0] = "view 3: not permuted, view.nb[d+1] == src.nb[a+1] -> axis d"
        for d in range(MAX_DIMS - 1):
            if t.nb[d + 1] == src.nb[axis + 1]:
                return SplitState(d, ((0,) * st.n_dev(),), (1,))
        raise _Fail(rule_out[0], f"no view dim d has nb[d+1] == {src.nb[axis + 1]} (source {src.label} "
                                 f"split on axis {axis}); view nb={list(t.nb)}")
    if t.is_permuted() and not src.is_permuted() and 0 <= axis < MAX_DIMS - 1:
        # permuted view: split the view dim that spans the source's split axis; every other dim must
        # lie inside one element of it or outside the span
        rule_out[0] = "view 4: permuted view -> the dim spanning the split axis"
        nb_axis, nb_next = src.nb[axis], src.nb[axis + 1]
        for d in range(MAX_DIMS):
            if t.ne[d] == 1 or t.nb[d] < nb_axis or t.nb[d] * t.ne[d] != nb_next:
                continue
            ok = all(i == d or t.ne[i] == 1 or t.nb[i] * t.ne[i] <= t.nb[d] or t.nb[i] % nb_next == 0
                     for i in range(MAX_DIMS))
            if ok:
                return SplitState(d, ((0,) * st.n_dev(),), (1,))
        # no candidate: ggml falls through to the next rules
    if axis in (MIRRORED, PARTIAL):
        rule_out[0] = "view 5: source MIRRORED/PARTIAL -> same"
        return st
    if t.is_permuted() and not src.is_permuted() and 0 <= axis < MAX_DIMS - 1:
        raise _Fail("view 4: permuted view",
                    f"no dim of the view (ne={list(t.ne)}, nb={list(t.nb)}) spans exactly one element of "
                    f"the source's axis {axis + 1} (nb={nb_next}) with the other dims inside or outside it; "
                    f"source {src.label} is split on axis {axis}")
    raise _Fail("view 6", f"view of permuted tensor not implemented (view nb={list(t.nb)}, source "
                          f"{src.label} nb={list(src.nb)} state {st})")


def _permute(t, srcs, ss, rule) -> SplitState:
    st = ss[0]
    if not st.is_split:
        return st
    if st.n_segments != 1 and st.nr[0] != 1:
        raise _Fail(rule, f"cannot permute {st}")
    axes = t.params["axes"] if t.op == "PERMUTE" else (1, 0, 2, 3)
    return SplitState(axes[st.axis], ((0,) * st.n_dev(),), (st.nr[0],))


def _get_rows(t, srcs, ss, rule) -> SplitState:
    if ss[0].axis == AXIS_0 and ss[1].axis == MIRRORED:
        return ss[0]
    return _generic(t, srcs, ss, True, rule)


def _set_rows(t, srcs, ss, rule) -> SplitState:
    b, c, a = ss
    if b.axis == AXIS_1:
        raise _Fail(rule, f"source rows {srcs[0].label} are split on axis 1 (the row index)")
    if c.axis != MIRRORED:
        raise _Fail(rule, f"indices {srcs[1].label} must be MIRRORED, got {c}")
    if not b.equal(a):
        raise _Fail(rule, f"source {srcs[0].label} ({b}) and destination {srcs[2].label} ({a}) differ")
    return b


def _ssm_conv(t, srcs, ss, rule) -> SplitState:
    a, b = ss
    if a.axis == b.axis:
        if a.axis == AXIS_0:
            return SplitState(AXIS_1, ((0,) * a.n_dev(),), (1,))
        if a.axis == AXIS_1:
            return SplitState(AXIS_0, ((0,) * a.n_dev(),), (1,))
    return _generic(t, srcs, ss, False, rule)


def _gated_delta_net(t, srcs, ss, rule) -> SplitState:
    if all(st.axis == MIRRORED for st in ss):
        return ss[0]
    names = OPS[t.op].srcs
    for i in range(5):
        if ss[i].axis != AXIS_1:
            raise _Fail(rule, f"{names[i]} {srcs[i].label} must be split on axis 1 (heads), got {ss[i]}")
    if ss[5].axis not in (AXIS_0, AXIS_1, AXIS_2):
        raise _Fail(rule, f"state {srcs[5].label} must be split on axis 0, 1 or 2, got {ss[5]}")
    return SplitState(AXIS_0, ((0,) * ss[0].n_dev(),), (1,))


_CUT = " [new split dim cuts the old chunks]"
# The rule each op declares by name (OpDef.split) -> (t, srcs, ss, n_dev, assume_sync) -> (state, rule text)

def _r_generic(t, srcs, ss, n_dev, assume_sync):
    rule = "generic (all sources agree)"
    return _generic(t, srcs, ss, False, rule), rule


def _r_generic_scalar(t, srcs, ss, n_dev, assume_sync):
    rule = "generic (scalar only: all sources MIRRORED)"     # ggml: handle_generic(scalar_only = true)
    return _generic(t, srcs, ss, True, rule), rule


def _r_per_row(t, srcs, ss, n_dev, assume_sync):
    rule = "per-row op keeps src0"
    return _per_row(t, srcs, ss, rule), rule


def _r_soft_max(t, srcs, ss, n_dev, assume_sync):
    # per-row on a; a mask that is not broadcast along a's split axis is indexed with device-local
    # coordinates, so it must be split exactly like a there (a MIRRORED one would hand each device
    # the first heads' / rows' mask)
    rule = "soft_max: per-row on a, mask split like a where it is not broadcast"
    st = _per_row(t, srcs, ss, rule)
    if len(srcs) > 1 and srcs[1] is not None:
        mask, ms = srcs[1], ss[1]
        if st.is_split and mask.ne[st.axis] > 1:
            if not ms.equal(st):
                raise _Fail(rule, f"mask {mask.label} ({ms}) must be split like {srcs[0].label} ({st}) "
                                  f"along {axis_name(st.axis)}, where it is not broadcast")
        elif ms.is_split:
            raise _Fail(rule, f"mask {mask.label} is split ({ms}) but {srcs[0].label} is {st}")
    return st, rule


def _r_rope(t, srcs, ss, n_dev, assume_sync):
    # per-row on a split along heads (axis 1) or dim 3: each row reads its token's position b[i2]
    # and the frequency factors whole, so both must be MIRRORED, and a split along the tokens
    # (axis 2) is refused (device-local token indices would read the first tokens' positions)
    rule = "rope: per-row on a split on heads or dim 3; positions and frequency factors MIRRORED"
    st = _per_row(t, srcs, ss, rule)
    if st.is_split and st.axis == AXIS_2:
        raise _Fail(rule, f"{srcs[0].label} is split along the tokens ({st}); positions are indexed by token")
    for s, ps in zip(srcs[1:], ss[1:]):
        if s is not None and ps.axis != MIRRORED:
            raise _Fail(rule, f"{s.label} must be MIRRORED, got {ps}")
    return st, rule


def _r_flash_attn_ext(t, srcs, ss, n_dev, assume_sync):
    # heads are independent: q split along its heads (axis 2), with k and v split along their
    # heads so that each device keeps whole groups (device j's q heads / group size == its KV
    # heads), gives a result split along its heads (axis 1 of [D_v, n_head, n_q, n_seq]). A mask
    # with one head plane is MIRRORED; one per head must be split like q. All MIRRORED stays so.
    rule = "flash_attn_ext: split along heads (q, k, v axis 2 -> result axis 1), or all MIRRORED"
    q, k, v, mask = (list(srcs) + [None] * 4)[:4]
    qs, ks, vs = ss[0], ss[1], ss[2]
    ms = ss[3] if len(ss) > 3 and mask is not None else SplitState.mirrored()
    if all(x.axis == MIRRORED for x in (qs, ks, vs, ms)):
        return SplitState.mirrored(), rule
    if qs.axis != AXIS_2 or qs.n_segments != 1:
        raise _Fail(rule, f"q {q.label} must be split along its heads (AXIS_2), got {qs}")
    for src, st in ((k, ks), (v, vs)):
        group = q.ne[2] // src.ne[2]
        if st.axis != AXIS_2 or tuple(x * group for x in st.shares()) != qs.shares():
            raise _Fail(rule, f"{src.label} ({st}) must be split along its heads, each device holding "
                              f"its q heads / {group} ({qs})")
    if mask is not None and (ms.axis != MIRRORED if mask.ne[2] == 1 else not ms.equal(qs)):
        raise _Fail(rule, f"mask {mask.label} ({ms}) must be MIRRORED (one head plane) or split like q ({qs})")
    return SplitState.split(AXIS_1, qs.shares()), rule


def _r_bin_bcast(t, srcs, ss, n_dev, assume_sync):
    rule = "binary broadcast"
    return _bin_bcast(t, srcs, ss, rule), rule


def _r_concat(t, srcs, ss, n_dev, assume_sync):
    rule = "concat"
    return _concat(t, srcs, ss, rule), rule


def _r_mul_mat(t, srcs, ss, n_dev, assume_sync):
    rule = f"mul_mat ({ss[0].axis if ss[0].is_split else axis_name(ss[0].axis)}, " \
           f"{ss[1].axis if ss[1].is_split else axis_name(ss[1].axis)})"
    return _mul_mat(t, srcs, ss, assume_sync, rule), rule


def _r_reshape(t, srcs, ss, n_dev, assume_sync):
    cut: list = []
    rule = "reshape (flattened split position)"
    st = _reshape(t, srcs, ss, rule, cut)
    return st, rule + (_CUT if cut else "")


def _r_cpy(t, srcs, ss, n_dev, assume_sync):
    cut: list = []
    rule = "cpy (reshape rule if src0 split, else generic)"
    st = _cpy(t, srcs, ss, rule, cut)
    return st, rule + (_CUT if cut else "")


def _r_view(t, srcs, ss, n_dev, assume_sync):
    cut: list = []
    holder = ["view"]
    st = _view(t, srcs, ss, holder, cut)
    return st, holder[0] + (_CUT if cut else "")


def _simple(name, fn):
    return lambda t, srcs, ss, n_dev, assume_sync: (fn(t, srcs, ss, name), name)


def _r_permute(t, srcs, ss, n_dev, assume_sync):
    rule = t.op.lower()
    return _permute(t, srcs, ss, rule), rule


def _r_mirrored(t, srcs, ss, n_dev, assume_sync):
    return SplitState.mirrored(), f"{t.op}: MIRRORED"


SPLIT_RULES = {
    "generic": _r_generic, "generic_scalar": _r_generic_scalar, "per_row": _r_per_row,
    "soft_max": _r_soft_max, "rope": _r_rope, "flash_attn_ext": _r_flash_attn_ext,
    "bin_bcast": _r_bin_bcast, "concat": _r_concat, "mul_mat": _r_mul_mat, "reshape": _r_reshape,
    "cpy": _r_cpy, "view": _r_view, "permute": _r_permute, "mirrored": _r_mirrored,
    "get_rows": _simple("get_rows", _get_rows), "set_rows": _simple("set_rows", _set_rows),
    "ssm_conv": _simple("ssm_conv", _ssm_conv), "gated_delta_net": _simple("gated_delta_net", _gated_delta_net),
}


def _apply_rule(t, srcs, ss, n_dev, assume_sync):
    op = t.op
    if op == "NONE":   # a leaf view (view_src set but op NONE) does not occur; treat as mirrored
        return SplitState.mirrored(), "leaf -> MIRRORED"
    present = [s for s in srcs if s is not None]
    if not present:
        return SplitState.mirrored(), f"{op}: source-less -> MIRRORED"
    rule_fn = SPLIT_RULES.get(OPS[op].split)
    if rule_fn is None:
        raise _Fail("no rule", f"the meta backend has no split rule for op {op} (it declares split={OPS[op].split!r})")
    return rule_fn(t, srcs, ss, n_dev, assume_sync)


def _take_ratio(t, srcs, ss, st: SplitState, rule: str, n_dev: int) -> SplitState:
    """ggml's last step: the per-device extents come from the first split source, scaled by
    the ratio of the extents along the two axes; every other split source must agree."""
    nr0 = st.nr[0]
    ne = None
    for s, sst in zip(srcs, ss):
        if s is None or not sst.is_split:
            continue
        tot = sst.shares()
        if ne is None:
            ne = []
            for j in range(n_dev):
                num = tot[j] * t.ne[st.axis]
                div = s.ne[sst.axis] * nr0
                if num % div:
                    raise _Fail(rule, f"device {j}'s share {tot[j]} of {s.label} axis {sst.axis} "
                                      f"({s.ne[sst.axis]}) does not scale to a whole part of axis "
                                      f"{st.axis} ({t.ne[st.axis]}, {nr0} repeats)")
                ne.append(num // div)
        else:
            for j in range(n_dev):
                if ne[j] * nr0 * s.ne[sst.axis] != tot[j] * t.ne[st.axis]:
                    raise _Fail(rule, f"source {s.label} ({sst}) is split in another ratio than "
                                      f"{[x.label for x in srcs if x is not None][0]}: {_desc(srcs, ss)}")
    if ne is None:
        raise _Fail(rule, f"a split result ({axis_name(st.axis)}) needs a split source: {_desc(srcs, ss)}")
    out = SplitState(st.axis, (tuple(ne),), (nr0,))
    if rule.endswith(_CUT):
        src, sst = srcs[0], ss[0]
        if sst.is_split and sst.n_segments == 1 and _flat_chunks(src, sst) != _flat_chunks(t, out):
            raise _Fail(rule, f"{src.label} ({sst}, ne={list(src.ne)}) reshaped to ne={list(t.ne)} as "
                              f"{out}: the devices' element chunks would differ (period/chunks "
                              f"{_flat_chunks(src, sst)} vs {_flat_chunks(t, out)})")
    return out


def _check_write_through(t, srcs, ss, own, rule):
    """A node that writes into memory it does not own must have that memory's state."""
    if t.view_src is None or t.op == "NONE" or OPS[t.op].is_view:
        return
    dst_name = OPS[t.op].write_target(t)
    names = OPS[t.op].srcs
    if dst_name is None:
        return
    i = names.index(dst_name)
    dst, dst_st = srcs[i], ss[i]
    if dst is None:
        return
    if not own.equal(dst_st) and not (own.axis == PARTIAL and dst_st.axis == PARTIAL):
        raise _Fail(rule, f"it writes into {dst.label} ({dst_st}) but its own state is {own}")


# -- per-device layouts -------------------------------------------------------------------------

def device_ne_nb(t: Tensor, st: SplitState, j: int) -> tuple:
    """Device j's extents and strides of t: ne[axis] -> its share, every stride larger than
    nb[axis] scaled by share / ne[axis]."""
    if not st.is_split:
        return t.ne, t.nb
    a = st.axis
    share = st.share(j)
    ne = list(t.ne)
    ne[a] = share
    nb = list(t.nb)
    for i in range(MAX_DIMS):
        if t.nb[i] > t.nb[a]:
            if (t.nb[i] * share) % t.ne[a]:
                raise OpError(f"{t.label}: stride nb[{i}]={t.nb[i]} does not scale to device {j}'s share "
                              f"{share}/{t.ne[a]} of axis {a}")
            nb[i] = t.nb[i] * share // t.ne[a]
    return tuple(ne), tuple(nb)


def root_coords(root: Tensor, offs: int) -> list:
    """The logical coordinates of byte offset offs in a contiguous root tensor."""
    elt = root.type.size
    if offs % elt:
        raise OpError(f"view offset {offs} into {root.label} is not a multiple of the element size {elt}")
    i = offs // elt
    c = []
    for d in range(MAX_DIMS):
        n = max(root.ne[d], 1)
        if d == MAX_DIMS - 1:
            c.append(i)
        else:
            c.append(i % n)
            i //= n
    return c


def device_view_offset(root: Tensor, root_st: SplitState, offs: int, j: int) -> int:
    """Device j's byte offset of a view at byte offset offs of the root: the root coordinates
    of offs with the split coordinate mapped to device j, in device j's root strides."""
    if not root_st.is_split or offs == 0:
        return offs
    c = root_coords(root, offs)
    a = root_st.axis
    c[a] = root_st.local_coord(c[a], j)
    _, nb = device_ne_nb(root, root_st, j)
    return sum(ci * b for ci, b in zip(c, nb))


# -- report -------------------------------------------------------------------------------------

def format_states(rows: list) -> str:
    """rows: dicts from MetaBackend.split_report / states_table."""
    w = max([len(r["tensor"][:44]) for r in rows] + [6])
    out = [f"{'tensor':{w}s} {'op':15s} {'state':22s} rule"]
    for r in rows:
        out.append(f"{r['tensor'][:44]:{w}s} {r['op']:15s} {r['state']:22s} {r['rule']}")
    return "\n".join(out)


def states_table(states: SplitStates, tensors) -> list:
    rows = []
    for t in tensors:
        e = states.entry(t)
        st = e.own
        rows.append({"tensor": t.name or t.label, "op": t.op, "state": str(st),
                     "axis": axis_name(st.axis), "shares": list(st.shares()) if st.is_split else None,
                     "rule": e.rule, "all_reduce": st.axis == PARTIAL and t.op != "NONE"})
    return rows


__all__ = ["SplitState", "SplitStates", "Entry", "AXIS_0", "AXIS_1", "AXIS_2", "AXIS_3", "MIRRORED",
           "PARTIAL", "NONE", "UNKNOWN", "axis_name", "even_shares", "device_ne_nb", "device_view_offset",
           "root_coords", "states_table", "format_states", "is_copy_leaf"]
