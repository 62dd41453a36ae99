"""`minigraph placement --compare-ggml`: ggml's own scheduler (ggml_backend_sched in ggml 0.25)
places the same graph over the same devices, and must agree with minigraph node by node, in its
split count and in its copies, for every model, slot-order strategy and device list of the grid.

Device lists: two RPC servers on loopback ports and ggml:cpu (three devices), and one server and
ggml:cpu (two). ggml's scheduler places by the buffer a tensor lives in, and its CPU backends all
share one buffer type, so two ggml CPU devices cannot be told apart by it (and the library
enumerates one CPU device): RPC servers are the two real devices of the grid.

Runs `minigraph` in processes of their own (llama.cpp's ggml must not share this process with
the op oracle's libggml-python)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from minigraph.testing import llama_oracle as lo

from rpc_servers import servers

pytestmark = pytest.mark.llama
if not lo.installed():
    pytest.skip(f"ggml's scheduler comes with ggml 0.25: {lo.not_installed_reason()}", allow_module_level=True)

MODELS = ["mamba2", "delta-net", "lfm", "kda", "delta-net-hybrid"]
SUMMARY = re.compile(r"ggml_backend_sched over .*: (\d+) nodes, (\d+) placed differently; "
                     r"splits minigraph (\d+) / ggml (\d+); copies minigraph (\d+) / ggml (\d+)")


@pytest.fixture(scope="module")
def two_servers():
    with servers(2) as s:
        yield s


def placement(*args, code=None):
    p = subprocess.run([sys.executable, "-m", "minigraph", "placement", *args], capture_output=True, text=True,
                       timeout=600, **({"input": code} if code else {}))
    return p


def summaries(out: str) -> list:
    return [tuple(int(x) for x in m.groups()) for m in SUMMARY.finditer(out)]


@pytest.mark.parametrize("n_servers", [2, 1])
@pytest.mark.parametrize("model", MODELS)
def test_ggml_scheduler_agrees_with_minigraph(two_servers, model, n_servers):
    devices = ",".join(s.device for s in two_servers[:n_servers]) + ",ggml:cpu"
    p = placement(model, "--layers", "4", "--devices", devices, "--compare", "--compare-ggml")
    assert p.returncode == 0, p.stderr
    got = summaries(p.stdout)
    assert len(got) == 3, p.stdout            # one per slot-order strategy
    for n_nodes, n_diff, splits_mg, splits_ggml, copies_mg, copies_ggml in got:
        assert n_nodes > 100
        assert n_diff == 0, p.stdout
        assert splits_mg == splits_ggml > 1
        assert copies_mg == copies_ggml > 0


_WEIGHTS_AS_ANY = """
import sys
from minigraph.backends.ggml import memory
memory.USAGE["weights"] = memory.USAGE["any"]   # ggml no longer sees weights as weights
from minigraph.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_difference_is_listed_node_by_node_with_minigraphs_cause(two_servers):
    """The comparison can fail: with weights in buffers ggml does not know as weights, ggml's
    scheduler places the weight-reading ops by other rules, and each such node is listed."""
    devices = f"{two_servers[0].device},{two_servers[1].device},ggml:cpu"
    p = subprocess.run([sys.executable, "-c", _WEIGHTS_AS_ANY, "placement", "mamba2", "--layers", "4",
                        "--devices", devices, "--compare-ggml"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    (n_nodes, n_diff, *_), = summaries(p.stdout)
    assert n_diff > 0
    listed = [line for line in p.stdout.splitlines() if re.search(r"minigraph ggml:\S+ \(1\.wgt\d\)\s+ggml ", line)]
    assert listed, p.stdout


@pytest.mark.parametrize("devices, words", [("cpu", "every device must be a ggml device"),
                                            ("ggml:cpu,cpu", "every device must be a ggml device")])
def test_devices_ggml_cannot_schedule_are_one_line_errors(devices, words):
    p = placement("mamba2", "--devices", devices, "--compare-ggml")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], p.stderr


def test_the_last_device_must_be_ggml_cpu(two_servers):
    p = placement("mamba2", "--devices", f"ggml:cpu,{two_servers[0].device}", "--compare-ggml")
    assert p.returncode == 2
    assert "end it with ggml:cpu" in p.stderr.strip().splitlines()[-1]
