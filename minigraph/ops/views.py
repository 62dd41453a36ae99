"""View ops: they compute nothing and alias their source's memory (ggml_view_*, reshape,
permute, transpose). The bounds check uses the true strided extent, so overlapping windows
are legal and a view past the end of its base is refused."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, build, fail, op, require
from ..tensor import Tensor, pad_ne
from .public import public


def check_view_bounds(opname: str, a: Tensor, ne, nb, offset: int):
    require(offset >= 0, opname, lambda: f"view of {a.label}: negative offset {offset}")
    require(all(x >= 0 for x in nb), opname, lambda: f"view of {a.label}: negative stride in nb={list(nb)}")
    if any(n == 0 for n in ne):
        return
    root = a.root()
    start = a.view_offs + offset
    if a.type.is_quantized:
        check_block_view(opname, a, ne, nb, start)
        end = start + ne[0] // a.type.blck_size * nb[0] + sum((n - 1) * b for n, b in zip(ne[1:], nb[1:]))
    else:
        end = start + a.type.size + sum((n - 1) * b for n, b in zip(ne, nb))
    require(end <= root.nbytes(), opname,
            lambda: f"view of {a.label} with ne={list(ne)} nb={list(nb)} at offset {offset} reaches byte "
            f"{end} of {root.label}, past its end ({root.nbytes()} bytes)")


def check_block_view(opname: str, a: Tensor, ne, nb, start: int):
    """A view of a block type keeps whole blocks: it starts on a block boundary, dim 0 holds
    whole blocks packed one after another, and the other strides step whole blocks."""
    t = a.type
    rule = (f"view of {a.label} ({t.name}, blocks of {t.blck_size} values in {t.size} bytes) must "
            f"start on a block boundary and keep whole blocks in dim 0")
    require(ne[0] % t.blck_size == 0, opname, lambda: f"{rule}: ne0={ne[0]} is not a multiple of {t.blck_size}")
    require(nb[0] == t.size, opname, lambda: f"{rule}: nb0={nb[0]} must be the block size in bytes, {t.size}")
    require(start % t.size == 0, opname, lambda: f"{rule}: it starts at byte {start} of {a.root().label}, "
                                         f"not a multiple of {t.size}")
    bad = [x for x in nb[1:] if x % t.size]
    require(not bad, opname, lambda: f"{rule}: stride {bad[0] if bad else 0} is not whole blocks of {t.size} bytes")


def _ggml_view(g, node, src):
    """ggml_view_4d. ggml's bounds check uses the contiguous size, so an overlapping view
    (windows) would abort there: it is created one element wide, then widened to the real
    extents and strides."""
    a = src("a")
    ne, nb, offset = node.ne, node.nb, node.params["offset"]
    NULL = g.ffi.NULL
    root = a.view_src if a.view_src != NULL else a
    root_offs = (a.view_offs if a.view_src != NULL else 0) + offset
    contiguous_size = ne[0] // node.type.blck_size * node.type.size * ne[1] * ne[2] * ne[3]
    if nb[0] == node.type.size and (contiguous_size == 0 or contiguous_size + root_offs <= g.lib.ggml_nbytes(root)):
        return g.call("view_4d", a, *ne, *nb[1:], offset)
    t = g.call("view_4d", a, 1, 1, 1, 1, nb[1], nb[2], nb[3], offset)
    t.ne[0:4], t.nb[0:4] = list(ne), list(nb)
    return t


_T = "struct ggml_tensor *"


@op("VIEW", srcs=("a",), params={"ne": tuple, "nb": tuple, "offset": int}, is_view=True, split="view", wide_types=True,
    shape="a: any -> [ne0, ne1, ne2, ne3] with byte strides nb, starting offset bytes into a; "
          "every element must lie inside a's memory (windows may overlap)",
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


@public("VIEW", """
>>> a = ctx.new_tensor_2d(mg.f32, 4, 3)
>>> mg.view_1d(a, 5, offset=2 * 4).ne      # elements 2..6 of a's memory
(5, 1, 1, 1)
""", shape="a: any -> [ne0] (nb0 = type size), starting offset bytes into a")
def view_1d(a, ne0, offset=0):
    """ggml_view_1d: ne0 consecutive elements of a's memory."""
    return _view(a, (ne0,), (), offset)


