"""ggml's RPC devices: reachability, and the server.

ggml's RPC client aborts the whole process when it cannot connect, when the server speaks another
protocol version or when a connection breaks, and its connect and handshake have no timeout (a
port where something else listens would hang it). So before a client is created, the endpoint is
probed from Python under a timeout: a TCP connect, then ggml's own HELLO exchange (the command
byte, the request size, the request; the reply's major version must be this client's). A refused,
unreachable, silent or foreign endpoint becomes a one-line error naming the device. Between
steps, a server that stopped is seen from its closed connection (tcp_state.py). A server that
dies in the middle of a call still takes the client process down with ggml's own message; see
the README ("More than one machine")."""
from __future__ import annotations

import socket

from minigraph.errors import OpError

CONNECT_TIMEOUT_S = 3.0
# ggml 0.25's RPC protocol (ggml-rpc.h, transport.h): RPC_CMD_HELLO, its request (connection
# capabilities) and reply (major, minor, patch, padding, capabilities) sizes, the major version
RPC_CMD_HELLO, CAPS_SIZE, PROTO_MAJOR = 14, 24, 7


class _ClosedInHandshake(Exception):
    pass


def _recv_exactly(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise _ClosedInHandshake()
        data += chunk
    return data


def _hello(sock) -> str | None:
    """None when the other side answers ggml's HELLO as this client's protocol; else why not."""
    sock.sendall(bytes([RPC_CMD_HELLO]) + CAPS_SIZE.to_bytes(8, "little") + bytes(CAPS_SIZE))
    size = int.from_bytes(_recv_exactly(sock, 8), "little")
    if size != 4 + CAPS_SIZE:
        return f"it does not answer as a ggml RPC server (reply of {size} bytes)"
    major, minor, patch = _recv_exactly(sock, size)[:3]
    if major != PROTO_MAJOR:
        return f"it speaks ggml RPC protocol {major}.{minor}.{patch}, this client {PROTO_MAJOR}.x"
    return None


def probe(host: str, port: int, device: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise OpError (one line, naming the device) unless a ggml RPC server of this protocol
    answers at host:port within the timeout."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout) as sock:
            why = _hello(sock)
        if why is not None:
            raise OpError(f"device {device}: {host}:{port} is not a usable ggml RPC server: {why}")
    except socket.timeout:
        raise OpError(f"device {device}: no answer from {host}:{port} within {timeout:g} s "
                      f"(is `minigraph rpc-server` running there, and reachable?)") from None
    except _ClosedInHandshake:
        raise OpError(f"device {device}: {host}:{port} closed the connection during ggml's handshake; "
                      f"is it a ggml RPC server (of ggml 0.25)?") from None
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
