"""cffi build script for the CPU kernels (API mode): `pip install -e .` runs it through
setup.py's `cffi_modules`, producing the extension module `minigraph.backends.cpu._kernels`.

Build switches (environment variables read at build time):
  MINIGRAPH_PORTABLE=1  drop -march=native (a binary that runs on any x86-64 / the host ISA
                        baseline; the f16 conversion then uses the portable bit routine).
  MINIGRAPH_ASAN=1      build with -fsanitize=address (run Python with
                        LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0).
Defaults: -O3 -march=native (like ggml's GGML_NATIVE); the executor's threads are its own
persistent pthread pool (plan.c), linked with -pthread. -ffp-contract=off keeps
every multiply and add rounded separately, as the NumPy reference does; the matmul uses FMA
explicitly through intrinsics.
"""
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["copy.c", "index.c", "elementwise.c", "reduce.c", "matmul.c", "gemm_lanes.c", "ssm.c", "rope.c", "norm.c", "activation.c", "attention.c", "quant_codec.c", "quant_matmul.c", "plan.c"]

# the cdef is the shared interface header itself (mg.h includes it too)
with open(os.path.join(HERE, "mg_api.h")) as f:
    CDEF = f.read()


def _load_env_table():
    """minigraph/env.py, loaded by path: at build time the minigraph package is not importable."""
    import importlib.util
    import sys
    if "_minigraph_env" in sys.modules:
        return sys.modules["_minigraph_env"]
    path = os.path.join(HERE, "..", "..", "minigraph", "env.py")
    spec = importlib.util.spec_from_file_location("_minigraph_env", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _flag(name: str) -> bool:
    return _load_env_table().get(name)


def compile_args():
    args = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
    link = []
    if not _flag("MINIGRAPH_PORTABLE"):
        args.append("-march=native")
    args.append("-pthread")
    link.append("-pthread")
    if _flag("MINIGRAPH_ASAN"):
        args += ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]
        link.append("-fsanitize=address")
    return args, link


ffibuilder = FFI()
ffibuilder.cdef(CDEF)
_args, _link = compile_args()
# setuptools wants source paths relative to the project root (where setup.py runs)
_rel = os.path.relpath(HERE, os.getcwd())
ffibuilder.set_source(
    "minigraph.backends.cpu._kernels",
    '#include "mg.h"\n',
    sources=[os.path.join(_rel, s) for s in SOURCES],
    include_dirs=[HERE],
    depends=[os.path.join(_rel, "mg.h"), os.path.join(_rel, "mg_api.h"), os.path.join(_rel, "quant.h")],
    extra_compile_args=_args,
    extra_link_args=_link,
)

if __name__ == "__main__":   # a quick in-place build: python backends/cpu/build.py (from the root)
    ffibuilder.compile(verbose=True)
