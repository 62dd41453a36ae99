"""Every example runs (in seconds) and says what it promises."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script,args,expect", [
    ("conv_state_store.py", [], "all slots as predicted"),
    ("new_recurrent_layer.py", [], "equals the no-draft run: True"),
    ("slot_order_placement.py", [], "host-input"),
    ("graph_reuse.py", ["--steps", "12"], "matched a fresh build bit for bit"),
])
def test_example_runs(script, args, expect):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], capture_output=True,
                       text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert expect in p.stdout


def test_placement_example_draws_a_png(tmp_path):
    png = tmp_path / "placement.png"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "slot_order_placement.py"), "--layers", "2",
                        "--png", str(png)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "digraph" in (tmp_path / "placement.dot").read_text()