@public("VIEW", """
>>> a = ctx.new_tensor_2d(mg.f32, 4, 3)
>>> v = mg.view_2d(a, 2, 3, a.nb[1], offset=2 * 4)   # the last 2 columns of every row
>>> v.ne, v.nb
((2, 3, 1, 1), (4, 16, 48, 48))
""", shape="a: any -> [ne0, ne1] with row stride nb1 bytes, starting offset bytes into a")
def view_2d(a, ne0, ne1, nb1, offset=0):
    """ggml_view_2d: ne1 rows of ne0 elements, nb1 bytes apart."""
    return _view(a, (ne0, ne1), (nb1,), offset)


@public("VIEW", """
>>> a = ctx.new_tensor_3d(mg.f32, 4, 3, 2)
>>> mg.view_3d(a, 4, 2, 2, a.nb[1], a.nb[2], offset=a.nb[1]).ne   # rows 1..2 of each matrix
(4, 2, 2, 1)
""", shape="a: any -> [ne0, ne1, ne2] with byte strides nb1, nb2, starting offset bytes into a")
def view_3d(a, ne0, ne1, ne2, nb1, nb2, offset=0):
    """ggml_view_3d."""
    return _view(a, (ne0, ne1, ne2), (nb1, nb2), offset)


@public("VIEW", """
>>> x = ctx.new_tensor_3d(mg.f32, 6, 2, 1)
>>> mg.view_4d(x, 3, 4, 2, 1, 4, x.nb[1], x.nb[2]).ne   # 4 overlapping windows of 3 per row
(3, 4, 2, 1)
""", shape="a: any -> [ne0, ne1, ne2, ne3] with byte strides nb1, nb2, nb3, starting offset bytes into a")
def view_4d(a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset=0):
    """ggml_view_4d: any strides, overlapping windows included."""
    return _view(a, (ne0, ne1, ne2, ne3), (nb1, nb2, nb3), offset)


@public("VIEW", """
>>> mg.view_tensor(ctx.new_tensor_2d(mg.f32, 4, 3)).ne
(4, 3, 1, 1)
""", shape="a: [n0, n1, n2, n3] -> [n0, n1, n2, n3] with a's strides")
def view_tensor(a):
    """ggml_view_tensor: a view of all of a."""
    return build("VIEW", a=a, ne=a.ne, nb=a.nb, offset=0)


@op("RESHAPE", srcs=("a",), params={"ne": tuple}, is_view=True, split="reshape", wide_types=True,
    shape="a: contiguous, [n0, n1, n2, n3] -> [ne0, ne1, ne2, ne3] with ne0*ne1*ne2*ne3 == n0*n1*n2*n3",
    ggml=GgmlCall("reshape_4d", ("a", "@ne")))
def _reshape_rule(a, ne):
    ne = pad_ne(ne)
    require(a.is_contiguous(), "RESHAPE", lambda: f"{a.label} must be contiguous (nb={list(a.nb)})")
    require(int(np.prod(ne)) == a.nelements(), "RESHAPE",
            lambda: f"{a.label} has {a.nelements()} elements, the new shape ne={list(ne)} has {int(np.prod(ne))}")
    return Out(a.type, ne, None, view_of=a, offs=0)


@public("RESHAPE", """
>>> a, like = ctx.new_tensor_2d(mg.f32, 6, 2), ctx.new_tensor_2d(mg.f32, 4, 3)
>>> mg.reshape(a, like).ne
(4, 3, 1, 1)
""", shape="a: contiguous, [n0, n1, n2, n3]; b: [m0, m1, m2, m3] with as many elements -> [m0, m1, m2, m3]")
def reshape(a, b):
    """ggml_reshape: a's memory with b's extents."""
    return build("RESHAPE", a=a, ne=b.ne)


