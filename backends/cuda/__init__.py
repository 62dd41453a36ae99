"""The CUDA backend: device memory and kernels through CuPy, for devices named ``cuda:N``.

Buffers are CuPy uint8 arrays on device N. Every compute op runs a CUDA kernel from the .cu files
beside this module (one per op family), compiled once per process with NVRTC through
``cupy.RawModule``. Kernels take data pointers plus ggml's byte strides, so any strided view works
(padded rows, permutations, overlapping windows), and write-through ops (cpy, set_rows, in-place
ops) write straight into their destination's memory. Index ops check their indices on the device
first and raise ``mg.OpError`` (naming the node, as the reference does) before anything is written.

This module imports without CuPy; asking for a ``cuda`` device then raises a RuntimeError that
says how to install it. ``backends/cuda/emu.py`` provides a CPU stand-in for the device (same
kernels, compiled with g++), which the tests use where there is no GPU.
"""
from __future__ import annotations

import math
import os
import re

import numpy as np

from minigraph.backend import GUARD_BYTE, Backend, Buffer, is_compute_node, register_backend
from minigraph.alloc import allocation_error
from minigraph.errors import OpError
from minigraph.ops.elementwise import BINARY, UNARY
from minigraph.ops.index import check_indices
from minigraph.registry import OPS
from minigraph.sources import srcs_of
from minigraph.tensor import contiguous_strides
from minigraph.types import f16, f32, i32, i64

HERE = os.path.dirname(os.path.abspath(__file__))
INSTALL_HINT = "pip install 'minigraph[cuda]'"
NVRTC_OPTIONS = ("--fmad=false",)   # a*b + c rounds twice, as NumPy computes it

_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"common\.cuh"[ \t]*$', re.M)


def module_source(fname: str) -> str:
    """A .cu file with common.cuh pasted in (NVRTC gets one self-contained source, so CuPy's
    kernel cache, keyed by the source text, sees every change)."""
    with open(os.path.join(HERE, "common.cuh")) as f:
        common = f.read()
    with open(os.path.join(HERE, fname)) as f:
        src = f.read()
    return _INCLUDE_RE.sub(lambda m: common, src, count=1)


class Ptr(int):
    """A device address passed to a kernel as a pointer parameter."""


# ---------------------------------------------------------------------------------------------
# the device: a thin layer over CuPy (EmuDevice in emu.py has the same methods)

_MODULES: dict = {}


class CupyDevice:
    def __init__(self, index: int):
        try:
            import cupy
        except ImportError as e:
            raise RuntimeError(f"device cuda:{index} needs CuPy, which is not installed: {INSTALL_HINT}") from e
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:   # CUDARuntimeError: no driver, no device, driver too old
            raise RuntimeError(f"device cuda:{index}: no CUDA device is visible ({e})") from e
        if n == 0:
            raise RuntimeError(f"device cuda:{index}: no CUDA device is visible")
        if not 0 <= index < n:
            raise ValueError(f"device cuda:{index}: only {n} CUDA device(s) are visible (cuda:0 .. cuda:{n - 1})")
        self.cp = cupy
        self.index = index
        self.device = cupy.cuda.Device(index)
        props = cupy.cuda.runtime.getDeviceProperties(index)
        name = props.get("name", b"")
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.max_grid = (2 ** 31 - 1, 65535, 65535)

    def context(self):
        return self.device

    def alloc(self, nbytes: int):
        with self.device:
            return self.cp.zeros(max(int(nbytes), 1), np.uint8)

    def scratch(self, nbytes: int):
        with self.device:
            return self.cp.empty(max(int(nbytes), 1), np.uint8)

    def ptr(self, mem) -> int:
        return mem.data.ptr

    def upload(self, mem, offs: int, data: np.ndarray):
        if data.size:
            with self.device:
                mem[offs:offs + data.size].set(np.ascontiguousarray(data, np.uint8).reshape(-1))

    def download(self, mem, offs: int, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, np.uint8)
        with self.device:
            return mem[offs:offs + n].get()

    def memcpy(self, dst: int, src: int, n: int):
        rt = self.cp.cuda.runtime
        with self.device:
            rt.memcpyAsync(dst, src, n, rt.memcpyDeviceToDevice, self.cp.cuda.get_current_stream().ptr)

    def memset(self, dst: int, value: int, n: int):
        rt = self.cp.cuda.runtime
        with self.device:
            rt.memsetAsync(dst, value, n, self.cp.cuda.get_current_stream().ptr)

    def fill(self, mem, value: int):
        with self.device:
            mem.fill(value)

    def synchronize(self):
        self.device.synchronize()

    def _function(self, fname: str, kernel: str):
        key = (self.index, fname)
        mod = _MODULES.get(key)
        if mod is None:
            mod = _MODULES[key] = self.cp.RawModule(code=module_source(fname), options=NVRTC_OPTIONS)
        return mod.get_function(kernel)

    def launch(self, fname: str, kernel: str, grid, block, args):
        conv = [np.uint64(a) if isinstance(a, Ptr) else a for a in args]
        with self.device:
            self._function(fname, kernel)(tuple(grid), tuple(block), tuple(conv))


