"""View ops: they compute nothing and alias their source's memory (ggml_view_*, reshape,
permute, transpose). The bounds check uses the true strided extent, so overlapping windows
are legal and a view past the end of its base is refused."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, build, fail, op, require
from ..tensor import Tensor, pad_ne


def check_view_bounds(opname: str, a: Tensor, ne, nb, offset: int):
    require(offset >= 0, opname, f"view of {a.label}: negative offset {offset}")
    require(all(x >= 0 for x in nb), opname, f"view of {a.label}: negative stride in nb={list(nb)}")
    if any(n == 0 for n in ne):
        return
    root = a.root()
    start = a.view_offs + offset
    end = start + a.type.size + sum((n - 1) * b for n, b in zip(ne, nb))
    require(end <= root.nbytes(), opname,
            f"view of {a.label} with ne={list(ne)} nb={list(nb)} at offset {offset} reaches byte "
            f"{end} of {root.label}, past its end ({root.nbytes()} bytes)")


def _ggml_view(g, node, src):
    """ggml_view_4d. ggml's bounds check uses the contiguous size, so an overlapping view
    (windows) would abort there: it is created one element wide, then widened to the real
    extents and strides."""
    a = src("a")
    ne, nb, offset = node.ne, node.nb, node.params["offset"]
    NULL = g.ffi.NULL
    root = a.view_src if a.view_src != NULL else a
    root_offs = (a.view_offs if a.view_src != NULL else 0) + offset
    contiguous_size = ne[0] * node.type.size * ne[1] * ne[2] * ne[3]
    if nb[0] == node.type.size and (contiguous_size == 0 or contiguous_size + root_offs <= g.lib.ggml_nbytes(root)):
        return g.call("view_4d", a, *ne, *nb[1:], offset)
    t = g.call("view_4d", a, 1, 1, 1, 1, nb[1], nb[2], nb[3], offset)
    t.ne[0:4], t.nb[0:4] = list(ne), list(nb)
    return t


_T = "struct ggml_tensor *"


@op("VIEW", srcs=("a",), params={"ne": tuple, "nb": tuple, "offset": int}, is_view=True, split="view",
    ggml=GgmlCall(override=_ggml_view, cdef=f"{_T} ggml_view_4d(struct ggml_context * ctx, {_T} a, int64_t ne0, "
                  "int64_t ne1, int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset);\n"))
def _view_rule(a, ne, nb, offset):
    ne = pad_ne(ne)
    nb = tuple(int(x) for x in nb)
    check_view_bounds("VIEW", a, ne, nb, offset)
    return Out(a.type, ne, nb, view_of=a, offs=offset)


def _view(a: Tensor, ne, nb_given, offset: int) -> Tensor:
    """ggml_view_Nd: nb0 is the type size; higher unspecified strides follow nb[N-1]*ne[N-1]."""
    n = len(ne)
    ne4 = list(ne) + [1] * (4 - n)
    nb = [a.type.size] + [int(x) for x in nb_given]
    for i in range(n, 4):
        nb.append(nb[i - 1] * ne4[i - 1])
    return build("VIEW", a=a, ne=tuple(ne4), nb=tuple(nb[:4]), offset=offset)


def view_1d(a, ne0, offset=0):
    return _view(a, (ne0,), (), offset)


def view_2d(a, ne0, ne1, nb1, offset=0):
    return _view(a, (ne0, ne1), (nb1,), offset)


def view_3d(a, ne0, ne1, ne2, nb1, nb2, offset=0):
    return _view(a, (ne0, ne1, ne2), (nb1, nb2), offset)


def view_4d(a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset=0):
    return _view(a, (ne0, ne1, ne2, ne3), (nb1, nb2, nb3), offset)


def view_tensor(a):
    return build("VIEW", a=a, ne=a.ne, nb=a.nb, offset=0)


@op("RESHAPE", srcs=("a",), params={"ne": tuple}, is_view=True, split="reshape",
    ggml=GgmlCall("reshape_4d", ("a", "@ne")))
def _reshape_rule(a, ne):
    ne = pad_ne(ne)
    require(a.is_contiguous(), "RESHAPE", f"{a.label} must be contiguous (nb={list(a.nb)})")
    require(int(np.prod(ne)) == a.nelements(), "RESHAPE",
            f"{a.label} has {a.nelements()} elements, the new shape ne={list(ne)} has {int(np.prod(ne))}")
    return Out(a.type, ne, None, view_of=a, offs=0)


def reshape(a, b):
    return build("RESHAPE", a=a, ne=b.ne)


def reshape_1d(a, ne0):
    return build("RESHAPE", a=a, ne=(ne0,))


def reshape_2d(a, ne0, ne1):
    return build("RESHAPE", a=a, ne=(ne0, ne1))


def reshape_3d(a, ne0, ne1, ne2):
    return build("RESHAPE", a=a, ne=(ne0, ne1, ne2))


def reshape_4d(a, ne0, ne1, ne2, ne3):
    return build("RESHAPE", a=a, ne=(ne0, ne1, ne2, ne3))


def _permuted(opname, a, axes):
    axes = tuple(int(x) for x in axes)
    require(sorted(axes) == [0, 1, 2, 3], opname, f"axes {list(axes)} of {a.label} must be a permutation of 0..3")
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    return Out(a.type, tuple(ne), tuple(nb), view_of=a, offs=0)


@op("PERMUTE", srcs=("a",), params={"axes": tuple}, is_view=True, split="permute",
    ggml=GgmlCall("permute", ("a", "axes")))
def _permute_rule(a, axes):
    return _permuted("PERMUTE", a, axes)


@op("TRANSPOSE", srcs=("a",), is_view=True, split="permute", ggml=GgmlCall("transpose", ("a",)))
def _transpose_rule(a):
    return _permuted("TRANSPOSE", a, (1, 0, 2, 3))


def permute(a, axis0, axis1, axis2, axis3):
    """ggml_permute: source dim i becomes result dim axis_i."""
    return build("PERMUTE", a=a, axes=(axis0, axis1, axis2, axis3))


def transpose(a):
    return build("TRANSPOSE", a=a)
