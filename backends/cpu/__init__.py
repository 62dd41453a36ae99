"""The CPU backend: C kernels (backends/cpu/*.c) compiled at install time through cffi.

`compute_nodes(nodes)` turns a node list into a plan once (an array of C node records: op
code, data pointers and ne/nb of dst and sources, params), caches it by the identity of the
node list and the memory bound to its tensors, and runs the whole plan in one C call: the
caller's thread and persistent pool workers take chunks of each node dynamically, small nodes run
on the caller's thread alone, and no thread waits for one that is not working (plan.c)."""
from __future__ import annotations

import operator
import os
import threading
import warnings
import weakref
from collections import OrderedDict

import numpy as np

from minigraph.backend import HostBackend, Layout, is_compute_node, register_backend
from minigraph.errors import OpError
from minigraph.registry import OPS
from minigraph.sources import reading, srcs_of
from minigraph.tensor import bind_epoch
from minigraph.types import bf16, f16, f32, i32, i64, q4_0, q4_k, q6_k, q8_0, q8_k

try:
    from ._kernels import ffi, lib
    _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    ffi = lib = None
    _IMPORT_ERROR = e

REBUILD_HINT = ("the CPU backend's C extension minigraph.backends.cpu._kernels is not built or does not load "
                "({err}); rebuild it with `pip install -e .` in the project root")

# Ops the C kernels deliberately do not run, with the reason (the coverage test reads this):
# every other compute op of the registry must have an MG_KERNEL registration.
UNSUPPORTED: dict[str, str] = {}

_TYPE_CODES = {f32: 0, f16: 1, i32: 2, i64: 3, bf16: 4, q4_0: 5, q8_0: 6, q4_k: 7, q6_k: 8, q8_k: 9}   # enum mg_type

# Which ops run which of the half / block types (the other kernels handle f32, f16, i32, i64):
# op -> {source name: the extra types it may have there}. A node with one of these types
# anywhere else is not supported (supports_op), so it is refused at graph build, never computed
# wrong.
_HALF_AND_BLOCK = frozenset({f16, bf16, q8_0, q4_0, q4_k, q6_k})
TYPE_SUPPORT: dict[str, dict[str, frozenset]] = {
    "GET_ROWS": {"a": _HALF_AND_BLOCK},
    "MUL_MAT": {"a": _HALF_AND_BLOCK},   # src1 f32, converted to the vec_dot_type first (quant_matmul.c)
    # bf16 <-> f32; f32 -> q8_0 / q4_0 (ggml's x86 quantizers: quant_codec.c)
    "CPY": {"a": frozenset({bf16}), "b": frozenset({bf16, q8_0, q4_0})},
    "CONT": {"a": frozenset({bf16})},
}
_PLAIN = frozenset({f32, f16, i32, i64})
_WIDE_RESULT = {"CPY": frozenset({bf16, q8_0, q4_0}), "CONT": frozenset({bf16})}
_SLOTS = 8   # mg_node's fp[] and ip[] (mg_api.h)


def _registered_kernels() -> dict:
    """op name -> kernel code, as the C kernels registered themselves (MG_KERNEL lines)."""
    if lib is None:
        return {}
    n = lib.mg_op_count()
    if n < 0:
        raise ImportError("more C kernels registered than MG_MAX_KERNELS in backends/cpu/plan.c")
    codes = {}
    for code in range(n):
        name = ffi.string(lib.mg_op_name(code)).decode()
        if ":" in name and name.split(":")[0] in OPS:
            STEP_CODES[name] = code   # an internal step of an op ("MUL_MAT:src1_to_dot_type"), not an op
            continue
        if name not in OPS:
            raise ImportError(f"a C kernel is registered for {name!r}, which is not a registered op "
                              f"(MG_KERNEL in backends/cpu/*.c)")
        if name in codes:
            raise ImportError(f"two C kernels are registered for {name} (MG_KERNEL in backends/cpu/*.c)")
        codes[name] = code
    return codes


STEP_CODES: dict = {}               # "OP:step" -> code: records a kernel adds for an op's internal steps
OP_CODES = _registered_kernels()   # op name -> the code a node record carries


def implemented_ops() -> set:
    """The compute ops this backend runs (for the coverage test)."""
    return set(OP_CODES)


