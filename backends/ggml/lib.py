"""Loading a current ggml (0.25, with its backend API and RPC client) through cffi ABI mode.

Where from: the directory named by MINIGRAPH_LIBGGML, else llama-cpp-python's `llama_cpp/lib`
(the `llama` extra builds ggml with RPC there). Nothing is loaded until a ggml device is asked
for. Every failure is a `GgmlLoadError` with one line saying what is missing.

One process, one ggml: libggml-python's ggml 0.20 (the op oracle) exports the same symbol names,
so if it is already mapped into this process the load is refused instead of mixing the two."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from cffi import FFI

from minigraph import env

from .lowering import CDEF_TENSOR, cdef_for_ops, constructor_names

LIBS = ("libggml-base", "libggml-cpu", "libggml", "libggml-rpc")

CDEF_BACKEND = """
typedef struct ggml_backend * ggml_backend_t;
typedef struct ggml_backend_buffer * ggml_backend_buffer_t;
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_sched * ggml_backend_sched_t;
void ggml_cpu_init(void);
ggml_backend_t ggml_backend_cpu_init(void);
void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
const char * ggml_backend_name(ggml_backend_t backend);
void ggml_backend_free(ggml_backend_t backend);
ggml_backend_buffer_t ggml_backend_alloc_buffer(ggml_backend_t backend, size_t size);
size_t ggml_backend_get_alignment(ggml_backend_t backend);
void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
void * ggml_backend_buffer_get_base(ggml_backend_buffer_t buffer);
size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer);
void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
void ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer, int usage);
void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
void ggml_backend_synchronize(ggml_backend_t backend);
int ggml_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph);
bool ggml_backend_supports_op(ggml_backend_t backend, const struct ggml_tensor * op);
ggml_backend_dev_t ggml_backend_get_device(ggml_backend_t backend);
int ggml_backend_tensor_alloc(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, void * addr);
int ggml_backend_view_init(struct ggml_tensor * tensor);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
int ggml_backend_dev_type(ggml_backend_dev_t device);
ggml_backend_t ggml_backend_dev_init(ggml_backend_dev_t device, const char * params);
ggml_backend_t ggml_backend_rpc_init(const char * endpoint, uint32_t device);
void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
                                   size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices);
ggml_backend_sched_t ggml_backend_sched_new(ggml_backend_t * backends, ggml_backend_buffer_type_t * bufts,
                                            int n_backends, size_t graph_size, bool parallel, bool op_offload);
