"""The CUDA backend without a GPU.

- nvcc (when installed) compiles every backends/cuda/*.cu, and NVRTC (when its library is found)
  compiles the exact sources the backend hands to cupy.RawModule, with the backend's options.
- The kernels are found in the sources by name, and the launchers cover every op in the
  registry (or the op is declared unsupported with a reason).
- The CPU emulator (backends/cuda/emu.py: the same .cu files built with g++, one fiber per CUDA
  thread, tiny grids so that every grid-stride loop runs more than once, blocks and threads in
  both orders) runs the whole op table,
  the extra cases, the bad-index and the scheduler checks against the reference, through the real
  backend code (operands, strides, staging, launch arguments, which it type-checks).
"""
import ctypes
import ctypes.util
import glob
import os
import shutil
import subprocess

import numpy as np
import pytest

from minigraph.testing.op_cases import CASES, missing_types
from minigraph.registry import OPS

import minigraph.backends.cuda as cuda
from minigraph.testing import cuda_selftest as selftest
from minigraph.backends.cuda.emu import EmuDevice, compiler, kernel_names

CUDA_DIR = os.path.dirname(os.path.abspath(cuda.__file__))
CU_FILES = sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")))


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"), "/usr/local/cuda/bin/nvcc"):
        if os.path.exists(p):
            return p
    return None


NVCC = _nvcc()


