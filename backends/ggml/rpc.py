"""ggml's RPC devices: reachability, and the server.

ggml's RPC client aborts the whole process when it cannot connect or when a connection breaks
(its connect has no timeout either), so before a client is created, and before each step that
touches an RPC device, the endpoint is probed with a plain TCP connect under a timeout: a refused,
unreachable or silent endpoint becomes a one-line error naming the device instead of an abort.
A server that dies in the middle of a call still takes the client process down with ggml's own
message; see the README ("More than one machine")."""
from __future__ import annotations

import socket

from minigraph.errors import OpError

CONNECT_TIMEOUT_S = 3.0


def probe(host: str, port: int, device: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise OpError (one line, naming the device) unless something accepts TCP at host:port."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout):
            pass
    except socket.timeout:
        raise OpError(f"device {device}: no answer from {host}:{port} within {timeout:g} s "
                      f"(is `minigraph rpc-server` running there, and reachable?)") from None
    except OSError as e:
        raise OpError(f"device {device}: cannot connect to {host}:{port} ({e.strerror or e}); start one with "
                      f"`minigraph rpc-server --host {host} --port {port}`") from None


def start_server(lib, host: str, port: int, n_threads: int, cache_dir: str | None = None) -> None:
    """Serve this machine's CPU over ggml's RPC protocol at host:port, in the foreground (returns
    only when ggml's server loop does)."""
    ffi = lib.ffi
    cpu = next((lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())
                if lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) == 0), None)
    if cpu is None:
        raise OpError("the loaded ggml enumerates no CPU device to serve")
    devices = ffi.new("ggml_backend_dev_t[1]", [cpu])
    endpoint = f"{host}:{port}".encode()
    cache = ffi.new("char[]", cache_dir.encode()) if cache_dir else ffi.NULL
    lib.ggml_backend_rpc_start_server(endpoint, cache, n_threads, 1, devices)