void ggml_backend_sched_free(ggml_backend_sched_t sched);
bool ggml_backend_sched_reserve(ggml_backend_sched_t sched, struct ggml_cgraph * measure_graph);
bool ggml_backend_sched_alloc_graph(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
void ggml_backend_sched_reset(ggml_backend_sched_t sched);
int ggml_backend_sched_get_n_splits(ggml_backend_sched_t sched);
int ggml_backend_sched_get_n_copies(ggml_backend_sched_t sched);
void ggml_backend_sched_set_tensor_backend(ggml_backend_sched_t sched, struct ggml_tensor * node, ggml_backend_t backend);
ggml_backend_t ggml_backend_sched_get_tensor_backend(ggml_backend_sched_t sched, struct ggml_tensor * node);
void ggml_backend_sched_split_graph(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
void ggml_set_name(struct ggml_tensor * tensor, const char * name);
void ggml_set_input(struct ggml_tensor * tensor);
void ggml_set_output(struct ggml_tensor * tensor);
"""

# what the backend itself calls (the op constructors are checked separately)
REQUIRED = ("ggml_init", "ggml_free", "ggml_tensor_overhead", "ggml_new_graph_custom", "ggml_build_forward_expand",
            "ggml_new_tensor", "ggml_backend_cpu_init", "ggml_backend_cpu_set_n_threads", "ggml_backend_alloc_buffer",
            "ggml_backend_buffer_get_base", "ggml_backend_tensor_alloc", "ggml_backend_view_init",
            "ggml_backend_tensor_set", "ggml_backend_tensor_get", "ggml_backend_graph_compute",
            "ggml_backend_dev_count", "ggml_backend_dev_get", "ggml_backend_dev_name", "ggml_backend_dev_init")
RPC_REQUIRED = ("ggml_backend_rpc_init", "ggml_backend_rpc_start_server")
SCHED_REQUIRED = ("ggml_backend_sched_new", "ggml_backend_sched_reserve", "ggml_backend_sched_get_tensor_backend",
                  "ggml_backend_sched_get_n_splits", "ggml_backend_sched_get_n_copies")


class GgmlLoadError(RuntimeError):
    """The ggml library cannot be used here (one line: which library, which symbol, why)."""


def lib_dir() -> Path:
    """MINIGRAPH_LIBGGML, else llama-cpp-python's llama_cpp/lib (found without importing it)."""
    given = env.get("MINIGRAPH_LIBGGML")
    if given:
        return Path(given)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise GgmlLoadError("no ggml library: install the `llama` extra (llama-cpp-python built with "
                            "CMAKE_ARGS=\"-DGGML_RPC=ON\") or set MINIGRAPH_LIBGGML to a directory holding "
                            "libggml-base, libggml-cpu, libggml and libggml-rpc")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def _find(d: Path, name: str) -> Path:
    # the file named like its SONAME first (lib.so.0): wheels ship copies, not links, of lib.so,
    # lib.so.0 and lib.so.0.x.y, and loading lib.so while libggml's DT_NEEDED pulls in lib.so.0
    # would put two copies of one library (two RPC connection tables) in the process
    sonames = sorted(p for p in d.glob(f"{name}.so.*") if p.name.count(".") == 2)
    for cand in (*sonames, d / f"{name}.so", *sorted(d.glob(f"{name}.so.*")), d / f"{name}.dylib"):
        if cand.exists():
            return cand
    raise GgmlLoadError(f"{d} has no {name}.so (MINIGRAPH_LIBGGML or llama_cpp/lib must hold "
                        f"{', '.join(LIBS)})")


def other_ggml_loaded(d: Path) -> str | None:
    """The path of a libggml-base mapped into this process from another directory, if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    mine = os.path.realpath(d)
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "libggml-base" in path and os.path.dirname(os.path.realpath(path)) != mine:
            return path
    return None


def resolve_symbol(owner, libs, name: str):
    """The first of ``libs`` (cffi libraries, in search order) that has ``name``; cached on owner,
    so each symbol is looked up once. ggml splits its API over several shared libraries."""
    if name.startswith("_"):
        raise AttributeError(name)
    for lib in libs:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            continue
        setattr(owner, name, fn)
        return fn
    raise AttributeError(name)


class Library:
    """The loaded libraries, resolved symbol by symbol (cpu, rpc, registry, then base)."""

    def __init__(self, d: Path):
        self.dir = d
        clash = other_ggml_loaded(d)
        if clash:
            raise GgmlLoadError(f"another ggml is already loaded in this process ({clash}); the ggml "
                                f"backend needs a process of its own (the op oracle's libggml-python clashes)")
        self.ffi = ffi = FFI()
        ffi.cdef(CDEF_TENSOR + CDEF_BACKEND + cdef_for_ops(), override=True)
        self._libs = []
        for name in LIBS:
            path = _find(d, name)
            try:
                self._libs.append(ffi.dlopen(str(path), ffi.RTLD_NOW | ffi.RTLD_GLOBAL))
            except OSError as e:
                raise GgmlLoadError(f"{path} does not load: {str(e).splitlines()[0]}") from None
        self._libs.reverse()        # libggml-rpc, libggml, libggml-cpu, libggml-base
        missing = [s for s in REQUIRED + RPC_REQUIRED + SCHED_REQUIRED + tuple(constructor_names())
                   if not self.has(s)]
        if missing:
            raise GgmlLoadError(f"the ggml in {d} lacks {', '.join(missing[:6])}"
                                f"{' ...' if len(missing) > 6 else ''} (ggml 0.25 built with RPC is needed)")
        if self.ggml_tensor_overhead() != 32 + ffi.sizeof("struct ggml_tensor"):
            raise GgmlLoadError(f"the ggml in {d} has another struct ggml_tensor layout than this module declares")
        self.ggml_cpu_init()

    def has(self, name: str) -> bool:
        try:
            getattr(self, name)
        except AttributeError:
            return False
        return True

    def __getattr__(self, name):
        return resolve_symbol(self, self._libs, name)


_LIB: Library | None = None


def load() -> Library:
    """The process's ggml library, loaded once (GgmlLoadError, one line, if it cannot be)."""
    global _LIB
    if _LIB is None:
        _LIB = Library(lib_dir())
    return _LIB
