"""ggml's meta device (ggml_backend_meta_device, ggml 0.25 from the llama extra) as a second
opinion on minigraph's meta backend: the same graph over two CPU devices, the leaves split alike
(ggml's split-state callback answers minigraph's state for each leaf); every tensor's split state
ggml derives, its all-reduce count and the outputs must equal minigraph's.

Where they differ, on purpose (each a rule of backends/meta/split_state.py):
* a source-less op (ARANGE, which builds each conv layer's slot order in the recurrent layers) is
  MIRRORED in minigraph; this ggml's generic rule finds no source to take a state from and
  aborts (GGML_ASSERT(ret.axis != GGML_BACKEND_SPLIT_AXIS_UNKNOWN) in ggml-backend-meta.cpp), so
  no graph of a recurrent layer can run on ggml's meta device as installed. The test below
  holds that: when a newer ggml runs the layer, it fails, and the full comparison replaces it.

Runs in worker processes (tests/ggml_meta_worker.py): llama.cpp's ggml must not share this
process with the op oracle's libggml-python, and the meta device aborts on what it refuses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minigraph.testing import llama_oracle as lo

pytestmark = pytest.mark.llama
if not lo.installed():
    pytest.skip(f"ggml's meta device comes with ggml 0.25: {lo.not_installed_reason()}", allow_module_level=True)

WORKER = str(Path(__file__).with_name("ggml_meta_worker.py"))


def worker(kind):
    p = subprocess.run([sys.executable, WORKER, kind], capture_output=True, text=True, timeout=300)
    sides = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            sides[d["side"]] = d
    return p, sides


def test_split_states_all_reduces_and_outputs_equal_minigraphs():
    p, sides = worker("mlp")
    assert p.returncode == 0, p.stderr[-2000:]
    mine, ggml = sides["minigraph"], sides["ggml"]
    for tid, axis in mine["states"].items():
        logged = set(ggml["states"][tid])
        # an all-reduced node: PARTIAL is its own state, MIRRORED what its readers see
        want = {"PARTIAL", "MIRRORED"} if axis == "PARTIAL" else {axis}
        assert logged == want, f"{mine['labels'][tid]}: minigraph {axis}, ggml {sorted(logged)}"
    assert "AXIS_1" in mine["states"].values() and "PARTIAL" in mine["states"].values()
    assert ggml["all_reduces"] == mine["all_reduces"] == 1
    assert ggml["outs_compared"] == 1 and ggml["max_rel_err"] <= 1e-5


@pytest.mark.parametrize("kind", ["mamba2", "delta-net"])
def test_a_source_less_op_is_where_ggml_meta_device_stops(kind):
    p, sides = worker(kind)
    mine = sides["minigraph"]
    assert any(r == "ARANGE: source-less -> MIRRORED" for r in mine["rules"].values()), mine["rules"]
    assert "ggml" not in sides and p.returncode != 0
    assert "ggml-backend-meta.cpp" in p.stderr and \
        "GGML_ASSERT(ret.axis != GGML_BACKEND_SPLIT_AXIS_UNKNOWN) failed" in p.stderr
