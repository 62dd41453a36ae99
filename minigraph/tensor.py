"""Tensors with ggml's layout: ne[4] element counts and nb[4] byte strides, dim 0 fastest."""
from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from .errors import OpError
from .types import ALL_TYPES, DType

if TYPE_CHECKING:  # pragma: no cover
    from .backend import Buffer

MAX_DIMS = 4
_ids = itertools.count()
_bind_epoch = [0]     # bumped whenever any tensor's memory binding changes
_output_epoch = [0]   # bumped whenever a tensor is flagged output


def bind_epoch() -> int:
    """A counter that changes whenever a tensor is given other memory: plans built from
    bindings stay valid while it does not move (a constant-time check on the hot path)."""
    return _bind_epoch[0]


def output_epoch() -> int:
    """A counter that changes whenever a tensor is flagged output: a memory plan made before
    checks whether its graph's outputs changed (they must not be reused)."""
    return _output_epoch[0]


_TYPE_NAMES = {t.name: t for t in ALL_TYPES}
_TYPE_HELP = ", ".join(f"mg.{t.name}" for t in ALL_TYPES)


def as_type(value, arg: str = "type") -> DType:
    """A minigraph type from a DType, a ggml type name ('f32', 'F16', ...) or a NumPy dtype
    (np.float32, 'float32' is not a ggml name and is refused); anything else names ``arg``."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        t = _TYPE_NAMES.get(value.strip().lower())
        if t is None:
            raise ValueError(f"{arg}: unknown type name {value!r}; valid types are {_TYPE_HELP} "
                             f"(or their names {', '.join(repr(n) for n in _TYPE_NAMES)})")
        return t
    try:
        np_dtype = np.dtype(value) if value is not None else None   # np.dtype(None) is float64
    except TypeError:
        np_dtype = None
    for t in ALL_TYPES:
        if np_dtype is not None and t.numpy_native and t.np_dtype == np_dtype:
            return t
    what = f"NumPy dtype {np_dtype}" if np_dtype is not None else f"{type(value).__name__} {value!r}"
    raise TypeError(f"{arg}: {what} is not a minigraph type; valid types are {_TYPE_HELP} "
                    f"(or NumPy float32, float16, int32, int64)")


def contiguous_strides(dtype: DType, ne: Sequence[int]) -> tuple[int, int, int, int]:
    nb = [dtype.size, dtype.size * (ne[0] // dtype.blck_size)]
    for i in range(2, MAX_DIMS):
        nb.append(nb[i - 1] * ne[i - 1])
    return tuple(nb)


def pad_ne(ne: Iterable[int]) -> tuple[int, int, int, int]:
    try:
        ne = list(ne)
    except TypeError:
        raise OpError(f"ne must be a sequence of 1 to 4 integers, got {type(ne).__name__} {ne!r}") from None
    bad = [x for x in ne if isinstance(x, bool) or not isinstance(x, (int, np.integer))]
    if bad:
        raise OpError(f"ne must hold integers, got {bad[0]!r} ({type(bad[0]).__name__}) in ne={ne}")
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

    Nodes belong to no context: a node lives while a graph, another node or the caller holds it.
    A context holds the leaves made through it (weights, caches, inputs) and the tensor refers
    back to it weakly, so the two never form a cycle that only the garbage collector frees.
    """

    def __init__(self, ctx: "Context | None", type: DType, ne, nb=None, *, op: str = "NONE",
                 srcs: dict | None = None, params: dict | None = None,
                 view_src: "Tensor | None" = None, view_offs: int = 0, name: str = ""):
        self.id = next(_ids)
        self._ctx = weakref.ref(ctx) if ctx is not None else None
        self.type = as_type(type)
        self.ne = pad_ne(ne)
        if self.ne[0] % self.type.blck_size:
            raise OpError(f"tensor {name or op.lower()!r} of {self.type.name}: ne[0]={self.ne[0]} must be a "
                          f"multiple of the block size {self.type.blck_size}")
        self.nb = tuple(int(x) for x in nb) if nb is not None else contiguous_strides(self.type, self.ne)
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

    @property
    def ctx(self) -> "Context | None":
        """The context this tensor was made in (None for nodes, or once that context is gone)."""
        return self._ctx() if self._ctx is not None else None

    # memory binding: (buffer, offs) of a tensor that owns memory; setting either to a new value
    # bumps the bind epoch and forgets that the memory was handed on (see overwritten_by)
    @property
    def buffer(self):
        return self._buffer

    @buffer.setter
    def buffer(self, b):
        if b is not self.__dict__.get("_buffer", 0):
            _bind_epoch[0] += 1
            self.overwritten_by = None
        self._buffer = b

    @property
    def offs(self) -> int:
        return self._offs

    @offs.setter
    def offs(self, o: int):
        if o != self.__dict__.get("_offs"):
            _bind_epoch[0] += 1
            self.overwritten_by = None
        self._offs = o

    # overwritten_by: a weakref to the later node that the memory planner gave this intermediate's
    # memory to once its last reader had run (set when a plan binds it), else None. numpy() then
    # refuses to read it: the bytes there belong to that node after a compute.

    # -- naming and flags -------------------------------------------------------------------
    def set_name(self, name: str) -> "Tensor":
        self.name = name
        return self

    def set_input(self) -> "Tensor":
        self.flags.add("input")
        return self

    def set_output(self) -> "Tensor":
        """Keep this tensor readable after a compute: the planner never reuses its memory."""
        if "output" not in self.flags:
            self.flags.add("output")
            _output_epoch[0] += 1
        return self

    def set_whole_graph(self) -> "Tensor":
        """An output whose memory is its own for the whole compute: the planner gives it bytes
        that no node uses, before it runs or after (an output's memory is only never reused after
        it). Whatever is written there before the compute stays until this node overwrites it."""
        self.set_output()
        self.flags.add("whole_graph")
        return self

    def set_side_copy(self) -> "Tensor":
        """A whole-graph output that no node reads during the compute (a copy kept for the host,
        such as the undo journal's copy of rows a later node overwrites): a backend may write it
        around the caches (streaming stores), leaving them to the data the next nodes read."""
        self.set_whole_graph()
        self.flags.add("side_copy")
        return self

    def set_state_store(self) -> "Tensor":
        """A CPY of the state slots a scan (SSM_SCAN, GATED_DELTA_NET) packs after its main
        output into a cache, those slots read by nothing else: a backend may have the scan write
        them into the cache itself and skip the copy (the cpu backend's fused stores)."""
        self.flags.add("state_store")
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
        n0, n1, n2, n3 = self.ne   # plain ints: np.prod costs ~3 us, and every view asks
        return int(n0) * int(n1) * int(n2) * int(n3)

    def nbytes(self) -> int:
        """The true strided extent in bytes (ggml_nbytes): dim 0 counts whole blocks."""
        if any(n <= 0 for n in self.ne):
            return 0
        if self.type.blck_size > 1:
            return self.ne[0] * self.nb[0] // self.type.blck_size + sum((n - 1) * b for n, b in zip(self.ne[1:], self.nb[1:]))
        return self.type.size + sum((n - 1) * b for n, b in zip(self.ne, self.nb))

    def element_size(self) -> int:
        return self.type.size

    def row_size(self) -> int:
        return self.type.size * (self.ne[0] // self.type.blck_size)

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
        next_nb *= self.ne[0] // self.type.blck_size     # a row of a block type is whole blocks
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

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The NumPy shape ``set`` takes and ``numpy`` gives: ``shape`` for element types; for
        block types (q8_0, q4_k, ...) the rows' raw bytes, shape[:-1] + (row bytes,)."""
        if not self.type.is_quantized:
            return self.shape
        return tuple(reversed(self.ne[1: self.n_dims()])) + (self.row_size(),)

    def set(self, array) -> "Tensor":
        """Write a NumPy array (NumPy order, dtype equal to this tensor's) into the tensor.

        bf16 takes its 16-bit patterns (uint16; mg.quantize(x, mg.bf16) makes them from floats);
        block types take raw blocks: uint8 of ``storage_shape`` or of as many bytes in any shape
        (or ``bytes``), as mg.quantize returns them."""
        if self.type.is_quantized and isinstance(array, (bytes, bytearray, memoryview)):
            array = np.frombuffer(array, np.uint8)
        array = np.asarray(array)
        if array.dtype != self.type.np_dtype:
            raise OpError(f"set {self.label}: dtype {array.dtype} does not match the tensor's "
                          f"type {self.type.name} ({self.type.np_dtype}"
                          f"{', raw blocks' if self.type.is_quantized else ''})")
        want = tuple(reversed(self.ne)) if not self.type.is_quantized else \
            (self.ne[3], self.ne[2], self.ne[1], self.row_size())
        if self.type.is_quantized and array.size == int(np.prod(want)):
            array = array.reshape(want)
        if _pad4(array.shape) != want:
            raise OpError(f"set {self.label}: array shape {array.shape} does not match the "
                          f"tensor's shape {self.storage_shape} (ne={list(self.ne)}"
                          f"{f', {self.type.name} rows of {self.row_size()} bytes' if self.type.is_quantized else ''})")
        buf, _ = self.storage()
        buf.backend.write_tensor(self, array.reshape(want))
        return self

    def numpy(self) -> np.ndarray:
        """A copy of the tensor's contents in NumPy order (shape == self.storage_shape: the
        values for element types, bf16's 16-bit patterns as uint16, block types' raw bytes as
        uint8 rows; mg.dequantize turns the last two into float32).

        An intermediate whose memory the planner handed to a later node cannot be read after a
        compute: flag it with set_output() before computing to keep it."""
        buf, _ = self.storage()
        root = self.root()
        if root.overwritten_by is not None:
            later = root.overwritten_by()
            later = later.label if later is not None else "a later node (since dropped)"
            raise OpError(f"tensor {self.label}: its memory was reused by {later} after its "
                          f"last reader ran; call set_output() on {root.label} before computing to keep it")
        return buf.backend.read_tensor(self).reshape(self.storage_shape)

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

    # type: mg.f32 etc., a ggml type name ('f32') or a NumPy dtype (np.float32)
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
