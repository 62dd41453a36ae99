"""The ggml backend: minigraph graphs run by a real ggml (0.25, the one llama.cpp installs) on
ggml's own devices: 'ggml:cpu', 'ggml:rpc://HOST:PORT[/N]' (a `minigraph rpc-server` on another
machine, or on this one) and any other device the loaded library enumerates ('ggml:cuda0' in a
user's CUDA build; MINIGRAPH_LIBGGML points at that build).

Leaves, caches and the planned intermediates live in ggml backend buffers (memory.py); each node
list a compute hands over (a whole graph, or one split of minigraph's scheduler) is lowered once
to a ggml graph by the ops' own ggml translations and run with ggml_backend_graph_compute
(graph.py). Importing this module loads nothing: the library is loaded by the first ggml device
asked for (lib.py), and refused if the op oracle's ggml 0.20 is already in the process."""
from __future__ import annotations

import numpy as np

from minigraph.alloc import allocation_error, check_host_allocation
from minigraph.backend import Backend, Buffer, host_view, register_backend
from minigraph.errors import OpError
from minigraph.registry import OPS

from . import names, rpc
from .graph import cached_graph
from .lib import GgmlLoadError, load
from .memory import GgmlMemory
from .tcp_state import ConnectionWatch

_DEVICES: dict = {}


class GgmlBackend(Backend):
    """One ggml device (a ggml_backend_t)."""

    def __init__(self, dev: names.DeviceName):
        self.lib = lib = load()
        ffi = lib.ffi
        self.device = dev
        self.name = dev.canonical
        if dev.kind == "cpu":
            handle = lib.ggml_backend_cpu_init()
        elif dev.kind == "rpc":
            rpc.probe(dev.host, dev.port, self.name)
            handle = lib.ggml_backend_rpc_init(dev.endpoint.encode(), dev.index)
        else:
            handle = self._init_enumerated(dev.dev)
        if handle == ffi.NULL:
            raise OpError(f"device {self.name}: ggml could not initialize it")
        self.handle = handle
        self.watch = ConnectionWatch(dev.host, dev.port) if dev.kind == "rpc" else None
        self.graphs_built = 0
        self.own_graphs: dict = {}

    def _init_enumerated(self, wanted: str):
        lib, ffi = self.lib, self.lib.ffi
        found = []
        for i in range(lib.ggml_backend_dev_count()):
            d = lib.ggml_backend_dev_get(i)
            name = ffi.string(lib.ggml_backend_dev_name(d)).decode()
            found.append(name.lower())
            if name.lower() == wanted:
                return lib.ggml_backend_dev_init(d, ffi.NULL)
        raise ValueError(f"unknown device 'ggml:{wanted}': the ggml in {lib.dir} offers "
                         f"{', '.join('ggml:' + n for n in found) or 'no device'} "
                         f"(and ggml:rpc://HOST:PORT for an RPC server)")

    def set_n_threads(self, n: int) -> "GgmlBackend":
        """Threads of ggml:cpu. Other devices keep theirs (an RPC server's are its --threads)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n_threads must be a positive integer, got {n!r}")
        if self.device.kind == "cpu":
            self.lib.ggml_backend_cpu_set_n_threads(self.handle, n)
        return self

    # -- liveness ---------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.watch is None or not self.watch.lost()

    def check_alive(self):
        """Before touching an RPC device: a connection the server closed (it stopped or was killed)
        is a one-line error here, instead of an abort inside ggml's client."""
        if not self.alive():
            raise OpError(f"device {self.name}: the RPC server closed the connection (it stopped or was killed)")

    # -- memory -----------------------------------------------------------------------------
    def alloc_buffer(self, nbytes: int, usage: str, tensors=()) -> Buffer:
        self.check_alive()
        if self.device.kind == "cpu":       # this machine's memory: refuse before malloc grants it lazily
            check_host_allocation(nbytes, self.name, tensors)
        try:
            mem = GgmlMemory(self.lib, self.handle, nbytes, usage, alive=self.alive)
        except MemoryError:
            raise allocation_error(nbytes, self.name, tensors) from None
        return Buffer(self, nbytes, usage, mem)

    def get_bytes(self, buf: Buffer, offs: int, n: int) -> np.ndarray:
        self.check_alive()
        return np.frombuffer(buf.mem.get(offs, n), np.uint8).copy()

    def set_bytes(self, buf: Buffer, offs: int, data: np.ndarray):
        self.check_alive()
        buf.mem.set(offs, np.ascontiguousarray(data, np.uint8))

    def _span(self, t):
        """(buffer, first byte, byte count) of t's strided extent."""
        buf, offs = t.storage()
        return buf, offs, t.nbytes()

    def write_tensor(self, t, array: np.ndarray):
        if 0 in t.ne:
            return
        buf, offs, n = self._span(t)
        if t.is_contiguous():
            self.set_bytes(buf, offs, np.ascontiguousarray(array, t.type.np_dtype).reshape(-1).view(np.uint8))
            return
        span = self.get_bytes(buf, offs, n)        # a strided view: merge into the bytes around it
        np.copyto(host_view(span, 0, t), array)
        self.set_bytes(buf, offs, span)

    def read_tensor(self, t) -> np.ndarray:
        if 0 in t.ne:
            return np.zeros(tuple(reversed(t.ne)), t.type.np_dtype)
        buf, offs, n = self._span(t)
        return host_view(self.get_bytes(buf, offs, n), 0, t).copy()

    def fill_guards(self, buf: Buffer, plan):
        buf.mem.clear(0xA5)

    # -- compute ----------------------------------------------------------------------------
    def supports_op(self, node) -> bool:
        # every registered op: one without a ggml translation is refused when its graph is built,
        # with the reason, rather than moved to another device behind the user's back
        return node.op in OPS

    def compute_nodes(self, nodes, cache=None):
        # an op without a ggml translation is a one-line error when the graph is built (graph.py)
        self.check_alive()
        cached_graph(self, nodes, cache).compute()

    def __repr__(self):
        return f"<backend {self.name}>"


def _factory(rest: str) -> GgmlBackend:
    dev = names.parse(rest)
    be = _DEVICES.get(dev.canonical)
    if be is None:
        try:
            be = _DEVICES[dev.canonical] = GgmlBackend(dev)
        except GgmlLoadError as e:
            raise OpError(f"device {dev.canonical}: {e}") from None
    return be


def _by_index(idx: int) -> GgmlBackend:
    """'ggml' is ggml:cpu; 'ggml:N' the N-th device the loaded library enumerates."""
    if idx == 0:
        return _factory("cpu")
    try:
        lib = load()
    except GgmlLoadError as e:
        raise OpError(f"device ggml:{idx}: {e}") from None
    n = lib.ggml_backend_dev_count()
    if idx >= n:
        raise ValueError(f"unknown device 'ggml:{idx}': the ggml in {lib.dir} enumerates {n} device(s)")
    return _factory(lib.ffi.string(lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(idx))).decode())


register_backend("ggml", _factory, named=True)
register_backend("ggml", _by_index)

__all__ = ["GgmlBackend", "GgmlLoadError"]