def _nvcc_arch():
    """sm_90 (H100/H200) when this nvcc knows it, else its default."""
    r = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True)
    return ["-arch=sm_90"] if r.returncode == 0 and "compute_90" in r.stdout else []


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
@pytest.mark.parametrize("path", CU_FILES, ids=os.path.basename)
def test_nvcc_compiles(path, tmp_path):
    out = tmp_path / (os.path.basename(path) + ".o")
    cmd = [NVCC, "-c", *_nvcc_arch(), "--fmad=false", "-I", CUDA_DIR, path, "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    assert out.stat().st_size > 0


def _find_nvrtc():
    names = []
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if base:
            names += glob.glob(os.path.join(base, "lib64", "libnvrtc.so*"))
    import site
    for sp in site.getsitepackages():
        names += glob.glob(os.path.join(sp, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*"))
        names += glob.glob(os.path.join(sp, "nvidia", "cu*", "lib", "libnvrtc.so*"))
    lib = ctypes.util.find_library("nvrtc")
    if lib:
        names.append(lib)
    for n in names:
        if "builtins" in n or ".alt." in n:
            continue
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    return None


NVRTC = _find_nvrtc()


def _nvrtc_compile(src: str, options) -> tuple[int, str]:
    lib = NVRTC
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernels.cu", 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        return rc, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (CUDA toolkit or the nvidia-cuda-nvrtc wheel)")
@pytest.mark.parametrize("path", CU_FILES, ids=os.path.basename)
def test_nvrtc_compiles_what_the_backend_compiles(path):
    # the options cupy.RawModule uses on an H100/H200, after the backend's own
    options = list(cuda.NVRTC_OPTIONS) + ["-arch=compute_90", "--device-as-default-execution-space", "-ftz=true"]
    rc, log = _nvrtc_compile(cuda.module_source(os.path.basename(path)), options)
    assert rc == 0, log


def test_kernel_sources_are_well_formed():
    """Kernels are found by name in the sources (CU_KERNELS): each name once over all files, and
    every __global__ an extern "C" one (RawModule finds kernels by their plain name)."""
    assert sorted(cuda.CU_KERNELS) == sorted(os.path.basename(p) for p in CU_FILES)
    names = [k for ks in cuda.CU_KERNELS.values() for k in ks]
    assert len(names) == len(set(names)), "a kernel name is defined twice"
    for fname, ks in cuda.CU_KERNELS.items():
        with open(os.path.join(CUDA_DIR, fname)) as f:
            text = f.read()
        assert text.count("__global__") == len(ks), f"{fname}: a __global__ kernel is not extern \"C\""


def test_every_op_has_a_launcher_or_a_reason():
    compute_ops = {n for n, d in OPS.items() if not d.is_view}
    assert set(cuda.KERNELS) <= compute_ops
    assert compute_ops - set(cuda.KERNELS) == set(cuda.UNSUPPORTED)


def test_cuda_device_without_cupy_or_gpu_is_a_clear_error():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is visible here")
    except Exception:
        pass
    import minigraph as mg
    with pytest.raises(RuntimeError, match=r"pip install 'minigraph\[cuda\]'|no CUDA device"):
        mg.backend("cuda:0")


def test_fastdiv_constants():
    rng = np.random.default_rng(0)
    ds = [1, 2, 3, 5, 7, 31, 32, 33, 1000, 4096, 65535, 65536, 2 ** 30 + 1, 2 ** 31 - 1] + list(rng.integers(1, 2 ** 31, 200))
    for d in ds:
        d = int(d)
        m, s = cuda._fastdiv(d)
        assert 0 < m < 2 ** 32
        ns = [0, 1, d - 1, d, d + 1, 2 ** 31 - 1] + [int(x) for x in rng.integers(0, 2 ** 31, 200)]
        for n in ns:
            if 0 <= n < 2 ** 31:
                hi = (n * m) >> 32
                assert ((hi + n) & 0xFFFFFFFF) >> s == n // d, (n, d)


# ---------------------------------------------------------------------------------------------
# the CPU emulator

needs_cxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++) for the CUDA emulator")


@pytest.fixture(scope="module", params=["forward", "reverse"])
def emu_device(request):
    """Blocks and threads run first to last, or last to first: a result that depends on the
    order (a race on the real device) differs between the two."""
    return EmuDevice(reverse=request.param == "reverse")


def _emu_backend(dev):
    return lambda: cuda.CudaBackend(0, device=dev)


@needs_cxx
@pytest.mark.parametrize("case", CASES + selftest.EXTRA_CASES, ids=lambda c: c.id)
def test_emulated_kernels_match_the_reference(case, emu_device):
    if missing_types(case, cuda.CudaBackend):
        pytest.skip(missing_types(case, cuda.CudaBackend))
    for seed in selftest.SEEDS:
        err = selftest.run_case(case, seed, _emu_backend(emu_device))
        assert err is None, err


@needs_cxx
def test_emulated_bad_index_leaves_destination_untouched(emu_device):
    assert selftest.check_bad_index_leaves_destination(_emu_backend(emu_device)) == []


@needs_cxx
def test_emulated_scheduler_copies(emu_device):
    assert selftest.check_scheduler_copies(_emu_backend(emu_device)) == []


@needs_cxx
def test_emulated_strided_write_and_read(emu_device):
    assert selftest.check_strided_write_read(_emu_backend(emu_device)) == []


@needs_cxx
def test_emulator_checks_launch_arguments():
    """A launch whose arguments do not match the kernel's parameters is refused (on a GPU it
    would silently read garbage)."""
    from minigraph.backends.cuda.emu import EmuError
    emu_device = EmuDevice()
    mem = emu_device.alloc(64)
    p = cuda.Ptr(emu_device.ptr(mem))
    good = [np.int64(4), p, np.int64(4), p]   # arange_f32(n, start, step, dst, nb0) misses start/step
    with pytest.raises(EmuError, match="parameters"):
        emu_device.launch("index.cu", "arange_f32", (1, 1, 1), (32, 1, 1), good)
    with pytest.raises(EmuError, match="parameter 1"):
        emu_device.launch("index.cu", "arange_f32", (1, 1, 1), (32, 1, 1),
                          [np.int64(4), np.float64(0), np.float32(1), p, np.int64(4)])
    emu_device.launch("index.cu", "arange_f32", (1, 1, 1), (32, 1, 1),
                      [np.int64(4), np.float32(1), np.float32(2), p, np.int64(4)])
    assert mem[:16].view(np.float32).tolist() == [1, 3, 5, 7]