def own_order_types() -> frozenset:
    """Names of the weight types whose kernels on this build put 8 weight rows in the vector lanes
    and sum each output's blocks in one f32 chain of their own (quant_matmul.c: q8_0, q4_K and
    q6_K with AVX-512 VNNI + VBMI, q8_0 and q4_K on other AVX2 builds): their results differ from
    ggml's by f32 rounding. Empty on builds without AVX2."""
    if lib is None:
        return frozenset()
    return frozenset(t.name for t, code in _TYPE_CODES.items() if lib.mg_quant_row_group(code) > 1)


class PackedRows(Layout):
    """A weight's q4_K or q6_K rows packed in groups of 8 for the 8-row kernels (quant_matmul.c:
    MG_Q4_KX8, MG_Q6_KX8): each group one stream in the order the kernel reads it, its values
    already in vector lanes; the rows after the last whole group stay as they are."""

    def __init__(self, type_code: int, type_name: str, n_rows: int, row_bytes: int):
        self.code, self.n_rows, self.row_bytes = type_code, n_rows, row_bytes
        self.packed_code = int(lib.mg_packed_type(type_code))
        self.nbytes = n_rows * row_bytes
        self.name = f"{type_name} rows packed in groups of 8"

    def _move(self, mem: np.ndarray, unpack: int) -> None:
        if lib.mg_pack_rows(self.code, ffi.from_buffer(mem), self.n_rows, self.row_bytes, unpack) != 0:
            raise MemoryError(f"{'un' if unpack else ''}packing {self.name}: no memory for one group "
                              f"({8 * self.row_bytes} bytes)")

    def to_plain(self, mem: np.ndarray) -> None:
        self._move(mem, 1)

    def to_packed(self, mem: np.ndarray) -> None:
        self._move(mem, 0)


def _params(node, rec):
    """Op params into the record's slots: float params fill fp[], int and bool params ip[], each
    in the op's declaration order (the kernels read them by that position)."""
    d = OPS[node.op]
    fl, it = d.c_float_params, d.c_int_params
    if len(fl) > _SLOTS or len(it) > _SLOTS:
        raise OpError(f"{node.op} {node.label}: {len(fl)} float / {len(it)} int params do not fit the "
                      f"CPU node record ({_SLOTS} of each)")
    for i, p in enumerate(fl):
        rec.fp[i] = node.params[p]
    for i, p in enumerate(it):
        rec.ip[i] = int(node.params[p])


def _clear_of(node, cache, scan, slots_offs) -> bool:
    """node neither touches the cache tensor nor reads the scan's state slots (from slots_offs)."""
    for t in (node, *srcs_of(node).values()):
        if t is None:
            continue
        if t.root() is cache or (t.root() is scan and t.view_offs + t.nbytes() > slots_offs):
            return False
    return True


class CpuPlan:
    """A built plan: the C records plus what is needed to validate and report on it."""

    def __init__(self, nodes, records, n, compute, roots, sig):
        self.nodes = nodes          # the node list it was built from (identity is the key)
        self.records = records      # cdata mg_node[n]
        self.n = n
        self.compute = compute      # the compute node of each record (a MUL_MAT's src1 conversion
                                    # record names its MUL_MAT)
        self.roots = roots          # root tensors whose memory the records point into
        self.sig = sig              # (buffer id, offset) of each root when built
        self.runs = 0
        self.epoch = -1             # bind epoch at which it was last known valid
        self.work = None            # MUL_MAT src1 conversion / packing buffer (build_plan)
        self.stored = None          # the fused state stores' words (build_plan, ssm.c: store_ok)
        self.fused_stores = 0       # how many stores the scans write themselves


def _cores() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    if lib is not None:
        return max(1, int(lib.mg_max_threads()))
    return os.cpu_count() or 1


_oversubscribed_warned = False


