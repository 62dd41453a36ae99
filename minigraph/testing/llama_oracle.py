"""llama.cpp as an oracle: decode token ids with llama.cpp itself (through llama-cpp-python's
low-level ctypes API, the optional `llama` extra) and read the logits back as NumPy arrays, so a
model minigraph writes to GGUF can be compared with what llama.cpp computes from the same file.

    with LlamaOracle("m.gguf", n_ubatch=8, n_seq_max=2) as ll:      # in this process
        logits = ll.decode({0: [1, 2, 3]})[0]                          # [3, n_vocab]
        ll.decode({0: [4], 1: [5, 6]})                                 # two sequences
        ll.rollback(0, 1)                                              # seq_rm of the last position
    with LlamaOracleProcess("m.gguf", ...) as ll: ...                  # the same, in a worker process
    probe("m.gguf")  -> Probe(ok, message)                             # load + one decode, isolated

What it drives: `llama_model_load_from_file` (CPU only), `llama_init_from_model` with n_ctx,
n_batch, n_ubatch, n_seq_max, n_rs_seq, n_threads, flash attention off/on, embeddings off, the
K/V cache type (kv_f32: f32 instead of llama.cpp's default f16);
`llama_batch_init` filled with tokens, positions, one sequence id per token and an output flag
per token; `llama_decode`; `llama_get_logits_ith`; and the memory through `llama_get_memory`:
`llama_memory_seq_rm` (rollback, whole-sequence removal), `llama_memory_seq_cp`,
`llama_memory_seq_add` / `_div` (positions moved; llama.cpp shifts the cached keys lazily),
`llama_memory_seq_pos_max`, `llama_memory_clear`.

Drafts rolled back, two ways:
  * llama.cpp's own recurrent rollback: a context with `n_rs_seq > 0` keeps that many state
    snapshots per sequence and `seq_rm(seq, p0, -1)` of the last k <= n_rs_seq positions switches to
    the snapshot. llama.cpp clamps n_rs_seq to 0 for architectures without that support (mamba2
    among them); `LlamaOracle.n_rs_seq` is the value the context really has.
  * a checkpoint, for any recurrent model: `seq_cp` the sequence to a spare sequence id before the
    draft, and after it remove the sequence, copy the spare back and decode the accepted tokens.
`speculative_step` picks the first when the context has snapshots, else the second.

A GGML_ASSERT in llama.cpp aborts the process. `LlamaOracleProcess` runs the same class in a
worker (`python -m minigraph.testing.llama_oracle --serve`), so an abort becomes a one-line
`LlamaOracleCrash` naming the assertion, and llama.cpp's own ggml never shares a process with
libggml-python's. Every failure is one line: `LlamaOracleError` (file not loadable, API missing,
decode refused) or `LlamaOracleCrash`.
"""
from __future__ import annotations

import collections
import ctypes
import importlib.util
import os
import pickle
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VERSION = "0.3.36"
CMAKE_ARGS = "-DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAMA_CURL=OFF"
INSTALL = f"CMAKE_ARGS='{CMAKE_ARGS}' pip install -e '.[test,llama]'"
RUN = "pytest -m llama"
# the shared libraries the extra must ship in llama_cpp/lib (name prefixes)
LIBS = ("libllama", "libggml-base", "libggml-cpu", "libggml", "libggml-rpc")
# the low-level functions this harness calls
API = ("llama_backend_init", "llama_log_set", "llama_model_default_params", "llama_model_load_from_file",
       "llama_model_free", "llama_context_default_params", "llama_init_from_model", "llama_free",
       "llama_model_get_vocab", "llama_vocab_n_tokens", "llama_n_rs_seq", "llama_n_seq_max", "llama_n_ubatch",
       "llama_n_batch", "llama_batch_init", "llama_batch_free", "llama_decode", "llama_get_logits_ith",
       "llama_get_memory", "llama_memory_clear", "llama_memory_seq_rm", "llama_memory_seq_cp",
       "llama_memory_seq_pos_max", "llama_memory_seq_add", "llama_memory_seq_div", "llama_model_is_recurrent",
       "llama_model_is_hybrid")
# context-parameter fields set here (all present in 0.3.36's ctypes struct, n_rs_seq included)
CPARAMS = ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "n_threads", "n_threads_batch",
           "flash_attn_type", "embeddings", "no_perf", "type_k", "type_v")
GGML_TYPE_F32 = 0           # the K/V cache type kv_f32=True asks for (llama.cpp's default is f16)

