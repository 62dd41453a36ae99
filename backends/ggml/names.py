"""The ggml device names: 'ggml:cpu', 'ggml:rpc://HOST:PORT[/N]', or 'ggml:NAME' for any device
the loaded ggml enumerates (its ggml_backend_dev_name, any case: 'ggml:cuda0' in a CUDA build).
Parsing needs no library, so a malformed name fails before anything loads."""
from __future__ import annotations

import re
from dataclasses import dataclass

HELP = "expected 'ggml:cpu', 'ggml:rpc://HOST:PORT', 'ggml:rpc://HOST:PORT/N' or 'ggml:DEVICE'"


@dataclass(frozen=True)
class DeviceName:
    kind: str            # "cpu", "rpc" or "dev" (a device the library enumerates)
    host: str = ""
    port: int = 0
    index: int = 0
    dev: str = ""

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def canonical(self) -> str:
        if self.kind == "cpu":
            return "ggml:cpu"
        if self.kind == "rpc":
            return f"ggml:rpc://{self.endpoint}" + (f"/{self.index}" if self.index else "")
        return f"ggml:{self.dev}"


def parse(rest: str) -> DeviceName:
    """The part after 'ggml:' as a DeviceName, or ValueError (one line) saying what is wrong."""
    full = f"ggml:{rest}"
    text = rest.strip()
    if text.lower() == "cpu":
        return DeviceName("cpu")
    if text.startswith("rpc:"):
        m = re.fullmatch(r"rpc://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):(\d{1,5})(?:/(\d+))?", text)
        if not m:
            raise ValueError(f"bad device name {full!r}: an RPC device is 'ggml:rpc://HOST:PORT' or "
                             f"'ggml:rpc://HOST:PORT/N' (N: the server's device index)")
        port = int(m.group(2))
        if not 0 < port < 65536:
            raise ValueError(f"bad device name {full!r}: port {port} is not in 1..65535")
        return DeviceName("rpc", host=m.group(1), port=port, index=int(m.group(3) or 0))
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_\-]*", text):
        raise ValueError(f"bad device name {full!r}: {HELP}")
    return DeviceName("dev", dev=text.lower())