@public("RESHAPE", """
>>> mg.reshape_1d(ctx.new_tensor_2d(mg.f32, 6, 2), 12).ne
(12, 1, 1, 1)
""", shape="a: contiguous -> [ne0] with as many elements")
def reshape_1d(a, ne0):
    """ggml_reshape_1d."""
    return build("RESHAPE", a=a, ne=(ne0,))


@public("RESHAPE", """
>>> mg.reshape_2d(ctx.new_tensor_2d(mg.f32, 6, 2), 4, 3).ne
(4, 3, 1, 1)
""", shape="a: contiguous -> [ne0, ne1] with as many elements")
def reshape_2d(a, ne0, ne1):
    """ggml_reshape_2d."""
    return build("RESHAPE", a=a, ne=(ne0, ne1))


@public("RESHAPE", """
>>> mg.reshape_3d(ctx.new_tensor_2d(mg.f32, 6, 2), 2, 2, 3).ne
(2, 2, 3, 1)
""", shape="a: contiguous -> [ne0, ne1, ne2] with as many elements")
def reshape_3d(a, ne0, ne1, ne2):
    """ggml_reshape_3d."""
    return build("RESHAPE", a=a, ne=(ne0, ne1, ne2))


@public("RESHAPE", """
>>> mg.reshape_4d(ctx.new_tensor_2d(mg.f32, 6, 2), 2, 1, 2, 3).ne
(2, 1, 2, 3)
""", shape="a: contiguous -> [ne0, ne1, ne2, ne3] with as many elements")
def reshape_4d(a, ne0, ne1, ne2, ne3):
    """ggml_reshape_4d."""
    return build("RESHAPE", a=a, ne=(ne0, ne1, ne2, ne3))


def _permuted(opname, a, axes):
    axes = tuple(int(x) for x in axes)
    require(sorted(axes) == [0, 1, 2, 3], opname,
            lambda: f"axes {list(axes)} of {a.label} must be a permutation of 0..3")
    require(not a.type.is_quantized or axes[0] == 0, opname,
            lambda: f"{a.label} is {a.type.name}: its values are packed in blocks along dim 0, which must stay dim 0")
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    return Out(a.type, tuple(ne), tuple(nb), view_of=a, offs=0)


@op("PERMUTE", srcs=("a",), params={"axes": tuple}, is_view=True, split="permute", wide_types=True,
    shape="a: [n0, n1, n2, n3] -> result dim axes[i] gets n_i (and a's stride nb_i)",
    ggml=GgmlCall("permute", ("a", "axes")))
def _permute_rule(a, axes):
    return _permuted("PERMUTE", a, axes)


@op("TRANSPOSE", srcs=("a",), is_view=True, split="permute", wide_types=True, ggml=GgmlCall("transpose", ("a",)),
    shape="a: [n0, n1, n2, n3] -> [n1, n0, n2, n3] (strides nb0 and nb1 swapped)")
def _transpose_rule(a):
    return _permuted("TRANSPOSE", a, (1, 0, 2, 3))


@public("PERMUTE", """
>>> mg.permute(ctx.new_tensor_3d(mg.f32, 4, 3, 2), 1, 2, 0, 3).ne   # dim 0 -> 1, 1 -> 2, 2 -> 0
(2, 4, 3, 1)
""", shape="a: [n0, n1, n2, n3] -> result dim axis_i gets n_i (and a's stride nb_i)")
def permute(a, axis0, axis1, axis2, axis3):
    """ggml_permute: source dim i becomes result dim axis_i."""
    return build("PERMUTE", a=a, axes=(axis0, axis1, axis2, axis3))


@public("TRANSPOSE", """
>>> mg.transpose(ctx.new_tensor_2d(mg.f32, 4, 3)).ne
(3, 4, 1, 1)
""")
def transpose(a):
    """ggml_transpose: swap dims 0 and 1 (a view; cont() it for a contiguous copy)."""
    return build("TRANSPOSE", a=a)
