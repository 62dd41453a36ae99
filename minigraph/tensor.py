"""Tensors with ggml's layout: ne[4] element counts and nb[4] byte strides, dim 0 fastest."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from .errors import OpError
from .types import DType

if TYPE_CHECKING:  # pragma: no cover
    from .backend import Buffer

MAX_DIMS = 4
_ids = itertools.count()
_bind_epoch = [0]   # bumped whenever any tensor's memory binding changes


def bind_epoch() -> int:
    """A counter that changes whenever a tensor is given other memory: plans built from
    bindings stay valid while it does not move (a constant-time check on the hot path)."""
    return _bind_epoch[0]


def contiguous_strides(dtype: DType, ne: Sequence[int]) -> tuple[int, int, int, int]:
    nb = [dtype.size]
    for i in range(1, MAX_DIMS):
        nb.append(nb[i - 1] * ne[i - 1])
    return tuple(nb)


def pad_ne(ne: Iterable[int]) -> tuple[int, int, int, int]:
    ne = [int(x) for x in ne]
    if not 1 <= len(ne) <= MAX_DIMS:
        raise OpError(f"a tensor has 1 to 4 dims, got ne={ne}")
    if any(x < 0 for x in ne):
        raise OpError(f"negative extent in ne={ne}")
    return tuple(ne + [1] * (MAX_DIMS - len(ne)))


class Tensor:
    """A node of the lazy graph, or a leaf that holds data once allocated.

    ``view_src`` is always the root tensor that owns memory (views of views collapse) and
    ``view_offs`` the byte offset into it. ``srcs`` maps ggml's argument names to tensors.
    """

    def __init__(self, ctx: "Context | None", type: DType, ne, nb=None, *, op: str = "NONE",
                 srcs: dict | None = None, params: dict | None = None,
                 view_src: "Tensor | None" = None, view_offs: int = 0, name: str = ""):
        self.id = next(_ids)
        self.ctx = ctx
        self.type = type
        self.ne = pad_ne(ne)
        self.nb = tuple(int(x) for x in nb) if nb is not None else contiguous_strides(type, self.ne)
        if view_src is not None and view_src.view_src is not None:
            view_offs += view_src.view_offs
            view_src = view_src.view_src
        self.view_src = view_src
        self.view_offs = int(view_offs)
        self.op = op
        self.srcs: dict[str, Tensor] = dict(srcs or {})
        self.params: dict = dict(params or {})
        self.flags: set[str] = set()
        self.name = name
        # memory: set by an allocator for tensors that own memory (not views)
        self.buffer: Buffer | None = None
        self.offs = 0
        if ctx is not None:
            ctx.tensors.append(self)

    # memory binding: (buffer, offs) of a tensor that owns memory; setting either to a new value
    # bumps the bind epoch
    @property
    def buffer(self):
        return self._buffer

    @buffer.setter
    def buffer(self, b):
        if b is not self.__dict__.get("_buffer", 0):
            _bind_epoch[0] += 1
        self._buffer = b

    @property
    def offs(self) -> int:
        return self._offs

    @offs.setter
    def offs(self, o: int):
        if o != self.__dict__.get("_offs"):
            _bind_epoch[0] += 1
        self._offs = o

    # -- naming and flags -------------------------------------------------------------------
    def set_name(self, name: str) -> "Tensor":
        self.name = name
        return self

    def set_input(self) -> "Tensor":
        self.flags.add("input")
        return self

    def set_output(self) -> "Tensor":
        self.flags.add("output")
        return self

    def set_weight(self) -> "Tensor":
        self.flags.add("weight")
        return self

    is_input = property(lambda self: "input" in self.flags)
    is_output = property(lambda self: "output" in self.flags)
    is_weight = property(lambda self: "weight" in self.flags)

    @property
    def label(self) -> str:
        """How error messages and reports name this tensor."""
        if self.name:
            return f"'{self.name}'"
        return f"<{self.op.lower()} #{self.id} {self.type.name} ne={list(self.ne)}>"

    # -- layout -----------------------------------------------------------------------------
    def nelements(self) -> int:
        return int(np.prod(self.ne))

    def nbytes(self) -> int:
        """The true strided extent in bytes (ggml_nbytes for block size 1)."""
        if any(n <= 0 for n in self.ne):
            return 0
        return self.type.size + sum((n - 1) * b for n, b in zip(self.ne, self.nb))

    def element_size(self) -> int:
        return self.type.size

    def row_size(self) -> int:
        return self.type.size * self.ne[0]

    def n_dims(self) -> int:
        for i in range(MAX_DIMS - 1, 0, -1):
            if self.ne[i] > 1:
                return i + 1
        return 1

    @property
    def shape(self) -> tuple[int, ...]:
        """NumPy order (slowest first), trailing unit dims of ne dropped as ggml_n_dims does."""
        return tuple(reversed(self.ne[: self.n_dims()]))

    def _is_contiguous_n(self, n: int) -> bool:
        next_nb = self.type.size
        if self.ne[0] != 1 and self.nb[0] != next_nb:
            return False
        next_nb *= self.ne[0]
        for i in range(1, MAX_DIMS):
            if self.ne[i] != 1:
                if i > n:
                    if self.nb[i] != next_nb:
                        return False
                    next_nb *= self.ne[i]
                else:
                    next_nb = self.ne[i] * self.nb[i]
        return True

    def is_contiguous(self) -> bool:
        return self._is_contiguous_n(0)

    def is_contiguous_1(self) -> bool:
        return self._is_contiguous_n(1)

    def is_contiguous_rows(self) -> bool:
        return self.ne[0] == 1 or self.nb[0] == self.type.size

    def is_transposed(self) -> bool:
        return self.nb[0] > self.nb[1]

    def is_permuted(self) -> bool:
        nb = self.nb
        return nb[0] > nb[1] or nb[1] > nb[2] or nb[2] > nb[3]

    def same_shape(self, other: "Tensor") -> bool:
        return self.ne == other.ne

    # -- memory -----------------------------------------------------------------------------
    @property
    def is_view(self) -> bool:
        return self.view_src is not None

    def root(self) -> "Tensor":
        return self.view_src if self.view_src is not None else self

    def storage(self) -> tuple["Buffer", int]:
        """(buffer, byte offset of element 0) or raise if no memory was given to it."""
        root = self.root()
        if root.buffer is None:
            raise OpError(f"tensor {self.label} has no memory yet: allocate its context "
                          f"(mg.alloc_ctx_tensors) or compute the graph that produces it")
        return root.buffer, root.offs + self.view_offs

    @property
    def backend(self):
        root = self.root()
        return root.buffer.backend if root.buffer is not None else None

    def set(self, array) -> "Tensor":
        """Write a NumPy array (NumPy order, dtype equal to this tensor's) into the tensor."""
        array = np.asarray(array)
        if array.dtype != self.type.np_dtype:
            raise OpError(f"set {self.label}: dtype {array.dtype} does not match the tensor's "
                          f"type {self.type.name} ({self.type.np_dtype})")
        if _pad4(array.shape) != tuple(reversed(self.ne)):
            raise OpError(f"set {self.label}: array shape {array.shape} does not match the "
                          f"tensor's shape {self.shape} (ne={list(self.ne)})")
        buf, _ = self.storage()
        buf.backend.write_tensor(self, array.reshape(tuple(reversed(self.ne))))
        return self

    def numpy(self) -> np.ndarray:
        """A copy of the tensor's contents in NumPy order (shape == self.shape)."""
        buf, _ = self.storage()
        return buf.backend.read_tensor(self).reshape(self.shape)

    def __repr__(self) -> str:
        extra = f" view of {self.view_src.label}+{self.view_offs}" if self.view_src is not None else ""
        return (f"Tensor({self.label}, op={self.op}, type={self.type.name}, ne={list(self.ne)}, "
                f"nb={list(self.nb)}{extra})")

    __hash__ = object.__hash__

    def __eq__(self, other):  # identity: tensors are graph nodes, not values
        return self is other


def _pad4(shape) -> tuple:
    shape = tuple(int(s) for s in shape)
    if len(shape) > MAX_DIMS:
        # allow leading unit dims beyond 4
        while len(shape) > MAX_DIMS and shape[0] == 1:
            shape = shape[1:]
    return (1,) * (MAX_DIMS - len(shape)) + shape


class Context:
    """Holds the tensors created through it; alloc_ctx_tensors gives its leaves memory."""

    def __init__(self, name: str = ""):
        self.name = name
        self.tensors: list[Tensor] = []

    def new_tensor(self, type: DType, ne) -> Tensor:
        return Tensor(self, type, ne)

    def new_tensor_1d(self, type: DType, ne0: int) -> Tensor:
        return Tensor(self, type, (ne0,))

    def new_tensor_2d(self, type: DType, ne0: int, ne1: int) -> Tensor:
        return Tensor(self, type, (ne0, ne1))

    def new_tensor_3d(self, type: DType, ne0: int, ne1: int, ne2: int) -> Tensor:
        return Tensor(self, type, (ne0, ne1, ne2))

    def new_tensor_4d(self, type: DType, ne0: int, ne1: int, ne2: int, ne3: int) -> Tensor:
        return Tensor(self, type, (ne0, ne1, ne2, ne3))

    def leaves(self) -> list[Tensor]:
        return [t for t in self.tensors if t.op == "NONE" and t.view_src is None]
