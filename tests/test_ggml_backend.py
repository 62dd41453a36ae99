"""The ggml backend (backends/ggml): whole models on real ggml 0.25 (the one llama.cpp installs),
on `ggml:cpu` and across two `minigraph rpc-server` processes on loopback ports, against
minigraph's cpu backend.

llama.cpp's ggml and the op oracle's libggml-python export the same symbols and must not share a
process, so everything that loads the ggml backend runs in a worker process (tests/ggml_worker.py,
or `minigraph ...` commands); this process never loads it. Not installed: the module skips,
saying how to install it. Installed but not loading: tests/conftest.py stops the run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minigraph.testing import llama_oracle as lo

from rpc_servers import free_port, servers

pytestmark = pytest.mark.llama
if not lo.installed():
    pytest.skip(f"the ggml backend needs ggml 0.25 with RPC: {lo.not_installed_reason()}", allow_module_level=True)

WORKER = str(Path(__file__).with_name("ggml_worker.py"))
MODELS = ["mamba2", "delta-net", "lfm", "kda", "delta-net-hybrid"]
BOUND = 1e-5          # relative: max |ggml - cpu| / max |cpu| over every logit of the scenario


def worker(*args, timeout=600, stdin=None):
    p = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True, timeout=timeout, input=stdin)
    assert p.returncode == 0, f"worker {args} failed ({p.returncode}): {p.stderr[-2000:]}"
    return p


def logits(tmp_path, model, *specs) -> dict:
    out = tmp_path / "logits.npz"
    worker("logits", model, str(out), *specs)
    return dict(np.load(out))


def rel_err(got, want) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / max(float(np.max(np.abs(want))), 1e-30))


def minigraph_cmd(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "minigraph", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def one_line_error(p) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


@pytest.mark.parametrize("model", MODELS)
def test_model_on_ggml_cpu_equals_cpu(tmp_path, model):
    z = logits(tmp_path, model, "cpu", "ggml:cpu", "ggml:cpu,cpu")
    assert z["cpu"].shape[0] > 20
    assert rel_err(z["ggml:cpu"], z["cpu"]) <= BOUND
    assert rel_err(z["ggml:cpu,cpu"], z["cpu"]) <= BOUND      # layers split between ggml and minigraph
    builds, reuses, ggml_built = z["ggml:cpu#stats"]
    assert reuses > 0, "the scenario must reuse graphs"
    assert ggml_built == builds, "a reused minigraph graph must reuse its ggml graph (built once per build)"


@pytest.fixture(scope="module")
def two_servers():
    with servers(2) as s:
        yield s


def test_rpc_server_says_where_it_listens_and_warns(two_servers):
    s = two_servers[0]
    assert f"listening on {s.endpoint}" in s.banner and s.device in s.banner
    assert "no authentication" in s.warning


@pytest.mark.parametrize("model", MODELS)
def test_model_across_two_rpc_servers_equals_cpu(tmp_path, two_servers, model):
    spec = ",".join(s.device for s in two_servers) + ",cpu"
    z = logits(tmp_path, model, "cpu", spec)
    assert rel_err(z[spec], z["cpu"]) <= BOUND


def test_cli_run_spreads_layers_over_two_servers(two_servers):
    spec = ",".join(s.device for s in two_servers) + ",cpu"
    p = minigraph_cmd("run", "mamba2", "--layers", "4", "--devices", spec, "--steps", "2", "--threads", "1")
    assert p.returncode == 0, p.stderr
    assert "state check         pass" in p.stdout


def test_a_killed_server_is_a_one_line_error_and_the_client_memory_is_kept():
    with servers(2) as (a, b):
        spec = f"{a.device},{b.device},cpu"
        proc = subprocess.Popen([sys.executable, WORKER, "kill", "mamba2", spec], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
            b.stop()                                   # killed between two steps
            out, err = proc.communicate("GO\n", timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lines = out.strip().splitlines()
        assert lines[0].startswith("ERROR OpError: device ") and b.device in lines[0], (out, err)
        assert "closed the connection" in lines[0]
        assert lines[1] == "STATE SAME"


# -- bad input: one line, naming the device or op -------------------------------------------------
def test_refused_endpoint_is_a_one_line_error_at_creation():
    port = free_port()
    p = minigraph_cmd("run", "mamba2", "--devices", f"ggml:rpc://127.0.0.1:{port},cpu")
    assert p.returncode == 2
    line = one_line_error(p)
    assert f"ggml:rpc://127.0.0.1:{port}" in line and "cannot connect" in line


def test_a_silent_or_foreign_endpoint_is_a_one_line_error_not_a_hang():
    """Something listens but is no ggml RPC server: ggml's own connect and handshake would hang
    or abort; the probe's HELLO under a timeout reports it."""
    import socket
    import threading
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)                       # accepts (in the backlog), never answers
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen(4)

    def answer_http():
        conn, _ = foreign.accept()
        with conn:
            conn.recv(64)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    threading.Thread(target=answer_http, daemon=True).start()
    try:
        for sock, words in ((silent, "no answer from"), (foreign, "not a usable ggml RPC server")):
            port = sock.getsockname()[1]
            p = minigraph_cmd("run", "mamba2", "--devices", f"ggml:rpc://127.0.0.1:{port},cpu", timeout=60)
            assert p.returncode == 2
            line = one_line_error(p)
            assert f"ggml:rpc://127.0.0.1:{port}" in line and words in line, line
    finally:
        silent.close()
        foreign.close()