class CpuBackend(HostBackend):
    # the bf16 / block types (and f16 weights) some kernels take; TYPE_SUPPORT says which and where
    wide_types = frozenset({"f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k"})
    # Default: every core. The executor stays graceful when a core is busy elsewhere (a worker
    # that is descheduled takes no chunk and nobody waits for it), so the default does not lose
    # to one thread on a shared machine (bench/ops.py's contention rows measure it).
    n_threads = _cores()
    max_plans = 32
    # load_gguf reads weights into the backend's own (anonymous) memory rather than mapping the
    # file: matrix x vector streams it faster (measured here, lfm2-350M-like Q4_K_M decode, 1
    # thread: Q4_K K1024 x M4608 3.7 against 4.3 ms per token over its 32 weights, the Q6_K
    # output head 1.2 against 1.4 ms); load_gguf(map_weights=True) still maps
    maps_file_weights = False

    def __init__(self, idx: int = 0):
        if lib is None:
            raise RuntimeError(REBUILD_HINT.format(err=_IMPORT_ERROR))
        self.index = idx
        self.name = f"cpu:{idx}"
        self._addrs = weakref.WeakKeyDictionary()   # Buffer -> (cdata keeping mem alive, address)
        self._plans: OrderedDict = OrderedDict()
        self.plans_built = 0
        self._tls = threading.local()   # each Python thread's mg_error (one allocation, not one per run)

    def set_n_threads(self, n: int) -> "CpuBackend":
        """Threads per plan run (the caller's and n - 1 pool workers). n must be an integer from
        1 to the pool's limit (mg_thread_limit, 512); more than the cores is allowed (warned once per process): the executor never
        waits for a thread that is not running, but extra threads buy nothing."""
        global _oversubscribed_warned
        if isinstance(n, bool):
            raise ValueError(f"n_threads must be a positive integer, got {n!r}")
        try:
            n = operator.index(n)
        except TypeError:
            raise ValueError(f"n_threads must be a positive integer, got {n!r}") from None
        if n < 1:
            raise ValueError(f"n_threads must be >= 1, got {n}")
        if n > lib.mg_thread_limit():
            raise ValueError(f"n_threads must be at most {lib.mg_thread_limit()} (the CPU backend's "
                             f"thread pool), got {n}")
        cores = _cores()
        if n > cores and not _oversubscribed_warned:
            _oversubscribed_warned = True
            warnings.warn(f"n_threads {n} is more than the {cores} cores this process may use: "
                          f"the extra threads only share those cores", RuntimeWarning, stacklevel=2)
        self.n_threads = n
        return self

    # -- support ----------------------------------------------------------------------------
    def supports_op(self, node) -> bool:
        d = OPS.get(node.op)
        if d is None:
            return False
        if d.is_view:
            return True
        return node.op in OP_CODES and self.supports_types(node)

    @staticmethod
    def supports_types(node) -> bool:
        """The node's source and result types are ones its kernel handles (TYPE_SUPPORT)."""
        extra = TYPE_SUPPORT.get(node.op, {})
        for name, s in srcs_of(node).items():
            if s is not None and s.type not in _PLAIN and s.type not in extra.get(name, ()):
                return False
        return node.type in _PLAIN or node.type in _WIDE_RESULT.get(node.op, ())

    @staticmethod
    def op_code(name: str) -> int:
        return OP_CODES[name] if name in OP_CODES else STEP_CODES[name]

    # streaming stores pay off once a copy outgrows the caches' working set; small spans (a
    # short conv state, one KV row) stay with NumPy's copy
    SAVE_ROWS_STREAMING_MIN = 1 << 16

    def save_rows(self, pairs):
        """The undo journal's copies in C, one CPY:save_rows record (copy.c) per large span, all of
        a step's in one plan run shared by the backend's threads: they are read back only if a
        step fails, so their lines need not pass through the caches (streaming stores), and a
        decode step's journal is bound by memory bandwidth, which two cores have more of than
        one. Small spans (a short conv state, one KV row) stay with NumPy's copy."""
        big = []
        for dst, rows in pairs:
            count, n = rows.shape
            if (lib is None or count * n < self.SAVE_ROWS_STREAMING_MIN or rows.dtype != np.uint8
                    or dst.dtype != np.uint8 or not dst.flags.c_contiguous or dst.shape != rows.shape
                    or (n > 1 and rows.strides[1] != 1) or (count > 1 and rows.strides[0] < n)):
                np.copyto(dst, rows)
            else:
                big.append((dst, rows))
        if not big:
            return
        recs = ffi.new("mg_node[]", len(big))
        for rec, (dst, rows) in zip(recs, big):
            count, n = rows.shape
            rec.op = STEP_CODES["CPY:save_rows"]
            rec.n_src = 1
            rec.dst.data = ffi.cast("char *", dst.ctypes.data)
            rec.src[0].data = ffi.cast("char *", rows.ctypes.data)
            rec.ip[0], rec.ip[1], rec.ip[2] = (rows.strides[0] if count > 1 else n), count, n
            rec.cost = 2 * count * n              # bytes read and written: the executor's split
        err = ffi.new("mg_error *")
        if lib.mg_plan_run(recs, len(big), int(self.n_threads), err) != 0:   # pragma: no cover (no check)
            raise RuntimeError(f"CPY:save_rows: backend {self.name} failed (code {err.code})")

    # -- packed weights ---------------------------------------------------------------------
    @staticmethod
    def packs_type(t) -> bool:
        """Whether pack_weight packs weights of type t on this build (q4_K and q6_K where the 8-row
        kernels exist). q8_0 is not packed: packed, a 1-thread decode streamed it slower."""
        code = _TYPE_CODES.get(t)
        return code is not None and lib is not None and lib.mg_packed_type(code) >= 0

    def pack_weight(self, t) -> bool:
        """Pack a q4_K or q6_K weight's rows in groups of 8, in place, where this build's kernels
        read 8 rows at once (AVX-512 VNNI + VBMI): a product then streams one group at a time
        instead of 8 rows side by side, and no block is transposed on the way. The same bits come
        out. Only a 2-D weight that owns its contiguous memory here, with at least 8 rows."""
        buf = t.buffer
        if (not self.packs_type(t.type) or t.view_src is not None or buf is None
                or buf.backend is not self or t.ne[2] != 1 or t.ne[3] != 1 or t.ne[1] < 8 or not t.is_contiguous()):
            return False
        if t.offs not in buf.layouts:
            lay = PackedRows(_TYPE_CODES[t.type], t.type.name, t.ne[1], t.row_size())
            lay.to_packed(buf.mem[t.offs:t.offs + lay.nbytes])
            buf.layouts[t.offs] = lay
        return True

    @staticmethod
    def _layout_of(t):
        """The Layout t's memory is kept in (None: plain bytes)."""
        root = t.root()
        buf = root.buffer
        return buf.layouts.get(root.offs) if buf is not None and buf.layouts else None

    def _packed_source(self, node, name, s):
        """The Layout of source `name` of node when it is a packed weight the record reads as such
        (a MUL_MAT's whole src0), None for plain bytes; an OpError for any other use of packed
        bytes."""
        lay = self._layout_of(s)
        if lay is None or (node.op == "MUL_MAT" and name == "a" and s.view_src is None):
            return lay
        what = f"a view of {s.root().label}, which" if s.view_src is not None else s.label
        raise OpError(f"{node.op} {node.label}: source {name} is {what} holds {lay.name} ({self.name} packed it "
                      f"for MUL_MAT); only MUL_MAT reads it, whole (load the model with pack_weights=False "
                      f"to use it otherwise)")

    # -- plans ------------------------------------------------------------------------------
    def _address(self, buf) -> int:
        entry = self._addrs.get(buf)
        if entry is None:
            cd = ffi.from_buffer(buf.mem)
            entry = (cd, int(ffi.cast("uintptr_t", cd)))
            self._addrs[buf] = entry
        return entry[1]

    def _fill(self, ct, t):
        buf, offs = t.storage()
        ct.data = ffi.cast("char *", self._address(buf) + offs)
        ct.ne = list(t.ne)
        ct.nb = list(t.nb)
        ct.type = _TYPE_CODES[t.type]

    @staticmethod
    def _signature(roots) -> tuple:
        """Where each root's memory is, and whether it is packed (the records' types say so)."""
        return tuple((r.buffer.id, r.offs, r.offs in r.buffer.layouts) if r.buffer is not None else (-1, r.offs)
                     for r in roots)

    @staticmethod
    def _needs_src1_conversion(node) -> bool:
        """A MUL_MAT whose weights are half / block and whose src1 is f32: ggml's CPU semantics
        convert src1's rows to the weights' vec_dot_type first (quant_matmul.c)."""
        return node.op == "MUL_MAT" and srcs_of(node)["a"].type != f32 and srcs_of(node)["b"].type == f32

    @staticmethod
    def _work_layout(node):
        """(type code, ne, nb) of the converted src1 of a MUL_MAT node: contiguous rows in the
        layout the C kernels chose for the weights' type (quant.h: ggml's vec_dot_type blocks,
        or for q4_0 the same q8_0 values laid out for its dot product, or for f16 and bf16 by several
        columns the half values held as f32, so that the dot products convert only the weights)."""
        a, b = srcs_of(node)["a"], srcs_of(node)["b"]
        code = lib.mg_work_type(_TYPE_CODES[a.type], b.ne[1])
        row = int(lib.mg_work_row_bytes(_TYPE_CODES[a.type], b.ne[0], b.ne[1]))
        blck = a.type.vec_dot_type.blck_size
        return code, b.ne, (row // max(1, b.ne[0] // blck) if b.ne[0] else row, row, row * b.ne[1],
                            row * b.ne[1] * b.ne[2])

    def _pack_floats(self, node) -> int:
        """Floats of the packed copy of src1 that an f32 MUL_MAT's prefill path reads (matmul.c:
        MUL_MAT:pack_src1 writes it in a record before the MUL_MAT's); 0 when the product takes
        another path. The C code decides (types, columns, planes merged), from the record the
        packing step will have."""
        if node.op != "MUL_MAT":
            return 0
        rec = ffi.new("mg_node *")
        self._fill_pack_sources(rec, node)
        return int(lib.mg_mul_mat_pack_floats(rec))

    def _fill_pack_sources(self, rec, node):
        """MUL_MAT:pack_src1's sources: a and b, and the MUL_MAT's dst (whose strides decide, with
        b's, whether the product takes b's planes as one run of columns)."""
        rec.n_src = 3
        self._fill(rec.src[0], srcs_of(node)["a"])
        self._fill(rec.src[1], srcs_of(node)["b"])
        self._fill(rec.src[2], node)

    @staticmethod
    def _kernel_name(node) -> str:
        """The kernel a node's record runs: its op's, or for a side copy (Tensor.set_side_copy)
        gathered from rows of its own type, GET_ROWS:side_copy (index.c: the same bytes, split by
        bytes rather than rows and written with streaming stores)."""
        if node.op == "GET_ROWS" and "side_copy" in node.flags:
            a = srcs_of(node)["a"]
            if a.type == node.type and a.is_contiguous_rows():   # a byte copy of dense rows
                return "GET_ROWS:side_copy"
        return node.op

    @staticmethod
    def _fused_stores(compute) -> dict:
        """{position in compute of a state store (Tensor.set_state_store): position of the scan
        whose state slots it copies}, for the stores the scan can write itself (ssm.c: store_ok
        decides each run whether it may): the store copies every slot, packed [D, n_seqs, K]
        where the op declares them (registry.state_slots), into f32 rows with dense dims 0, and
        no node between the two touches the store's tensor or reads those slots."""
        pos = {id(n): i for i, n in enumerate(compute)}
        out = {}
        for c, store in enumerate(compute):
            if store.op != "CPY" or "state_store" not in store.flags:
                continue
            a = srcs_of(store)["a"]
            scan = a.view_src
            if scan is None or OPS[scan.op].state_slots is None or id(scan) not in pos or scan.is_output:
                continue
            offs, D, ns, K = OPS[scan.op].state_slots(scan)
            if (scan.type != f32 or store.type != f32 or tuple(a.ne) != (D, ns, K, 1) or not a.is_contiguous()
                    or a.view_offs != offs or tuple(store.ne) != tuple(a.ne) or store.nb[0] != 4
                    or store.nb[1] < D * 4 or (K > 1 and store.nb[2] < store.nb[1] * ns)):
                continue
            s = pos[id(scan)]
            if all(_clear_of(n, store.root(), scan, offs) for n in compute[s + 1:c]):
                out[c] = s
        return out

    @staticmethod
    def _fused_side_copies(compute) -> dict:
        """{position in compute of a side copy: position of the SSM_SCAN that makes it}, for the
        side copies (GET_ROWS:side_copy) of the very rows a later scan reads in place: the same
        cache, the same index tensor, every head's state dense in the row and the copy's rows
        dense, and no node between the two touching the cache. The scan then copies each head's
        state as it first reads it (ssm.c), instead of the copy reading every row once more
        before it (mamba2 decode, 2 threads: about a sixth of a step)."""
        out = {}
        for c, copy in enumerate(compute):
            if CpuBackend._kernel_name(copy) != "GET_ROWS:side_copy":
                continue
            a, idx = srcs_of(copy)["a"], srcs_of(copy)["b"]
            cache = a.root()
            for s in range(c + 1, len(compute)):
                scan = compute[s]                # the first SSM_SCAN, or a node in between
                if scan.op == "SSM_SCAN":
                    st, ids = srcs_of(scan)["s"], srcs_of(scan)["ids"]
                    ds, hd, nh = st.ne[0], st.ne[1], st.ne[2]
                    if (ids is idx and st.root() is cache and st.view_offs == a.view_offs and st.type == a.type == f32
                            and tuple(st.nb[:3]) == (4, 4 * ds, 4 * ds * hd) and st.nb[3] == a.nb[1]
                            and a.ne[0] == ds * hd * nh and copy.is_contiguous() and idx.ne[0] == copy.ne[1]
                            and tuple(idx.ne[1:]) == (1, 1, 1) and copy.ne[2] == copy.ne[3] == 1):
                        out[c] = s
                    break
                if not _clear_of(scan, cache, None, 0):
                    break
        return out

    def build_plan(self, nodes) -> CpuPlan:
        """Translate ``nodes`` into C node records (once per node list and memory binding).

        A MUL_MAT with half / block weights and an f32 src1 takes two records: the conversion of
        src1's rows into a work buffer (op "MUL_MAT:src1_to_dot_type"), then the MUL_MAT reading
        that buffer as its src1. An f32 MUL_MAT with enough columns for the packed prefill path
        likewise takes two: src1 packed into panels in the work buffer ("MUL_MAT:pack_src1"), then
        the MUL_MAT reading the panels (its record's src[2]). Records run in order and one at a
        time, so every such MUL_MAT of the plan shares one buffer, sized for the largest; it lives
        with the plan."""
        compute = [n for n in nodes if is_compute_node(n)]
        record_nodes = []
        work_bytes = 0
        packs = {}                   # id(node) -> floats of its packed src1
        for node in compute:
            if self._needs_src1_conversion(node):
                t, ne, nb = self._work_layout(node)
                work_bytes = max(work_bytes, nb[3] * ne[3])
                record_nodes.append(node)
            elif floats := self._pack_floats(node):
                packs[id(node)] = floats
                work_bytes = max(work_bytes, floats * 4)
                record_nodes.append(node)
            record_nodes.append(node)
        # 64 bytes of slack: the buffer's start is rounded up to a cache line
        work = ffi.new("char[]", work_bytes + 64) if work_bytes else None
        work_addr = (int(ffi.cast("uintptr_t", work)) + 63) // 64 * 64 if work is not None else 0
        records = ffi.new("mg_node[]", max(len(record_nodes), 1))
        roots = {}
        at = {}                      # id(node) -> its (main) record
        i = 0
        for node in compute:
            names = OPS[node.op].srcs
            convert = self._needs_src1_conversion(node)
            if convert:
                t, ne, nb = self._work_layout(node)
                rec = records[i]
                rec.op = self.op_code("MUL_MAT:src1_to_dot_type")
                rec.n_src = 1
                self._fill(rec.src[0], srcs_of(node)["b"])
                rec.dst.data = ffi.cast("char *", work_addr)
                rec.dst.ne = list(ne)
                rec.dst.nb = list(nb)
                rec.dst.type = t
                i += 1
            pack = packs.get(id(node), 0)
            if pack:
                rec = records[i]
                rec.op = self.op_code("MUL_MAT:pack_src1")
                self._fill_pack_sources(rec, node)
                rec.dst.data = ffi.cast("char *", work_addr)
                rec.dst.ne = [pack, 1, 1, 1]
                rec.dst.nb = [4, 4 * pack, 4 * pack, 4 * pack]
                rec.dst.type = _TYPE_CODES[f32]
                i += 1
            rec = records[i]
            i += 1
            rec.op = self.op_code(self._kernel_name(node))
            self._fill(rec.dst, node)
            roots[node.root().id] = node.root()
            rec.n_src = len(names)
            for j, name in enumerate(names):
                s = srcs_of(node).get(name)
                if s is not None:
                    self._fill(rec.src[j], s)
                    lay = self._packed_source(node, name, s)
                    if lay is not None:
                        rec.src[j].type = lay.packed_code
                    roots[s.root().id] = s.root()
            if convert:   # src1: the converted rows
                rec.src[1] = records[i - 2].dst
            if pack:      # src1 packed into panels, beside src1 itself
                rec.src[2] = records[i - 2].dst
            _params(node, rec)
            at[id(node)] = rec
        for c, s in self._fused_side_copies(compute).items():
            copy, scan = at[id(compute[c])], at[id(compute[s])]
            copy.op = self.op_code("GET_ROWS:in_scan")
            scan.side = copy.dst.data
        fused = self._fused_stores(compute)
        stored = ffi.new("int64_t[]", max(len(fused), 1))
        for k, (c, s) in enumerate(fused.items()):
            store, scan = at[id(compute[c])], at[id(compute[s])]
            self._fill(scan.store, compute[c])
            scan.stored = store.stored = stored + k
        roots = list(roots.values())
        self.plans_built += 1
        plan = CpuPlan(nodes, records, len(record_nodes), record_nodes, roots, self._signature(roots))
        plan.work = work             # the conversion / packing buffer: alive as long as the records point into it
        plan.stored = stored         # the fused stores' words, likewise
        plan.fused_stores = len(fused)
        plan.epoch = bind_epoch()
        return plan

    def run_plan(self, plan: CpuPlan, reads: dict | None = None):
        """Execute every record of ``plan`` in one call into C. ``reads``: the sources table
        (sources.reading) that names a failing node's sources, when the caller is outside one."""
        err = getattr(self._tls, "err", None)
        if err is None:
            err = self._tls.err = ffi.new("mg_error *")
        rc = lib.mg_plan_run(plan.records, plan.n, self.n_threads, err)
        plan.runs += 1
        if rc != 0 and reads is None:
            self._raise(plan, err)
        elif rc != 0:
            with reading(reads):
                self._raise(plan, err)

    def _raise(self, plan: CpuPlan, err):
        node = plan.compute[err.node] if 0 <= err.node < len(plan.compute) else None
        if err.code == lib.MG_ERR_INDEX and node is not None:
            idx = srcs_of(node)[OPS[node.op].srcs[err.src]]
            raise OpError(f"{node.op} {node.label}: index {err.value} in {idx.label} "
                          f"is out of range [0, {err.limit})")
        what = f"{node.op} {node.label}" if node is not None else f"node record {err.node}"
        raise OpError(f"{what}: backend {self.name} failed (code {err.code}, value {err.value})")

    def get_plan(self, nodes, cache: dict | None = None) -> CpuPlan:
        """The plan of ``nodes``: from the owner's per-graph cache when given (the plan then dies
        with the graph), else from a small LRU of this backend's own (direct callers)."""
        if cache is not None:
            key = ("cpu_plan", self.name, id(nodes), len(nodes))
            plan = cache.get(key)
            if plan is not None and plan.nodes is nodes and (
                    plan.epoch == bind_epoch() or plan.sig == self._signature(plan.roots)):
                plan.epoch = bind_epoch()
                return plan
            plan = cache[key] = self.build_plan(nodes)
            return plan
        key = (id(nodes), len(nodes))
        plan = self._plans.get(key)
        if plan is not None and plan.nodes is nodes and (
                plan.epoch == bind_epoch() or plan.sig == self._signature(plan.roots)):
            plan.epoch = bind_epoch()         # nothing was re-bound: the next check is O(1)
            self._plans.move_to_end(key)
            return plan
        plan = self.build_plan(nodes)
        self._plans[key] = plan
        while len(self._plans) > self.max_plans:
            self._plans.popitem(last=False)
        return plan

    def compute_nodes(self, nodes, cache=None):
        self.run_plan(self.get_plan(nodes, cache))

    def rerun_of(self, gf):
        plan = self.get_plan(gf.nodes, gf.cache)   # the plan the compute just ran (cached)
        return lambda: self.run_plan(plan, {})


def _factory(idx: int) -> CpuBackend:
    return CpuBackend(idx)


register_backend("cpu", _factory)

__all__ = ["CpuBackend", "CpuPlan", "OP_CODES", "UNSUPPORTED", "implemented_ops"]