_DECODE_STATUS = {1: "no memory slot for the batch", 2: "aborted", -1: "invalid batch",
                  -2: "compute failed", -3: "compute failed (allocation)"}


class LlamaOracleError(RuntimeError):
    """llama.cpp could not do what was asked (one line: what, and llama.cpp's last error)."""


class LlamaOracleCrash(LlamaOracleError):
    """The worker process died (a GGML_ASSERT abort, a signal): one line with the assertion."""


# -- the package -------------------------------------------------------------------------------

def installed() -> bool:
    """Whether llama-cpp-python is installed (loading it is another matter: see load_problem)."""
    return importlib.util.find_spec("llama_cpp") is not None


def not_installed_reason() -> str:
    return (f"llama-cpp-python is not installed (the optional `llama` extra); to run the llama.cpp "
            f"oracle tests: {INSTALL}, then {RUN}")


def lib_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def missing_libs() -> list[str]:
    """The LIBS that llama_cpp/lib lacks (an .so whose name is the prefix, maybe with a version)."""
    d = lib_dir()
    names = [p.name for p in d.iterdir()] if d is not None and d.is_dir() else []
    return [lib for lib in LIBS if not any(n == f"{lib}.so" or n.startswith(f"{lib}.so.") for n in names)]


_LLAMA = None


def llama_cpp():
    """The loaded llama_cpp module, checked: version, shared libraries, every function and context
    field this harness uses. Raises LlamaOracleError (one line) otherwise."""
    global _LLAMA
    if _LLAMA is not None:
        return _LLAMA
    if not installed():
        raise LlamaOracleError(not_installed_reason())
    try:
        import llama_cpp as L
    except Exception as e:             # OSError from a shared library that does not load, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise LlamaOracleError(f"llama-cpp-python is installed but does not load: {type(e).__name__}: {msg}") from None
    version = getattr(L, "__version__", "?")
    if version != VERSION:
        raise LlamaOracleError(f"llama-cpp-python {version} is installed; this harness is written for {VERSION}")
    missing = missing_libs()
    if missing:
        raise LlamaOracleError(f"llama-cpp-python {version}: {lib_dir()} lacks {', '.join(missing)}")
    absent = [f for f in API if not hasattr(L, f)]
    if absent:
        raise LlamaOracleError(f"llama-cpp-python {version} lacks {', '.join(absent)}")
    fields = {f[0] for f in L.llama_context_params._fields_}
    absent = [f for f in CPARAMS if f not in fields]
    if absent:
        raise LlamaOracleError(f"llama-cpp-python {version}: llama_context_params has no {', '.join(absent)}")
    L.llama_backend_init()
    _LLAMA = L
    _quiet(L)
    return L