# ---------------------------------------------------------------------------------------------
# operands: a pointer with a type, extents and byte strides (a tensor, or a staged copy of one)

class Opnd:
    __slots__ = ("ptr", "type", "ne", "nb")

    def __init__(self, ptr: int, type, ne, nb):
        self.ptr, self.type, self.ne, self.nb = ptr, type, tuple(ne), tuple(nb)

    @property
    def n(self) -> int:
        return int(np.prod(self.ne))

    def p(self) -> Ptr:
        return Ptr(self.ptr)

    def strides(self) -> list:
        return [np.int64(x) for x in self.nb]

    def contiguous(self) -> bool:
        nxt = self.type.size                     # bytes of one element, or of one block
        ne0 = self.ne[0] // self.type.blck_size
        if ne0 != 1 and self.nb[0] != nxt:
            return False
        nxt *= ne0
        for i in range(1, 4):
            if self.ne[i] != 1:
                if self.nb[i] != nxt:
                    return False
                nxt *= self.ne[i]
        return True


def _fastdiv(d: int) -> tuple[int, int]:
    """(m, s) with n // d == (umulhi(n, m) + n) >> s for 0 <= n < 2^31 (see common.cuh)."""
    if not 1 <= d < 2 ** 31:
        return 0, 0
    s = 0
    while (1 << s) < d:
        s += 1
    return ((1 << 32) * ((1 << s) - d)) // d + 1, s


def divs(ne) -> list:
    """The DIVS(...) parameter group of common.cuh for extents ne."""
    d = [int(x) for x in ne[:3]]
    out = [np.int64(x) for x in d]
    for x in d:
        m, s = _fastdiv(x)
        out += [np.uint32(m), np.uint32(s)]
    return out


