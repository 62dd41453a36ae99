"""A CPU stand-in for the CUDA device, for tests on machines without a GPU.

`EmuDevice` has the same small interface as the CuPy device in backends/cuda/__init__.py, but its
memory is NumPy arrays and its kernels are the same .cu sources compiled with g++ against
emu.h, which runs each launch block by block with one fiber per CUDA thread (so
__syncthreads and warp shuffles behave as on the hardware). Each launch also checks the
argument list against the kernel's parameter types, which a real launch cannot do.

    from minigraph.backends.cuda import CudaBackend
    from minigraph.backends.cuda.emu import EmuDevice
    be = CudaBackend(0, device=EmuDevice())
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from minigraph import env

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')


def kernel_names(path: str) -> list[str]:
    """The kernels a .cu file defines (each is written `extern "C" __global__ void NAME(`)."""
    with open(path) as f:
        return KERNEL_RE.findall(f.read())


def compiler() -> str | None:
    return shutil.which(env.get("CXX")) or shutil.which("g++") or shutil.which("c++")


class EmuError(RuntimeError):
    pass


class _Lib:
    def __init__(self, path: str, names: list[str]):
        self.lib = ctypes.CDLL(path)
        self.lib.emu_error.restype = ctypes.c_char_p
        self.funcs = {}
        for n in names:
            f = getattr(self.lib, "emu__" + n)
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_uint] * 6 + [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
                                                ctypes.c_char_p, ctypes.c_int]
            self.funcs[n] = f


class EmuDevice:
    """A fake GPU: NumPy memory, kernels compiled for the CPU. Small grids (max_grid) make the
    kernels' grid-stride loops run more than once, as large tensors do on a real device."""

    name = "cpu-emulated CUDA"
    max_grid = (3, 2, 2)

    def __init__(self, build_dir: str | None = None, reverse: bool = False):
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("the CUDA emulator needs a C++ compiler (g++)")
        self.cxx = cxx
        self.build_dir = build_dir or os.path.join(tempfile.gettempdir(), f"minigraph-cuda-emu-{os.getuid()}")
        os.makedirs(self.build_dir, exist_ok=True)
        self._libs: dict[str, _Lib] = {}
        self.reverse = reverse   # run blocks and threads last to first

    # -- memory ---------------------------------------------------------------------------
    def alloc(self, nbytes: int):
        return np.zeros(max(int(nbytes), 1), np.uint8)

    scratch = alloc

    def ptr(self, mem) -> int:
        return mem.ctypes.data

    def upload(self, mem, offs: int, data: np.ndarray):
        mem[offs:offs + data.size] = data

    def download(self, mem, offs: int, n: int) -> np.ndarray:
        return mem[offs:offs + n].copy()

    def memcpy(self, dst: int, src: int, n: int):
        ctypes.memmove(dst, src, n)

    def memset(self, dst: int, value: int, n: int):
        ctypes.memset(dst, value, n)

    def fill(self, mem, value: int):
        mem[:] = value

    def context(self):
        return contextlib.nullcontext()

    def synchronize(self):
        pass

    # -- kernels --------------------------------------------------------------------------
    def _lib(self, fname: str) -> _Lib:
        lib = self._libs.get(fname)
        if lib is not None:
            return lib
        src = os.path.join(HERE, fname)
        names = kernel_names(src)
        h = hashlib.sha256()
        for p in (src, os.path.join(HERE, "common.cuh"), os.path.join(HERE, "emu.h")):
            with open(p, "rb") as f:
                h.update(f.read())
        h.update(self.cxx.encode())
        key = h.hexdigest()[:16]
        so = os.path.join(self.build_dir, f"{fname[:-3]}-{key}.so")
        if not os.path.exists(so):
            stub = os.path.join(self.build_dir, f"{fname[:-3]}-{key}.cpp")
            with open(stub, "w") as f:
                f.write('#include "emu.h"\n')
                f.write(f'#include "{src}"\n')
                for n in names:
                    f.write(f'extern "C" int emu__{n}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, '
                            f'unsigned bz, void **args, const int *sizes, const char *kinds, int nargs) {{\n'
                            f'    return emu::launch(&{n}, emu_dim3{{gx, gy, gz}}, emu_dim3{{bx, by, bz}}, args, sizes, kinds, nargs);\n}}\n')
            tmp = so + f".{os.getpid()}.tmp"
            cmd = [self.cxx, "-std=c++17", "-O1", "-g0", "-fPIC", "-shared", "-ffp-contract=off", "-w",
                   "-I", HERE, stub, "-o", tmp]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise EmuError(f"emulator build of {fname} failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
            os.replace(tmp, so)
        lib = self._libs[fname] = _Lib(so, names)
        return lib

    def launch(self, fname: str, kernel: str, grid, block, args):
        lib = self._lib(fname)
        f = lib.funcs.get(kernel)
        if f is None:
            raise EmuError(f"{fname} has no kernel {kernel}")
        keep, ptrs, sizes, kinds = [], [], [], []
        from . import Ptr   # the backend's pointer marker
        for a in args:
            if isinstance(a, Ptr):
                v = np.array([int(a)], np.uint64)
                kind = "p"
            elif isinstance(a, np.generic):
                v = np.array([a])
                kind = {"f": "f", "i": "i", "u": "u"}.get(v.dtype.kind)
                if kind is None:
                    raise EmuError(f"{kernel}: argument {a!r} of dtype {v.dtype} cannot be passed")
            else:
                raise EmuError(f"{kernel}: argument {a!r} ({type(a).__name__}) must be a NumPy scalar or a Ptr")
            keep.append(v)
            ptrs.append(v.ctypes.data)
            sizes.append(v.itemsize)
            kinds.append(kind)
        n = len(args)
        argv = (ctypes.c_void_p * max(n, 1))(*ptrs)
        sizev = (ctypes.c_int * max(n, 1))(*sizes)
        g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        b = tuple(int(x) for x in block) + (1,) * (3 - len(block))
        lib.lib.emu_set_reverse(int(self.reverse))
        rc = f(*g, *b, argv, sizev, "".join(kinds).encode(), n)
        if rc != 0:
            raise EmuError(f"{fname}:{kernel}: {lib.lib.emu_error().decode()}")
