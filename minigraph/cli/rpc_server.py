"""minigraph rpc-server: serve this machine's CPU to other machines over ggml's RPC protocol
(ggml_backend_rpc_start_server, from the ggml the `llama` extra installs), in the foreground.

A client names it as the device 'ggml:rpc://HOST:PORT' (see README, "More than one machine").
The protocol has no authentication and no encryption: anyone who can reach the port can run
graphs and read or write the server's memory, so the default is the loopback address."""
from __future__ import annotations

import os
import signal
import socket
import sys

from .args import int_at_least
from .errors import fail

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052


def add_parser(sub):
    p = sub.add_parser("rpc-server", help="serve this machine's CPU to other machines (ggml's RPC server)",
                       description="Start ggml's RPC server in the foreground (stop it with Ctrl-C). Clients use it "
                       "as the device ggml:rpc://HOST:PORT, e.g. minigraph run mamba2 --devices "
                       "ggml:rpc://HOST:PORT,cpu. The protocol has no authentication: bind to a "
                       "trusted network only.")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int_at_least(1), default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="CPU threads for the graphs it runs (default: every core)")
    p.set_defaults(fn=cmd_rpc_server)


def _check_free(host: str, port: int) -> None:
    """ggml's server only prints a line when it cannot listen: say which flag to change instead."""
    if port > 65535:
        fail(f"--port {port}: must be <= 65535")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]"), port))
    except OSError as e:
        fail(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})")


def cmd_rpc_server(args):
    from minigraph.backends.ggml import rpc
    from minigraph.backends.ggml.lib import GgmlLoadError, load
    _check_free(args.host, args.port)
    try:
        lib = load()
    except GgmlLoadError as e:
        fail(str(e))
    threads = args.threads or os.cpu_count() or 1
    print(f"minigraph rpc-server: listening on {args.host}:{args.port} (device ggml:rpc://{args.host}:{args.port}), "
          f"{threads} threads, ggml from {lib.dir}", flush=True)
    print("warning: ggml's RPC protocol has no authentication and no encryption: anyone who can reach "
          "this port can use this machine's CPU and memory; listen on a trusted network only", file=sys.stderr, flush=True)
    # ggml's accept loop never returns to Python: let Ctrl-C and SIGTERM end the process directly
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rpc.start_server(lib, args.host, args.port, threads)
    return 1          # the server loop only returns when it could not start