def load_problem_isolated(timeout: float = 120) -> str | None:
    """load_problem() run in a fresh interpreter: the check loads llama.cpp's own ggml libraries,
    which should not share this process with libggml-python's."""
    try:
        p = subprocess.run([sys.executable, "-m", "minigraph.testing.llama_oracle", "--check"],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"loading llama-cpp-python took more than {timeout:.0f} s"
    if p.returncode == 0:
        return None
    lines = (p.stdout.strip() or p.stderr.strip() or f"status {p.returncode}").splitlines()
    return lines[-1] if p.returncode != 1 else lines[0]


def load_problem() -> str | None:
    """None when the extra is installed and loads; else why not (one line)."""
    try:
        llama_cpp()
    except LlamaOracleError as e:
        return str(e)
    return None


# llama.cpp's and ggml's log goes to a ring buffer (the model loader is chatty); errors are kept
# apart to explain a failure
_LOG = collections.deque(maxlen=200)
_ERRORS = collections.deque(maxlen=20)
_LOG_CB = None
_LEVEL_ERROR = 4


def _quiet(L):
    global _LOG_CB
    if _LOG_CB is not None:
        return
    pending = []

    def cb(level, text, _user):
        s = (text or b"").decode("utf-8", "replace")
        pending.append(s)
        if s.endswith("\n"):
            line = "".join(pending).strip()
            pending.clear()
            if line:
                _LOG.append(line)
                if level == _LEVEL_ERROR:
                    _ERRORS.append(line)

    _LOG_CB = L.llama_log_callback(cb)
    L.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


def _last_error() -> str:
    return _ERRORS[-1] if _ERRORS else (_LOG[-1] if _LOG else "no message")


# -- the oracle --------------------------------------------------------------------------------

def batch_order(seq_tokens: dict) -> list:
    """(seq, token, index in seq) in the order the batch lays them out: sequence by sequence, as
    minigraph's Batch.from_seqs does, so both split the batch into the same ubatches."""
    return [(int(s), int(t), j) for s, toks in seq_tokens.items() for j, t in enumerate(toks)]


def cpu_has_amx() -> bool:
    """Whether this CPU advertises AMX (Linux /proc/cpuinfo flags; False elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_int8" in line.split()
    except OSError:
        pass
    return False


def weight_repacking() -> bool:
    """Whether llama.cpp may use its extra CPU buffer types (weights repacked for AMX or for
    wider dot products; `use_extra_bufts`). Off where the CPU has AMX: the AMX matmul of the
    vendored ggml dies with SIGILL at its first `tilezero` on such machines (seen on a KVM guest
    whose kernel grants the tile permission and runs AMX code of its own fine), which would end
    every quantized comparison. llama.cpp then runs its plain CPU kernels, as it does for F32."""
    return not cpu_has_amx()


class LlamaOracle:
    """One llama.cpp model and context in this process (see the module docstring). Not in a
    process that has loaded libggml-python: its libggml-base.so has the same name as llama.cpp's,
    and the dynamic loader binds llama.cpp's libraries to the one already loaded (undefined
    symbols); LlamaOracleProcess runs it apart."""

    def __init__(self, path, *, n_ctx: int = 512, n_batch: int = 256, n_ubatch: int = 8,
                 n_seq_max: int = 1, n_rs_seq: int = 0, flash_attn: bool = False, n_threads: int = 1,
                 kv_f32: bool = False, repack: bool = True):
        """repack=False: no repacked weights even where weight_repacking() allows them (the same
        model in llama.cpp's plain CPU kernels, another summation order)."""
        L = llama_cpp()
        self.L, self.path = L, str(path)
        self.model = self.ctx = None
        if not Path(path).is_file():
            raise LlamaOracleError(f"{path}: no such file")
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = repack and weight_repacking()
        _ERRORS.clear()
        self.model = L.llama_model_load_from_file(self.path.encode(), mp)
        if not self.model:
            raise LlamaOracleError(f"{path}: llama.cpp cannot load this file: {_last_error()}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_ubatch
        cp.n_seq_max, cp.n_rs_seq = n_seq_max, n_rs_seq
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = 1 if flash_attn else 0          # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        cp.embeddings, cp.no_perf = False, True
        if kv_f32:                       # K and V kept in f32 (minigraph's cache type), not f16
            cp.type_k = cp.type_v = GGML_TYPE_F32
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self.close()
            raise LlamaOracleError(f"{path}: llama.cpp cannot make a context "
                                   f"(n_ubatch {n_ubatch}, n_seq_max {n_seq_max}, n_rs_seq {n_rs_seq}): {_last_error()}")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = L.llama_n_batch(self.ctx)
        self.n_ubatch = L.llama_n_ubatch(self.ctx)
        self.n_seq_max = L.llama_n_seq_max(self.ctx)
        self.n_rs_seq = L.llama_n_rs_seq(self.ctx)           # after llama.cpp's clamp
        self.recurrent = bool(L.llama_model_is_recurrent(self.model))
        self.hybrid = bool(L.llama_model_is_hybrid(self.model))

    def info(self) -> dict:
        return dict(n_vocab=self.n_vocab, n_batch=self.n_batch, n_ubatch=self.n_ubatch, n_seq_max=self.n_seq_max,
                    n_rs_seq=self.n_rs_seq, recurrent=self.recurrent, hybrid=self.hybrid)

    # -- decoding ---------------------------------------------------------------------------
    def next_pos(self, seq: int) -> int:
        return int(self.L.llama_memory_seq_pos_max(self.mem, seq)) + 1

    def decode(self, seq_tokens: dict, output: str = "all") -> dict:
        """Decode {seq: [token ids]} as one batch, each sequence continuing where it stands.
        output: 'all' (logits of every token) or 'last' (of each sequence's last token).
        Returns {seq: float32 logits [n_tokens (or 1), n_vocab]}."""
        L = self.L
        order = batch_order(seq_tokens)
        n = len(order)
        if n == 0:
            return {}
        if n > self.n_batch:
            raise LlamaOracleError(f"a batch of {n} tokens is more than n_batch {self.n_batch}")
        bad = [s for s, _, _ in order if not 0 <= s < self.n_seq_max]
        if bad:
            raise LlamaOracleError(f"sequence id {bad[0]} is outside 0..{self.n_seq_max - 1} (n_seq_max)")
        bad = [t for _, t, _ in order if not 0 <= t < self.n_vocab]
        if bad:
            raise LlamaOracleError(f"token id {bad[0]} is outside the vocabulary of {self.n_vocab}")
        start = {s: self.next_pos(s) for s in seq_tokens}
        last = {s: len(toks) - 1 for s, toks in seq_tokens.items()}
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, (s, t, j) in enumerate(order):
                batch.token[i] = t
                batch.pos[i] = start[s] + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = 1 if (output == "all" or j == last[s]) else 0
            batch.n_tokens = n
            _ERRORS.clear()
            rc = L.llama_decode(self.ctx, batch)
        finally:
            L.llama_batch_free(batch)
        if rc != 0:
            raise LlamaOracleError(f"llama_decode returned {rc} ({_DECODE_STATUS.get(rc, 'error')}) on a batch of "
                                   f"{n} tokens: {_last_error()}")
        out = {s: [] for s in seq_tokens}
        for i, (s, _, j) in enumerate(order):
            if output == "all" or j == last[s]:
                p = L.llama_get_logits_ith(self.ctx, i)
                if not p:
                    raise LlamaOracleError(f"llama_get_logits_ith({i}) gave no logits: {_last_error()}")
                out[s].append(np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy())
        return {s: np.stack(v).astype(np.float32) for s, v in out.items() if v}

    # -- memory -----------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(self.L.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Move seq's positions in [p0, p1) by delta (llama.cpp shifts the cached keys lazily)."""
        self.L.llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        self.L.llama_memory_seq_div(self.mem, seq, p0, p1, d)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    def rollback(self, seq: int, k: int) -> bool:
        """Remove the last k positions of seq (seq_rm(seq, pos_max - k + 1, -1)). For a recurrent
        model llama.cpp does this only from a snapshot (k <= n_rs_seq, once per ubatch); False,
        nothing changed, when it refuses."""
        if k <= 0:
            return True
        return self.seq_rm(seq, self.next_pos(seq) - k, -1)

    def checkpoint(self, seq: int, spare: int) -> None:
        """Keep seq's state under the spare sequence id (seq_cp of the whole sequence)."""
        self.seq_rm(spare)
        self.seq_cp(seq, spare)

    def restore(self, seq: int, spare: int) -> None:
        """Make seq what it was at checkpoint(seq, spare) and free the spare id."""
        self.seq_rm(seq)
        self.seq_cp(spare, seq)
        self.seq_rm(spare)

    def speculative_step(self, seq: int, draft: list, n_accept: int, spare: int | None = None) -> np.ndarray:
        """Decode a draft for seq, keep its first n_accept tokens, drop the rest; returns the
        draft's logits [len(draft), n_vocab]. With snapshots (n_rs_seq > 0): seq_rm of the rejected
        positions, refused (LlamaOracleError) like minigraph's rollback when llama.cpp refuses.
        Without: checkpoint to `spare`, decode, restore, decode the accepted tokens again."""
        k = len(draft) - n_accept
        if self.n_rs_seq > 0 or k == 0:
            logits = self.decode({seq: list(draft)})[seq]
            if k > 0 and not self.rollback(seq, k):
                raise LlamaOracleError(f"llama.cpp refused to roll back {k} tokens of seq {seq} "
                                       f"(n_rs_seq {self.n_rs_seq})")
            return logits
        if spare is None:
            raise LlamaOracleError(f"the context has no snapshots (n_rs_seq {self.n_rs_seq}): "
                                   "a rollback needs a spare sequence id for a checkpoint")
        self.checkpoint(seq, spare)
        logits = self.decode({seq: list(draft)})[seq]
        self.restore(seq, spare)
        if n_accept:
            self.decode({seq: list(draft[:n_accept])})
        return logits

    def close(self) -> None:
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# -- the same in a worker process --------------------------------------------------------------

_ABORT_MARKS = ("GGML_ASSERT", "GGML_ABORT", "terminate called", "error:", "Error")


class LlamaOracleProcess:
    """A LlamaOracle in a worker process: the same methods (decode, rollback, seq_rm, seq_cp,
    checkpoint, restore, speculative_step, clear, next_pos, info) and attributes (n_vocab,
    n_rs_seq, ...). If llama.cpp aborts, the call raises LlamaOracleCrash with the assertion."""

    def __init__(self, path, **params):
        self.path = str(path)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(params.get("n_threads", 1)))
        self._proc = subprocess.Popen([sys.executable, "-m", "minigraph.testing.llama_oracle", "--serve"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self._stderr = collections.deque(maxlen=400)
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()
        try:
            for k, v in self._call("__init__", (self.path,), params).items():
                setattr(self, k, v)
        except BaseException:
            self.close()
            raise

    def _read_stderr(self):
        for line in iter(self._proc.stderr.readline, b""):
            self._stderr.append(line.decode("utf-8", "replace").rstrip())

    def crash_reason(self) -> str:
        """The assertion (source file name, line, condition) and, when ggml printed a backtrace,
        the first llama.cpp function in it."""
        self._drain.join(timeout=5)
        lines = [s for s in self._stderr if s.strip()]
        marked = [s for s in lines if any(m in s for m in _ABORT_MARKS) and not s.startswith("#")]
        reason = (marked or lines or ["no message on stderr"])[0 if marked else -1].strip()
        reason = re.sub(r"^\S*/([^/\s]+:\d+:)", r"\1", reason)          # the file name, not its build path
        frames = [m.group(1) for s in lines if s.startswith("#")
                  for m in [re.search(r" in ((?:llama|llm)_\w*(?:::\w+)*)", s)] if m]
        return reason + (f" (in {frames[0]})" if frames else "")

    def _call(self, name, args=(), kwargs=None):
        if self._proc is None:
            raise LlamaOracleError("this llama.cpp worker is closed")
        try:
            pickle.dump((name, args, kwargs or {}), self._proc.stdin)
            self._proc.stdin.flush()
            kind, value = pickle.load(self._proc.stdout)
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            rc = self._proc.wait()
            how = f"signal {-rc}" if rc < 0 else f"status {rc}"
            self._proc = None
            raise LlamaOracleCrash(f"llama.cpp's process died ({how}) in {name} on {self.path}: "
                                   f"{self.crash_reason()}") from None
        if kind == "ok":
            return value
        cls = {"LlamaOracleError": LlamaOracleError}.get(value[0], RuntimeError)
        raise cls(value[1])

    def __getattr__(self, name):
        if name.startswith("_") or name not in _REMOTE:
            raise AttributeError(name)
        return lambda *a, **k: self._call(name, a, k)

    def close(self) -> None:
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_REMOTE = ("decode", "rollback", "seq_rm", "seq_cp", "seq_add", "seq_div", "checkpoint", "restore", "speculative_step", "clear",
           "next_pos", "info")


def _serve() -> int:
    """The worker's loop: (method, args, kwargs) pickles in on stdin, ("ok", value) or ("err",
    (type, message)) out on the original stdout; fd 1 then points at stderr, so nothing llama.cpp
    prints can corrupt the channel."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    oracle = None
    while True:
        try:
            name, args, kwargs = pickle.load(inp)
        except EOFError:
            break
        try:
            if name == "__init__":
                oracle = LlamaOracle(*args, **kwargs)
                value = oracle.info()
            else:
                value = getattr(oracle, name)(*args, **kwargs)
            reply = ("ok", value)
        except Exception as e:
            reply = ("err", (type(e).__name__, str(e)))
        pickle.dump(reply, out)
        out.flush()
    if oracle is not None:
        oracle.close()
    return 0


@dataclass
class Probe:
    ok: bool
    message: str                 # "" when ok; else one line (a load error or the assertion)
    info: dict | None = None     # the context's info() when it loaded


def probe(path, tokens=(1, 2, 3), **params) -> Probe:
    """Load `path` in a worker, decode `tokens` on sequence 0, close: whether llama.cpp can run
    the file at all, without risking this process."""
    try:
        with LlamaOracleProcess(path, **params) as ll:
            info = ll.info()
            ll.decode({0: list(tokens)})
            return Probe(True, "", info)
    except LlamaOracleError as e:
        return Probe(False, str(e))


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        sys.exit(_serve())
    if sys.argv[1:] == ["--check"]:             # whether the extra loads, in a process of its own
        problem = load_problem()
        print(problem or f"llama-cpp-python {VERSION} loads: {lib_dir()}")
        sys.exit(1 if problem else 0)
    if len(sys.argv) == 2:
        p = probe(sys.argv[1])
        print("ok" if p.ok else p.message, p.info or "")
        sys.exit(0 if p.ok else 1)
    print("usage: python -m minigraph.testing.llama_oracle FILE.gguf   (load it and decode 3 tokens)\n"
          "       python -m minigraph.testing.llama_oracle --check      (whether the extra loads)", file=sys.stderr)
    sys.exit(2)
