"""Whether this process's TCP connection to an endpoint was closed by the other side (Linux).

ggml's RPC client keeps one connection per server and aborts the process on the next call if the
server is gone. The kernel knows earlier: when the server process ends, our side of the
connection goes to CLOSE_WAIT. `ConnectionWatch` finds ggml's socket once (the descriptor of this
process whose /proc/net/tcp{,6} entry goes to the endpoint) and then asks it with one
non-blocking peek per check: end-of-file means the server closed it. Between two RPC calls
nothing is in flight, so a live connection has nothing to read. Elsewhere (no /proc) it answers
False and ggml's own behaviour applies."""
from __future__ import annotations

import os
import socket

_ESTABLISHED, _CLOSE_WAIT = "01", "08"


def _own_socket_inodes() -> dict[str, int]:
    """socket inode -> file descriptor, for this process's sockets."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[target[8:-1]] = int(fd)
    return out


def _hex_endpoint(host: str, port: int) -> set[str]:
    """The forms /proc/net/tcp{,6} write host:port in (IPv4, and IPv4 mapped into IPv6)."""
    forms = set()
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, proto=socket.IPPROTO_TCP)
    except OSError:
        return forms
    for family, *_, addr in infos:
        if family == socket.AF_INET:
            packed = socket.inet_aton(addr[0])
            forms.add(f"{int.from_bytes(packed, 'little'):08X}:{port:04X}")
            forms.add("0000000000000000FFFF0000" + f"{int.from_bytes(packed, 'little'):08X}:{port:04X}")
        elif family == socket.AF_INET6:
            packed = socket.inet_pton(socket.AF_INET6, addr[0])
            words = "".join(f"{int.from_bytes(packed[i:i + 4], 'little'):08X}" for i in range(0, 16, 4))
            forms.add(f"{words}:{port:04X}")
    return forms


def _connections(host: str, port: int) -> list[tuple[str, int]]:
    """(state, fd) of each connection of this process to host:port."""
    inodes = _own_socket_inodes()
    remotes = _hex_endpoint(host, port)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[2] in remotes and cols[9] in inodes:
                found.append((cols[3], inodes[cols[9]]))
    return found


def connection_lost(host: str, port: int) -> bool:
    """True when a connection of this process to host:port exists and none of them is open."""
    states = [state for state, _ in _connections(host, port)]
    return bool(states) and _ESTABLISHED not in states


class ConnectionWatch:
    """Cheap repeated checks of ggml's one connection to host:port (see the module docstring)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.sock = None

    def _find(self):
        open_fds = [fd for state, fd in _connections(self.host, self.port) if state == _ESTABLISHED]
        if len(open_fds) == 1:              # ours (a duplicate shares the one connection)
            self.sock = socket.socket(fileno=os.dup(open_fds[0]))

    def lost(self) -> bool:
        if self.sock is None:
            self._find()
            if self.sock is None:
                return connection_lost(self.host, self.port)
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False                    # open, nothing to read: alive
        except OSError:
            return True                     # reset
        return data == b""
