"""Whether this process's TCP connection to an endpoint was closed by the other side (Linux).

ggml's RPC client keeps one connection per server and aborts the process on the next call if the
server is gone. The kernel knows earlier: when the server process ends, our side of the
connection goes to CLOSE_WAIT. This reads that state from /proc/net/tcp{,6} for the sockets this
process owns (its /proc/self/fd links), so a dead server is reported before any call is made.
Elsewhere (no /proc) it answers False and ggml's own behaviour applies."""
from __future__ import annotations

import os
import socket

_ESTABLISHED, _CLOSE_WAIT = "01", "08"


def _own_socket_inodes() -> set[str]:
    out = set()
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
            out.add(target[8:-1])
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


def connection_lost(host: str, port: int) -> bool:
    """True when a connection of this process to host:port exists and none of them is open."""
    inodes = _own_socket_inodes()
    remotes = _hex_endpoint(host, port)
    states = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[2] in remotes and cols[9] in inodes:
                states.append(cols[3])
    return bool(states) and _ESTABLISHED not in states
