"""cffi build script for the CPU kernels (API mode): `pip install -e .` runs it through
setup.py's `cffi_modules`, producing the extension module `backends.cpu._kernels`.

Build switches (environment variables read at build time):
  MINIGRAPH_PORTABLE=1  drop -march=native (a binary that runs on any x86-64 / the host ISA
                        baseline; the f16 conversion then uses the portable bit routine).
  MINIGRAPH_ASAN=1      build with -fsanitize=address (run Python with
                        LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0).
  MINIGRAPH_OPENMP=0    build without OpenMP (single-threaded executor).
Defaults: -O3 -march=native (like ggml's GGML_NATIVE) with OpenMP. -ffp-contract=off keeps
every multiply and add rounded separately, as the NumPy reference does; the matmul uses FMA
explicitly through intrinsics.
"""
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["copy.c", "index.c", "elementwise.c", "reduce.c", "matmul.c", "ssm.c", "plan.c"]

CDEF = """
enum mg_type { MG_F32 = 0, MG_F16 = 1, MG_I32 = 2, MG_I64 = 3 };
enum mg_op {
    MG_OP_NONE = 0,
    MG_OP_CPY, MG_OP_CONT, MG_OP_CONCAT, MG_OP_REPEAT,
    MG_OP_GET_ROWS, MG_OP_SET_ROWS, MG_OP_ARANGE,
    MG_OP_SILU, MG_OP_SIGMOID, MG_OP_SOFTPLUS, MG_OP_EXP, MG_OP_NEG, MG_OP_SQRT,
    MG_OP_ADD, MG_OP_SUB, MG_OP_MUL, MG_OP_DIV, MG_OP_SCALE,
    MG_OP_RMS_NORM, MG_OP_L2_NORM, MG_OP_SUM_ROWS,
    MG_OP_MUL_MAT,
    MG_OP_SSM_CONV, MG_OP_SSM_SCAN, MG_OP_GATED_DELTA_NET,
    MG_OP_COUNT
};
enum mg_status { MG_OK = 0, MG_ERR_INDEX = 1, MG_ERR_OP = 2 };
#define MG_MAX_SRC 7

typedef struct mg_tensor {
    char    *data;
    int64_t  ne[4];
    int64_t  nb[4];
    int32_t  type;
    int32_t  pad;
} mg_tensor;

typedef struct mg_node {
    int32_t   op;
    int32_t   n_src;
    mg_tensor dst;
    mg_tensor src[7];
    float     fp[4];
    int64_t   ip[4];
} mg_node;

typedef struct mg_error {
    int32_t code;
    int32_t node;
    int32_t src;
    int32_t pad;
    int64_t value;
    int64_t limit;
} mg_error;

int mg_plan_run(const mg_node *nodes, int n_nodes, int n_threads, mg_error *err);
int mg_max_threads(void);
uint16_t mg_f32_to_f16(float x);
float mg_f16_to_f32(uint16_t h);
"""


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def compile_args():
    args = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
    link = []
    if not _flag("MINIGRAPH_PORTABLE"):
        args.append("-march=native")
    if os.environ.get("MINIGRAPH_OPENMP", "1").strip() not in ("0", "false", "no", "off"):
        args.append("-fopenmp")
        link.append("-fopenmp")
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
    "backends.cpu._kernels",
    '#include "mg.h"\n',
    sources=[os.path.join(_rel, s) for s in SOURCES],
    include_dirs=[HERE],
    depends=[os.path.join(_rel, "mg.h")],
    extra_compile_args=_args,
    extra_link_args=_link,
)

if __name__ == "__main__":   # a quick in-place build: python backends/cpu/build.py (from the root)
    ffibuilder.compile(verbose=True)