def _cdiv(a: int, b: int) -> int:
    return max(1, (a + b - 1) // b)


def _kernels_in_sources() -> dict:
    """.cu file -> the kernels it defines (each written `extern "C" __global__ void NAME(`)."""
    from .emu import kernel_names
    return {f: kernel_names(os.path.join(HERE, f)) for f in sorted(os.listdir(HERE)) if f.endswith(".cu")}


CU_KERNELS = _kernels_in_sources()
_FILE_OF = {k: f for f, ks in CU_KERNELS.items() for k in ks}

MAX_STATE_DIM = 1024   # SSM_SCAN d_state and GATED_DELTA_NET S_v: 32 lanes x 32 registers
FA_MAX_DV = 1024       # FLASH_ATTN_EXT D_v: FA_THREADS x FA_PER_THREAD accumulators (attention.cu)


def _rows_per_lane(n: int) -> int:
    return 1 if n <= 32 else 4 if n <= 128 else 32


class CudaBackend(Backend):
    """Device ``cuda:N``. ``device`` replaces the CuPy device (tests pass emu.EmuDevice())."""

    # bf16 and block types (and f16 weights) the kernels take (quant.cu: get_rows, mul_mat, cpy)
    wide_types = frozenset({"f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k"})

    def __init__(self, index: int = 0, device=None):
        self.index = index
        self.name = f"cuda:{index}"
        self.dev = device if device is not None else CupyDevice(index)

    # -- memory ---------------------------------------------------------------------------
    def alloc_buffer(self, nbytes: int, usage: str, tensors=()) -> Buffer:
        try:
            mem = self.dev.alloc(max(nbytes, 1))
        except MemoryError:          # CuPy's OutOfMemoryError is one: name the tensor instead
            raise allocation_error(nbytes, self.name, tensors, "the device is out of memory") from None
        return Buffer(self, nbytes, usage, mem)

    def _opnd(self, t) -> Opnd:
        buf, offs = t.storage()
        if buf.backend is not self:
            raise OpError(f"tensor {t.label} lives on {buf.backend.name}, not {self.name}")
        size = 2 if t.type.is_quantized else t.type.size   # block kernels read bytes and f16 fields
        if offs % size or any(b % size for n, b in zip(t.ne, t.nb) if n > 1):
            raise OpError(f"tensor {t.label} (offset {offs}, nb={list(t.nb)}) is not aligned to its "
                          f"{size}-byte elements, which {self.name} needs")
        return Opnd(self.dev.ptr(buf.mem) + offs, t.type, t.ne, t.nb)

    def _contig_scratch(self, type, ne, keep: list) -> Opnd:
        n = int(np.prod(ne))
        mem = self.dev.scratch(n * type.size)
        keep.append(mem)
        return Opnd(self.dev.ptr(mem), type, ne, contiguous_strides(type, ne))

    def _block_rows(self, t):
        """(buffer, byte offset of each row) of a block-type tensor: rows are whole blocks."""
        buf, offs = t.storage()
        return buf, [offs + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3]
                     for i3 in range(t.ne[3]) for i2 in range(t.ne[2]) for i1 in range(t.ne[1])]

    def write_tensor(self, t, array: np.ndarray):
        if t.nelements() == 0:
            return
        data = np.ascontiguousarray(array, t.type.np_dtype).reshape(-1).view(np.uint8)
        dst = self._opnd(t)
        if t.type.is_quantized and not dst.contiguous():   # raw rows, one upload each
            buf, rows = self._block_rows(t)
            rs = t.row_size()
            for i, o in enumerate(rows):
                self.dev.upload(buf.mem, o, data[i * rs:(i + 1) * rs])
            return
        with self.dev.context():
            if dst.contiguous():
                buf, offs = t.storage()
                self.dev.upload(buf.mem, offs, data)
                return
            keep = []
            tmp = self._contig_scratch(t.type, t.ne, keep)
            self.dev.upload(keep[0], 0, data)
            self._copy(tmp, dst)

    def read_tensor(self, t) -> np.ndarray:
        shape = tuple(reversed(t.ne))
        if t.type.is_quantized:   # raw blocks, [ne3, ne2, ne1, row bytes] as the host backends give
            shape = (t.ne[3], t.ne[2], t.ne[1], t.row_size())
        if t.nelements() == 0:
            return np.zeros(shape, t.type.np_dtype)
        src = self._opnd(t)
        nbytes = t.nelements() // t.type.blck_size * t.type.size
        if t.type.is_quantized and not src.contiguous():
            buf, rows = self._block_rows(t)
            return np.concatenate([self.dev.download(buf.mem, o, t.row_size()) for o in rows]).reshape(shape)
        with self.dev.context():
            if src.contiguous():
                buf, offs = t.storage()
                raw = self.dev.download(buf.mem, offs, nbytes)
            else:
                keep = []
                tmp = self._contig_scratch(t.type, t.ne, keep)
                self._copy(src, tmp)
                raw = self.dev.download(keep[0], 0, nbytes)
        return raw.view(t.type.np_dtype).reshape(shape)

    def get_bytes(self, buf: Buffer, offs: int, n: int) -> np.ndarray:
        return self.dev.download(buf.mem, offs, n)

    def set_bytes(self, buf: Buffer, offs: int, data: np.ndarray):
        self.dev.upload(buf.mem, offs, np.ascontiguousarray(data, np.uint8).reshape(-1))

    def fill_guards(self, buf: Buffer, plan):
        self.dev.fill(buf.mem, GUARD_BYTE)

    def guards_intact(self, gf) -> bool:
        """True when no byte between planned tensors was written (tests use guard > 0)."""
        plan, buf = gf.cache[("alloc", self.name)][:2]
        mem = self.dev.download(buf.mem, 0, buf.mem.size)
        used = np.zeros(mem.size, bool)
        for t in plan.tensors:
            o = plan.offsets[t.id]
            used[o:o + t.nbytes()] = True
        return bool(np.all(mem[~used] == GUARD_BYTE))

    # -- compute --------------------------------------------------------------------------
    def supports_op(self, node) -> bool:
        if node.op == "NONE" or OPS[node.op].is_view:
            return True
        if node.op not in KERNELS:
            return False
        if node.op == "SSM_SCAN":
            return node.srcs["s"].ne[0] <= MAX_STATE_DIM
        if node.op == "GATED_DELTA_NET":
            return node.srcs["v"].ne[0] <= MAX_STATE_DIM
        if node.op == "FLASH_ATTN_EXT":
            return node.srcs["v"].ne[0] <= FA_MAX_DV
        return True

    def compute_nodes(self, nodes, cache=None):
        with self.dev.context():
            for node in nodes:
                if not is_compute_node(node):
                    continue
                keep = []   # staged copies stay alive until the node's kernels are queued
                ops = self._operands(node, keep)
                KERNELS[node.op](self, node, ops)

    def synchronize(self):
        self.dev.synchronize()

    # -- helpers for the op functions ---------------------------------------------------------
    def _launch(self, kernel: str, grid, block, args):
        g = tuple(max(1, min(int(x), m)) for x, m in zip(grid, self.dev.max_grid))
        self.dev.launch(_FILE_OF[kernel], kernel, g, block, args)

    def _flat(self, kernel: str, n: int, args, block: int = 256):
        """A 1-D grid-stride launch over n elements; args follow the leading n."""
        self._launch(kernel, (_cdiv(n, block), 1, 1), (block, 1, 1), [np.int64(n)] + list(args))


    def _operands(self, node, keep: list) -> dict:
        """The node's memory and its sources'. A write-through node whose source overlaps its
        destination reads a staged copy of that source (the reference computes the whole result
        before writing any of it); an in-place elementwise op reads and writes each element in
        the same thread, so its own input needs none."""
        ops = {"dst": self._opnd(node)}
        wt = node.view_src is not None
        if wt:
            dbuf, doffs = node.storage()
            dend = doffs + node.nbytes()
        for name, s in srcs_of(node).items():
            o = self._opnd(s)
            d = OPS[node.op]
            # a destination the kernel only writes (cpy's b, set_rows's a) needs no staging, nor
            # the in-place input of an elementwise op (each element read then written by one thread)
            if wt and name not in d.dest_sources and name not in d.inplace_sources:
                sbuf, soffs = s.storage()
                if sbuf is dbuf and soffs < dend and doffs < soffs + s.nbytes():
                    tmp = self._contig_scratch(s.type, s.ne, keep)
                    self._copy(o, tmp)
                    o = tmp
            ops[name] = o
        return ops

    def _copy(self, src: Opnd, dst: Opnd):
        """dst <- src in flattened logical order (shapes may differ, same count), converting."""
        n = dst.n
        if n == 0:
            return
        if dst.type.is_quantized:   # f32 -> q8_0 / q4_0: one thread per block of the (contiguous) dst
            nblk = n // dst.type.blck_size
            self._flat(f"cpy_f32_{dst.type.name}", nblk, divs(src.ne) + [src.p()] + src.strides() + [dst.p()])
            return
        if src.type == dst.type:
            size = src.type.size
            if src.contiguous() and dst.contiguous():
                self.dev.memcpy(dst.ptr, src.ptr, n * size)
                return
            if src.ne == dst.ne and src.nb[0] > src.nb[1] and src.ne[0] > 1 and src.ne[1] > 1:
                ne = src.ne
                self._launch(f"cpy_tr_b{size}", (_cdiv(ne[0], 32), _cdiv(ne[1], 32), ne[2] * ne[3]), (32, 8, 1),
                             [np.int64(x) for x in ne] + [src.p()] + src.strides() + [dst.p()] + dst.strides())
                return
            kernel = f"cpy_b{size}"
        else:
            kernel = f"cpy_{src.type.name}_{dst.type.name}"
        self._flat(kernel, n, divs(dst.ne) + divs(src.ne) + [src.p()] + src.strides() + [dst.p()] + dst.strides())

    def _check_indices(self, node, idx: Opnd, limit: int) -> bool:
        """True when every index is in [0, limit), checked on the device."""
        flag = self.dev.alloc(4)
        self._flat(f"check_idx_{idx.type.name}", idx.n,
                   divs(idx.ne) + [idx.p()] + idx.strides() + [np.int64(limit), Ptr(self.dev.ptr(flag))])
        return int(self.dev.download(flag, 0, 4).view(np.int32)[0]) == 0