@pytest.mark.parametrize("name, words", [("ggml:rpc://nohostport", "ggml:rpc://HOST:PORT"),
                                         ("ggml:rpc://127.0.0.1:99999", "port 99999"),
                                         ("ggml:no such", "bad device name"),
                                         ("ggml:vulkan7", "unknown device 'ggml:vulkan7'")])
def test_malformed_ggml_names_are_one_line_errors(name, words):
    p = minigraph_cmd("run", "mamba2", "--devices", f"{name},cpu")
    assert p.returncode == 2
    assert words in one_line_error(p)


def test_a_libggml_without_the_needed_libraries_or_symbols_is_a_one_line_error(tmp_path):
    p = minigraph_cmd("run", "mamba2", "--devices", "ggml:cpu", env={"MINIGRAPH_LIBGGML": str(tmp_path)})
    assert p.returncode == 2
    assert "has no libggml-base.so" in one_line_error(p)
    # the op oracle's ggml 0.20: no RPC library
    import importlib.util
    oracle_dir = Path(list(importlib.util.find_spec("libggml").submodule_search_locations)[0]) / "lib64"
    p = minigraph_cmd("run", "mamba2", "--devices", "ggml:cpu", env={"MINIGRAPH_LIBGGML": str(oracle_dir)})
    assert p.returncode == 2
    assert "libggml-rpc" in one_line_error(p)


_SNIPPET = """
import numpy as np, minigraph as mg
{setup}
be = mg.backend("ggml:cpu")
ctx = mg.Context()
a = ctx.new_tensor_2d(mg.f32, 8, 3)
mg.alloc_ctx_tensors(ctx, be, "any")
a.set(np.arange(24, dtype=np.float32).reshape(3, 8))
gf = mg.Graph(); gf.build_forward_expand(mg.add(a, a))
try:
    be.graph_compute(gf)
    print("computed")
except mg.OpError as e:
    print("OpError:", e)
"""


def test_an_op_ggml_lacks_is_a_one_line_error_naming_op_and_device():
    setup = ("from minigraph.registry import OPS, NotInGgml\n"
             "OPS['ADD'].ggml = NotInGgml('made up for this test')")
    p = subprocess.run([sys.executable, "-c", _SNIPPET.format(setup=setup)], capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith("OpError: ADD ") and "ggml:cpu" in p.stdout and "made up for this test" in p.stdout, p


def test_the_op_oracle_and_the_ggml_backend_refuse_to_share_a_process():
    p = subprocess.run([sys.executable, "-c", _SNIPPET.format(setup="import minigraph.testing.ggml_oracle")],
                       capture_output=True, text=True, timeout=120)
    assert "another ggml is already loaded in this process" in p.stdout + p.stderr, p


def test_the_op_table_runs_on_ggml_cpu():
    """Every op case (random shapes, strided and permuted views; minigraph.testing.op_cases)
    through the ggml backend against the NumPy reference: the lowering on ggml 0.25."""
    import json
    p = minigraph_cmd("check", "--backends", "ref,ggml:cpu", "--seeds", "2", "--json", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    out = json.loads(p.stdout)
    assert out["cases"] > 100 and out["columns"] == ["ref", "ggml:cpu"]
    assert out["failed"] == 0 and out["not_run"] == {}
