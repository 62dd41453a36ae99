"""The `minigraph` command, run as a subprocess: every subcommand's happy path, --json that
parses and agrees with the API, and error paths that exit non-zero with one clear line."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# run the command with one module made unimportable, as on a machine without it
BLOCKED_RUN = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            raise ImportError(f"pretend {name} is missing")

sys.meta_path.insert(0, Block())
from minigraph.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def cli(*args, expect=0, block=None):
    cmd = ["-c", BLOCKED_RUN, block] if block else ["-m", "minigraph.cli"]
    p = subprocess.run([sys.executable, *cmd, *args], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == expect, f"exit {p.returncode}\nstdout:{p.stdout}\nstderr:{p.stderr}"
    return p


def test_run_json_and_state_check():
    d = json.loads(cli("run", "toy", "--steps", "8", "--threads", "1", "--json").stdout)
    for k in ("tokens_per_s", "builds", "reuses", "copies_per_step", "copy_bytes_per_step",
              "rollbacks", "rollbacks_refused", "state_check"):
        assert k in d
    assert d["state_check"] == "pass" and d["rollbacks"] > 0 and d["rollbacks_refused"] == 0
    assert d["copies_per_step"] == 0       # one device


def test_run_two_devices_text():
    out = cli("run", "toy", "--devices", "cpu:1,cpu:0", "--layers", "4", "--steps", "6",
              "--slot-order", "host-input").stdout
    assert "state check         pass" in out and "cross-device copies" in out


def test_placement_compare_agrees_with_the_api():
    d = json.loads(cli("placement", "toy", "--devices", "cpu:1,cpu:0", "--layers", "4", "--compare", "--json").stdout)
    s = d["strategies"]
    assert s["per-layer"]["slot_order_copies"] == 0
    assert s["shared-first-layer"]["slot_order_copies"] == 2    # one per conv layer on cpu:0
    assert s["host-input"]["slot_order_copies"] == 1            # one per other device
    # the per-layer view agrees: a layer whose store reads a slot order from another device says so
    for strategy, v in s.items():
        copied = [l for l in v["layers"] if l["copied"]]
        assert all(l["order_device"] != l["store_device"] for l in copied)
        assert bool(copied) == (v["slot_order_copies"] > 0), strategy
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import minigraph as mg
    from slot_order_placement import schedule_one_ubatch
    from minigraph.models.zoo import make_model
    devices = [mg.backend("cpu:1"), mg.backend("cpu:0")]
    model = make_model("toy", devices, n_layer=4)
    for strategy, v in s.items():
        rep = schedule_one_ubatch(model, devices, strategy).sched.placement_report()
        assert (rep.n_copies, rep.copy_bytes) == (v["copies"], v["copy_bytes"])


def test_placement_text_and_dot(tmp_path):
    dot = tmp_path / "g.dot"
    out = cli("placement", "toy", "--devices", "cpu:1,cpu:0", "--layers", "2", "--dot", str(dot)).stdout
    assert "cache_r_l0" in out and "## SPLIT #0" in out
    assert "digraph" in dot.read_text()


def test_reuse_json():
    d = json.loads(cli("reuse", "toy", "--steps", "15", "--threads", "1", "--json").stdout)
    assert d["validator"] == "pass"
    assert d["reuses"] > 0 and d["builds"] < 16
    assert d["host_ms_per_step_reuse"] >= 0 and d["host_ms_per_step_rebuild"] > 0


def test_check_json():
    d = json.loads(cli("check", "--seeds", "1", "--json").stdout)
    assert d["failed"] == 0 and "cpu:0" in d["columns"] and "ggml" in d["columns"]
    # every default column either ran or says why not (cuda:0 without a GPU)
    assert set(d["columns"]) | set(d["not_run"]) == {"ref", "cpu:0", "cuda:0", "ggml"}
    assert all(why.strip() for why in d["not_run"].values())


def test_check_lists_the_oracle_it_could_not_run():
    p = cli("check", "--seeds", "1", "--backends", "ref,cpu,ggml", block="libggml", expect=1)
    assert re.search(r"\d+ cases x 2 columns, 0 failed, 1 not run", p.stdout), p.stdout
    assert "not run: ggml: ImportError: pretend libggml is missing" in p.stdout, p.stdout
    assert p.stderr.strip() == "minigraph: error: could not run ggml (asked for with --backends)"


def test_check_without_backends_named_lists_what_it_skips_and_passes():
    d = json.loads(cli("check", "--seeds", "1", "--json", block="libggml").stdout)
    assert "ggml" not in d["columns"] and "pretend libggml is missing" in d["not_run"]["ggml"]
    assert d["failed"] == 0


def test_check_fails_when_the_cpu_extension_asked_for_does_not_load():
    p = cli("check", "--seeds", "1", "--backends", "ref,cpu", block="minigraph.backends.cpu._kernels", expect=1)
    assert "not run: cpu: RuntimeError: the CPU backend's C extension" in p.stdout, p.stdout
    assert "could not run cpu" in p.stderr


def test_bench_reuse_quick():
    out = cli("bench", "--quick", "--only", "reuse").stdout
    assert "host time per step, rebuild/reuse:" in out


@pytest.mark.parametrize("args,code,msg", [
    (("run", "nope"), 2, "unknown model 'nope'"),
    (("run", "toy", "--devices", "tpu:0"), 2, "bad device 'tpu:0'"),
    (("run", "toy", "--n-rs-seq", "1", "--draft", "3", "--steps", "5"), 1, "rollback of"),
    (("placement", "toy", "--devices", "cpu:0,cpu:0"), 2, "listed twice"),
])
def test_errors_are_one_line_and_non_zero(args, code, msg):
    p = cli(*args, expect=code)
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and msg in err[0] and "Traceback" not in p.stderr