# ---------------------------------------------------------------------------------------------
# one function per op: (backend, node, operands) -> launches, registered with @runs(op names)

KERNELS: dict = {}   # op name -> what runs it (supports_op and the coverage test read this)

# Ops this backend deliberately does not run, with the reason (the coverage test reads this).
UNSUPPORTED: dict[str, str] = {}


def runs(*names):
    """Register the decorated launcher for the registry ops ``names``."""
    def deco(fn):
        for n in names:
            if n not in OPS:
                raise RuntimeError(f"cuda: a launcher is registered for {n!r}, which is not a registered op")
            KERNELS[n] = fn
        return fn
    return deco


def implemented_ops() -> set:
    return set(KERNELS)


@runs("CPY", "CONT")
def _op_copy(be: CudaBackend, node, ops):      # CPY (into b, or a cast) and CONT
    be._copy(ops["a"], ops["dst"])


@runs("CONCAT")
def _op_concat(be, node, ops):
    a, b, d = ops["a"], ops["b"], ops["dst"]
    dim = node.params["dim"]
    be._flat(f"concat_b{d.type.size}", d.n, divs(d.ne) + [np.int64(dim), np.int64(a.ne[dim]), a.p()] + a.strides()
             + [b.p()] + b.strides() + [d.p()] + d.strides())


