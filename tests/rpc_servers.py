"""Start `minigraph rpc-server` processes on free loopback ports for a test, and always stop them."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int):
        self.port = port
        self.endpoint = f"127.0.0.1:{port}"
        self.device = f"ggml:rpc://{self.endpoint}"
        self.proc = subprocess.Popen([sys.executable, "-m", "minigraph", "rpc-server", "--port", str(port),
                                      "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.banner = self.proc.stdout.readline()       # printed before ggml takes over
        self.warning = self.proc.stderr.readline()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:                                     # listening once ggml's loop has started
            if self.proc.poll() is not None:
                raise RuntimeError(f"rpc-server on port {port} exited with {self.proc.returncode}: "
                                   f"{self.banner} {self.warning} {self.proc.stderr.read()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"rpc-server on port {port} did not listen within {START_TIMEOUT_S} s")
            time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


@contextlib.contextmanager
def servers(n: int):
    """n running servers; every one is stopped on the way out, whatever happened."""
    started = []
    try:
        for _ in range(n):
            started.append(Server(free_port()))
        yield started
    finally:
        for s in started:
            s.stop()