@runs("REPEAT")
def _op_repeat(be, node, ops):
    a, d = ops["a"], ops["dst"]
    be._flat(f"repeat_b{d.type.size}", d.n, divs(d.ne) + [np.int64(x) for x in a.ne] + [a.p()] + a.strides()
             + [d.p()] + d.strides())


@runs("GET_ROWS")
def _op_get_rows(be, node, ops):
    a, b, d = ops["a"], ops["b"], ops["dst"]
    if not be._check_indices(node, b, a.ne[1]):
        idx = be.read_tensor(srcs_of(node)["b"])[0]
        check_indices("GET_ROWS", node, "b", idx, a.ne[1])
        raise OpError(f"GET_ROWS {node.label}: an index in {srcs_of(node)['b'].label} is out of range [0, {a.ne[1]})")
    kernel = "get_rows_b4" if a.type.size == 4 and not a.type.is_quantized else f"get_rows_{a.type.name}_f32"
    be._flat(kernel, d.n, divs(d.ne) + [a.p()] + a.strides() + [b.p()] + b.strides() + [d.p()] + d.strides())


@runs("SET_ROWS")
def _op_set_rows(be, node, ops):
    b, c, d = ops["b"], ops["c"], ops["dst"]
    if not be._check_indices(node, c, d.ne[1]):
        ct = srcs_of(node)["c"]
        idx = np.tile(be.read_tensor(ct)[0], (b.ne[3] // ct.ne[2], b.ne[2] // ct.ne[1], 1))
        check_indices("SET_ROWS", node, "c", idx, d.ne[1])
        raise OpError(f"SET_ROWS {node.label}: an index in {ct.label} is out of range [0, {d.ne[1]})")
    be._flat(f"set_rows_{b.type.name}_{d.type.name}_{c.type.name}", b.n,
             divs(b.ne) + [np.int64(c.ne[1]), np.int64(c.ne[2]), b.p()] + b.strides() + [c.p()] + c.strides()
             + [d.p()] + d.strides())


@runs("ARANGE")
def _op_arange(be, node, ops):
    d = ops["dst"]
    p = node.params
    be._flat("arange_f32", d.ne[0], [np.float32(p["start"]), np.float32(p["step"]), d.p(), np.int64(d.nb[0])])


def _unary(kernel):
    def run(be, node, ops):
        a, d = ops["a"], ops["dst"]
        be._flat(kernel, d.n, divs(d.ne) + [a.p()] + a.strides() + [d.p()] + d.strides())
    return run


def _binary(kernel):
    def run(be, node, ops):
        a, b, d = ops["a"], ops["b"], ops["dst"]
        be._flat(kernel, d.n, divs(d.ne) + [a.p()] + a.strides() + [np.int64(x) for x in b.ne] + [b.p()]
                 + b.strides() + [d.p()] + d.strides())
    return run


@runs("SCALE")
def _op_scale(be, node, ops):
    a, d = ops["a"], ops["dst"]
    be._flat("scale_f32", d.n, divs(d.ne) + [a.p()] + a.strides() + [d.p()] + d.strides()
             + [np.float32(node.params["s"]), np.float32(node.params["b"])])


def _reduce(kernel):
    def run(be, node, ops):
        a, d = ops["a"], ops["dst"]
        nrows = a.ne[1] * a.ne[2] * a.ne[3]
        eps = np.float32(node.params.get("eps", 0.0))
        be._launch(kernel, (nrows, 1, 1), (256, 1, 1),
                   [np.int64(nrows), np.int64(a.ne[0]), np.int64(a.ne[1]), np.int64(a.ne[2]), a.p()] + a.strides()
                   + [d.p()] + d.strides() + [eps])
    return run


@runs("SOFT_MAX")
def _op_soft_max(be, node, ops):
    a, d, m = ops["a"], ops["dst"], ops.get("mask")
    nrows = a.ne[1] * a.ne[2] * a.ne[3]
    if m is None:   # the kernel reads no mask: any valid pointer, unit broadcast extents
        mask = [np.int64(0), np.int64(1), np.int64(1), a.p()] + [np.int64(0)] * 4
    else:
        mask = [np.int64(1), np.int64(m.ne[2]), np.int64(m.ne[3]), m.p()] + m.strides()
    be._launch("soft_max_f32", (nrows, 1, 1), (256, 1, 1),
               [np.int64(nrows), np.int64(a.ne[0]), np.int64(a.ne[1]), np.int64(a.ne[2]), a.p()] + a.strides()
               + mask + [d.p()] + d.strides() + [np.float32(node.params["scale"])])


@runs("ROPE")
def _op_rope(be, node, ops):
    from minigraph.ops.rope import rope_constants   # the host-side f32 constants the CPU kernel derives
    a, b, d, c = ops["a"], ops["b"], ops["dst"], ops.get("c")
    p = node.params
    n_dims = p["n_dims"]
    n = a.ne[1] * a.ne[2] * a.ne[3] * (n_dims // 2 + a.ne[0] - n_dims)
    if n == 0:
        return
    k = rope_constants(p)
    ints = [np.int64(v) for v in (n, a.ne[0], a.ne[1], a.ne[2], n_dims, p["mode"],
                                  p["sec_t"], p["sec_h"], p["sec_w"], p["sec_e"])]
    ff = [c.p(), np.int64(1)] if c is not None else [b.p(), np.int64(0)]   # absent: any valid pointer
    be._launch("rope_f32", (_cdiv(n, 256), 1, 1), (256, 1, 1),
               ints + [a.p()] + a.strides() + [b.p()] + ff + [d.p()] + d.strides()
               + [np.float32(k[name]) for name in ("theta_scale", "freq_scale", "ext_factor", "mscale", "lo", "hi")])


@runs("FLASH_ATTN_EXT")
def _op_flash_attn_ext(be, node, ops):
    q, k, v, d, m = ops["q"], ops["k"], ops["v"], ops["dst"], ops.get("mask")
    p = node.params
    nrows = q.ne[1] * q.ne[2] * q.ne[3]
    if nrows == 0 or v.ne[0] == 0:
        return
    if m is None:   # the kernel reads no mask: any valid pointer, unit broadcast extents
        mask = [np.int64(0), np.int64(1), np.int64(1), q.p()] + [np.int64(0)] * 4
    else:
        mask = [np.int64(1), np.int64(m.ne[2]), np.int64(m.ne[3]), m.p()] + m.strides()
    be._launch("flash_attn_ext_f32", (nrows, 1, 1), (128, 1, 1),
               [np.int64(x) for x in (nrows, q.ne[1], q.ne[2], q.ne[0], v.ne[0], k.ne[1])]
               + [q.p()] + q.strides() + [k.p(), np.int64(k.ne[2])] + k.strides()
               + [v.p(), np.int64(v.ne[2])] + v.strides() + mask + [d.p()] + d.strides()
               + [np.float32(p["scale"]) / np.float32(p["logit_softcap"]) if p["logit_softcap"] else np.float32(p["scale"]),
                  np.float32(p["max_bias"]), np.float32(p["logit_softcap"])])


def _mul_mat_weights(be, node, ops):
    """MUL_MAT with f16 / bf16 / block weights (quant.cu): src1's rows converted to the weights'
    vec_dot_type into scratch, then one warp per output element."""
    a, b, d = ops["a"], ops["b"], ops["dst"]
    K = a.ne[0]
    vt = a.type.vec_dot_type
    rows = b.ne[1] * b.ne[2] * b.ne[3]
    row_bytes = vt.row_size(K)
    scratch = be.dev.scratch(rows * row_bytes)
    per_row = K // vt.blck_size
    be._flat(f"src1_to_{vt.name}", rows * per_row,
             [np.int64(per_row)] + divs((b.ne[1], b.ne[2], b.ne[3], 1)) + [b.p()] + b.strides()
             + [Ptr(be.dev.ptr(scratch)), np.int64(row_bytes)])
    be._launch(f"mul_mat_{a.type.name}", (_cdiv(d.n, 8), 1, 1), (32, 8, 1),   # a warp per output
               [np.int64(d.n)] + divs(d.ne) + [np.int64(K), np.int64(b.ne[2] // a.ne[2]),
                                               np.int64(b.ne[3] // a.ne[3]), a.p()]
               + a.strides() + [Ptr(be.dev.ptr(scratch)), np.int64(row_bytes), d.p()] + d.strides())


@runs("MUL_MAT")
def _op_mul_mat(be, node, ops):
    a, b, d = ops["a"], ops["b"], ops["dst"]
    if a.type != f32:
        return _mul_mat_weights(be, node, ops)
    M, N, K = a.ne[1], b.ne[1], a.ne[0]
    be._launch("mul_mat_f32", (_cdiv(M, 16), _cdiv(N, 16), b.ne[2] * b.ne[3]), (16, 16, 1),
               [np.int64(x) for x in (M, N, K, b.ne[2], b.ne[3], b.ne[2] // a.ne[2], b.ne[3] // a.ne[3])]
               + [a.p()] + a.strides() + [b.p()] + b.strides() + [d.p()] + d.strides())


@runs("SSM_CONV")
def _op_ssm_conv(be, node, ops):
    x, w, d = ops["sx"], ops["c"], ops["dst"]
    d_conv, d_inner, n_t, n_s = w.ne[0], w.ne[1], d.ne[1], d.ne[2]
    tail = [x.p()] + x.strides() + [w.p()] + w.strides() + [d.p()] + d.strides()
    if d_conv <= 32:
        be._launch("ssm_conv_f32", (_cdiv(d_inner, 32), _cdiv(n_t, 32), n_s), (32, 8, 1),
                   [np.int64(v) for v in (d_conv, d_inner, n_t, n_s)] + tail)
    else:
        be._flat("ssm_conv_any_f32", d.n, divs(d.ne) + [np.int64(d_conv)] + tail)


def _zero_tail(be, d: Opnd, start: int):
    """Zero the snapshot slots past the last token (the reference leaves them 0)."""
    n = d.n
    if start < n:
        be.dev.memset(d.ptr + start * 4, 0, (n - start) * 4)


@runs("SSM_SCAN")
def _op_ssm_scan(be, node, ops):
    s, x, dt, A, B, C, ids, d = (ops[k] for k in ("s", "x", "dt", "A", "B", "C", "ids", "dst"))
    ds, hd, nh, nt, ns, ng = s.ne[0], x.ne[0], x.ne[1], x.ne[2], x.ne[3], B.ne[1]
    K = node.params["K"]
    if not be._check_indices(node, ids, s.ne[3]):
        check_indices("SSM_SCAN", node, "ids", be.read_tensor(srcs_of(node)["ids"]).reshape(-1), s.ne[3])
        raise OpError(f"SSM_SCAN {node.label}: an index in ids is out of range [0, {s.ne[3]})")
    _zero_tail(be, d, x.n + min(nt, K) * ds * hd * nh * ns)
    nrows = ns * nh * hd
    args = [np.int64(v) for v in (ds, hd, nh, nt, ns, ng, K, A.ne[0])]
    for o in (s, x, dt, A, B, C):
        args += [o.p()] + o.strides()
    args += [ids.p(), np.int64(ids.nb[0]), d.p()]
    be._launch(f"ssm_scan_j{_rows_per_lane(ds)}", (_cdiv(nrows, 4), 1, 1), (128, 1, 1), args)


@runs("GATED_DELTA_NET")
def _op_gated_delta_net(be, node, ops):
    q, k, v, g, beta, state, d = (ops[n] for n in ("q", "k", "v", "g", "beta", "state", "dst"))
    S, H, T, ns = v.ne
    K = node.params["K"]
    scale = np.float32(1.0 / np.sqrt(np.float32(S)))   # as the reference computes it
    _zero_tail(be, d, S * H * T * ns + min(T, K) * S * S * H * ns)
    nrows = ns * H * S
    args = [np.int64(x) for x in (S, H, T, ns, q.ne[1], q.ne[3], k.ne[1], k.ne[3], g.ne[0], K)] + [scale]
    for o in (q, k, v, g, beta, state):
        args += [o.p()] + o.strides()
    args += [d.p()]
    be._launch(f"gated_delta_net_j{_rows_per_lane(S)}", (_cdiv(nrows, 4), 1, 1), (128, 1, 1), args)


# the unary and binary families: op NAME runs the kernel name_f32 of elementwise.cu when the
# source defines it (so a new unary op needs only its kernel there)
for _name in UNARY:
    if f"{_name.lower()}_f32" in _FILE_OF:
        KERNELS[_name] = _unary(f"{_name.lower()}_f32")
for _name in BINARY:
    if f"{_name.lower()}_f32" in _FILE_OF:
        KERNELS[_name] = _binary(f"{_name.lower()}_f32")
for _name, _kernel in {"NORM": "norm_f32", "RMS_NORM": "rms_norm_f32", "L2_NORM": "l2_norm_f32",
                      "SUM_ROWS": "sum_rows_f32"}.items():
    KERNELS[_name] = _reduce(_kernel)


def _factory(index: int) -> CudaBackend:
    return CudaBackend(index)


register_backend("cuda", _factory)

__all__ = ["CudaBackend", "CupyDevice", "KERNELS", "CU_KERNELS", "UNSUPPORTED", "implemented_ops", "module_source",
           "INSTALL_HINT"]
