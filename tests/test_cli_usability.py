"""The command line as its users meet it (issue 15): every input checked up front (one line,
exit status 2), --gguf that takes the model from the file, a memory estimate before allocating,
one table of environment variables, quiet ends on a closed pipe and Ctrl-C, transfers that count
meta all-reduces, reasons for every rebuild and copy, and --json that a schema describes."""
import json
import os
import signal
import subprocess
import sys
import time

import jsonschema
import numpy as np
import pytest

import minigraph as mg
from minigraph import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, expect=0, env_extra=None, module="minigraph.cli"):
    p = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}, timeout=300)
    assert p.returncode == expect, f"exit {p.returncode}\nstdout:{p.stdout}\nstderr:{p.stderr}"
    return p


def one_line_error(p, *fragments):
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr
    for f in fragments:
        assert f in err[0], err[0]
    return err[0]


def schema_check(d):
    from minigraph.cli.output import load_schema
    jsonschema.validate(d, load_schema())
    return d


def json_out(*args, expect=0):
    p = cli(*args, "--json", expect=expect)
    # allow_nan=False on the way out; a strict parse on the way in
    d = json.loads(p.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    return schema_check(d)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    from minigraph.models.gguf_io import save_gguf
    from minigraph.models.kda import KDAModel
    from minigraph.models.lfm import LFM2Model
    d = tmp_path_factory.mktemp("gguf")
    cpu = mg.backend("ref")
    return {"lfm": str(save_gguf(LFM2Model(devices=cpu), d / "lfm.gguf")),
            "kda": str(save_gguf(KDAModel(devices=cpu), d / "kda.gguf"))}


# -- 1. --gguf takes the model from the file ---------------------------------------------------
def test_gguf_names_the_files_model_and_needs_no_model_name(gguf_files):
    d = json_out("run", "--gguf", gguf_files["lfm"], "--steps", "2", "--threads", "1")
    assert d["model"] == "lfm" and d["gguf"] == gguf_files["lfm"] and d["state_check"] == "pass"
    out = cli("run", "kda", "--gguf", gguf_files["kda"], "--steps", "1", "--threads", "1").stdout
    assert out.startswith("kda on cpu:0")


@pytest.mark.parametrize("args,fragment", [
    (("run", "nosuchmodel", "--gguf", "{lfm}"), "unknown model 'nosuchmodel'"),
    (("run", "mamba2", "--gguf", "{kda}"), "holds a kda model"),
    (("run", "--gguf", "{lfm}", "--layers", "3"), "--layers: not allowed with --gguf"),
    (("run", "--gguf", "{lfm}", "--seed", "1"), "--seed: not allowed with --gguf"),
    (("run",), "MODEL is missing"),
])
def test_gguf_conflicts_are_usage_errors(gguf_files, args, fragment):
    one_line_error(cli(*[a.format(**gguf_files) for a in args], expect=2), fragment)


def test_gguf_file_is_loaded_once(gguf_files, monkeypatch):
    from minigraph.models import gguf_io, zoo
    calls = []
    real = gguf_io.load_gguf
    monkeypatch.setattr(gguf_io, "load_gguf", lambda *a, **k: calls.append(a) or real(*a, **k))
    model = zoo.make_model(None, [mg.backend("ref")], gguf=gguf_files["lfm"])
    assert len(calls) == 1 and model.arch == "lfm2"


# -- 2. reuse with a validator mismatch ---------------------------------------------------------
def test_reuse_reports_a_mismatch_instead_of_crashing(monkeypatch, capsys):
    """The validator finds a difference on the 3rd reused step: the command reports it and exits
    1 (it used to crash with AttributeError: the runner drops its graph after a mismatch)."""
    from minigraph.cli import main
    from minigraph.models.runner import ReuseMismatch, Runner
    real, seen = Runner._validate, []

    def validate_then_fail(self, *a):
        real(self, *a)
        seen.append(1)
        if len(seen) == 3:
            raise ReuseMismatch("graph reuse: logits differs from a fresh build (injected)")
    monkeypatch.setattr(Runner, "_validate", validate_then_fail)
    rc = main(["reuse", "toy", "--steps", "8", "--threads", "1", "--json"])
    d = schema_check(json.loads(capsys.readouterr().out))
    assert rc == 1 and d["validator"] == "fail"
    assert d["first_difference"] == "graph reuse: logits differs from a fresh build (injected)"
    assert d["modes"]["validated"]["decode_calls_done"] < d["decode_calls"]


# -- 3. memory is estimated before allocating --------------------------------------------------
def test_a_run_too_big_for_the_machine_is_refused_with_the_figure():
    p = cli("run", "delta-net", "--n-rs-seq", "1000000", "--steps", "2", expect=2)
    line = one_line_error(p, "GiB", "recurrent state")
    assert "--n-rs-seq" in line


@pytest.mark.parametrize("args", [("run", "toy", "--max-memory", "10K"),
                                  ("reuse", "toy", "--layers", "50", "--max-memory", "64K"),
                                  ("placement", "toy", "--n-rs-seq", "200", "--max-memory", "100K")])
def test_max_memory_refuses_runs_above_it(args):
    one_line_error(cli(*args, expect=2), "more than --max-memory")


def test_max_memory_big_enough_runs():
    assert json_out("run", "toy", "--steps", "2", "--max-memory", "1G")["state_check"] == "pass"


def test_memory_estimate_scales_with_the_flags():
    from minigraph.cli.memory import estimate
    from minigraph.models.zoo import model_class
    cls = model_class("delta-net")
    make = lambda dev, n: cls(devices=dev, n_layer=n)
    a, b = estimate(make, 2, 3, 8, 1), estimate(make, 4, 7, 8, 1)
    assert b.state == a.state * 4 and b.weights > a.weights


# -- 4. every input checked up front -----------------------------------------------------------
@pytest.mark.parametrize("args,fragments", [
    (("run", "toy", "--steps", "-5"), ["--steps", ">= 0"]),
    (("reuse", "toy", "--steps", "0"), ["--steps", ">= 1"]),
    (("reuse", "mamba2", "--ubatch", "1"), ["--ubatch 1", ">= --n-rs-seq + 2 = 5"]),
    (("run", "toy", "--devices", "meta(cpu:0"), ["'meta(cpu:0'", "never closed"]),
    (("run", "toy", "--devices", "cpu:0)"), ["without its '('"]),
    (("run", "toy", "--devices", ","), ["no device named"]),
    (("run", "delta-net", "--layers", "-1"), ["--layers", ">= 1"]),
    (("run", "delta-net", "--layers", "1", "--devices", "cpu:1,cpu:0"), ["--layers 1", "2 devices"]),
    (("run", "toy", "--max-memory", "lots"), ["--max-memory", "512M"]),
    (("placement", "toy", "--focus", "conv-store"), ["--focus", "--dot or --png"]),
    (("placement", "toy", "--dot", "g.dot", "--focus", "(["), ["--focus", "regular expression"]),
    (("placement", "toy", "--png", "x.svg"), ["--png", ".png"]),
])
def test_bad_input_is_one_line_and_exit_2(args, fragments):
    line = one_line_error(cli(*args, expect=2), *fragments)
    assert "qwen35" not in line          # the internal arch name is not what the user typed


def test_default_ubatch_follows_n_rs_seq():
    d = json_out("run", "toy", "--n-rs-seq", "9", "--draft", "2", "--steps", "2")
    assert d["ubatch"] == 11 and d["n_rs_seq"] == 9


# -- 5. files, pipes, Ctrl-C, environment ------------------------------------------------------
def test_png_into_a_missing_folder_names_the_png():
    one_line_error(cli("placement", "toy", "--png", "/nonexistent/x.png", expect=2), "/nonexistent/x.png")


def test_png_says_it_wrote_the_dot_beside_it(tmp_path):
    png = tmp_path / "g.png"
    out = cli("placement", "toy", "--png", str(png)).stdout
    assert f"wrote {tmp_path / 'g.dot'}" in out and f"wrote {png}" in out and png.exists()


def test_closed_pipe_is_quiet():
    p = subprocess.Popen([sys.executable, "-m", "minigraph.cli", "placement", "toy", "--verbose"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    p.stdout.readline()
    p.stdout.close()                      # like `| head -1`
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "BrokenPipe" not in err and "Traceback" not in err and err.strip() == "", err


def test_ctrl_c_is_one_line_and_exit_130():
    p = subprocess.Popen([sys.executable, "-m", "minigraph.cli", "run", "toy", "--steps", "1000000"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    time.sleep(4)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.decode().strip() == "minigraph: interrupted", err


LOST_INTERRUPT = """
import sys, time
from minigraph.cli import interrupt
with interrupt.handled():
    class Slow:
        def __del__(self):
            time.sleep(30)      # Ctrl-C lands here: Python reports the KeyboardInterrupt as ignored
    Slow()
    while True:
        time.sleep(0.1)
"""


def test_ctrl_c_lost_in_a_finalizer_still_ends_the_run():
    # the CI failure this guards against: SIGINT arrived inside a weakref callback, the
    # KeyboardInterrupt was swallowed and `minigraph run --steps 1000000` went on
    p = subprocess.Popen([sys.executable, "-c", LOST_INTERRUPT], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 130 and err.decode().strip() == "minigraph: interrupted", err


def test_main_in_process_leaves_the_sigint_handler_and_hook_as_they_were():
    import signal as sig
    from minigraph.cli.main import main
    hook = sys.unraisablehook
    assert main(["run", "toy", "--steps", "1"]) == 0
    assert sig.getsignal(sig.SIGINT) is sig.default_int_handler and sys.unraisablehook is hook


def test_environment_flags_take_every_spelling():
    for word, want in [("1", True), ("yes", True), ("ON", True), ("true", True),
                       ("0", False), ("no", False), ("off", False), ("False", False), ("", True)]:
        assert env.get("MINIGRAPH_GRAPH_REUSE", {"MINIGRAPH_GRAPH_REUSE": word}) is want
    with pytest.raises(env.EnvError, match="MINIGRAPH_GRAPH_REUSE='maybe': expected one of"):
        env.get("MINIGRAPH_GRAPH_REUSE", {"MINIGRAPH_GRAPH_REUSE": "maybe"})


def test_graph_reuse_false_is_honoured():
    d = json.loads(cli("run", "toy", "--steps", "10", "--json", env_extra={"MINIGRAPH_GRAPH_REUSE": "false"}).stdout)
    assert d["reuses"] == 0
    assert {r["reason"] for r in d["rebuild_reasons"]} == {"graph reuse is off"}


def test_traceback_0_means_no_traceback():
    p = cli("run", "toy", "--steps", "3", env_extra={"MINIGRAPH_TRACEBACK": "0", "MINIGRAPH_GRAPH_REUSE": "perhaps"},
            expect=2)
    one_line_error(p, "MINIGRAPH_GRAPH_REUSE='perhaps'")


def test_environment_is_read_in_one_module():
    """Only minigraph/env.py reads os.environ (the libgomp default the CPU backend sets is a write)."""
    readers = []
    for top in ("minigraph", "models", "backends"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith(".py") and path != os.path.join(ROOT, "minigraph", "env.py"):
                    text = open(path).read()
                    if "os.environ.get(" in text or "os.getenv(" in text:
                        readers.append(os.path.relpath(path, ROOT))
    assert readers == [], readers


def test_every_variable_is_in_help_and_readme():
    help_text = cli("--help").stdout
    readme = open(os.path.join(ROOT, "README.md")).read()
    for var in env.VARIABLES:
        assert var.name in help_text and f"`{var.name}" in readme, var.name


# -- 6. meta devices count their all-reduces as transfers --------------------------------------
def test_meta_all_reduces_are_transfers():
    d = json_out("run", "toy-tp", "--devices", "meta(cpu:0,cpu:1)", "--steps", "3", "--threads", "1")
    assert d["all_reduces_per_step"] > 0 and d["all_reduce_bytes_per_step"] > 0
    assert d["transfers_per_step"] == d["copies_per_step"] + d["all_reduces_per_step"]
    p = json_out("placement", "toy-tp", "--devices", "meta(cpu:0,cpu:1)")
    assert p["all_reduces"] == d["all_reduces_per_step"] and p["transfers"] == p["copies"] + p["all_reduces"]
    assert p["all_reduce_bytes"] > 0      # of a 4-token ubatch: not the run's 1-token steps
    text = cli("run", "toy-tp", "--devices", "meta(cpu:0,cpu:1)", "--steps", "2").stdout
    assert "all-reduces         2.0 per step" in text


# -- 7. --version, python -m minigraph, help ---------------------------------------------------
def test_version_and_python_m_minigraph():
    assert cli("--version").stdout.strip().startswith("minigraph 0.")
    assert "run" in cli("--help", module="minigraph").stdout


def test_every_flag_has_help_and_the_description_is_whole():
    from minigraph.cli.main import DESCRIPTION, build_parser
    ap = build_parser()
    assert DESCRIPTION.endswith("benchmarks.")
    sub = next(a for a in ap._actions if a.dest == "cmd")
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, f"minigraph {name} {action.option_strings or action.dest}: no help text"


# -- 8. say why --------------------------------------------------------------------------------
def test_reuse_gives_the_reason_for_every_rebuild():
    d = json_out("reuse", "toy", "--steps", "15", "--threads", "1")
    reasons = {r["reason"]: r["count"] for r in d["rebuild_reasons"]}
    assert sum(reasons.values()) == d["builds"]
    assert reasons["first graph"] == 1
    assert any(r.startswith("ubatch shape (n_tokens)") for r in reasons)
    rebuild = {r["reason"] for r in d["modes"]["rebuild"]["rebuild_reasons"]}
    assert rebuild == {"graph reuse is off"}
    text = cli("reuse", "toy", "--steps", "8").stdout
    assert "why graphs were rebuilt" in text and "first graph" in text


def test_run_verbose_shows_rebuild_reasons():
    out = cli("run", "toy", "--steps", "6", "--verbose").stdout
    assert "rebuilt" in out and "first graph" in out


def test_can_reuse_names_the_failed_rule_and_stays_a_bool():
    from minigraph.models.graph import ReuseVerdict
    from minigraph.models.runner import Runner
    from minigraph.models.zoo import make_model
    r = Runner(make_model("toy", [mg.backend("ref")]), mem_size=4, n_rs_seq=1)
    r.decode_seq_tokens({0: [1, 2, 3]})
    r.decode_seq_tokens({0: [4]})
    r.decode_seq_tokens({0: [5]})
    r.decode_seq_tokens({1: [6]})
    assert r.stats.rebuild_reasons == ["first graph", "ubatch shape (n_tokens): 3 -> 1",
                                       "ubatch sequences: [0] -> [1]"]
    assert ReuseVerdict() == True and not ReuseVerdict("head: 0 -> 1") and bool(ReuseVerdict()) is True


def test_validator_names_the_first_differing_node():
    from minigraph.models import graph as G
    from minigraph.models.runner import ReuseMismatch, Runner
    from minigraph.models.zoo import make_model
    r = Runner(make_model("toy", [mg.backend("cpu")]), mem_size=4, n_rs_seq=1, validate=True)
    r.decode_seq_tokens({0: [1, 2, 3]})
    r.decode_seq_tokens({0: [4]})
    orig = G.GraphResult.can_reuse
    try:
        G.GraphResult.can_reuse = lambda self, params: True
        # seq 1 lives in another cell: head and rs_z differ, and the graph baked the old ones in
        # (here the first node differs in shape: the rs_z row it zeroes is empty in the old graph)
        with pytest.raises(ReuseMismatch, match=r"first differing node #\d+ \S.*\(\w+\): (element \d+ "
                                                r"reused -?[\d.e+-]+, fresh -?[\d.e+-]+|shapes \(.*\) vs \(.*\))"):
            r.decode_seq_tokens({1: [5]})
    finally:
        G.GraphResult.can_reuse = orig


# -- 9. JSON for programs ----------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ("run", "toy", "--steps", "3"),
    ("run", "toy", "--steps", "0"),
    ("placement", "toy", "--devices", "cpu:1,cpu:0", "--layers", "4"),
    ("placement", "toy", "--devices", "cpu:1,cpu:0", "--layers", "4", "--compare"),
    ("placement", "toy", "--n-rs-seq", "0"),
    ("reuse", "toy", "--steps", "1"),
    ("check", "--seeds", "1", "--backends", "ref,cpu"),
])
def test_every_json_output_matches_the_schema(args):
    d = json_out(*args)
    assert d["schema_version"] == 1 and d["command"] == args[0]


def test_schema_ships_as_package_data():
    cfg = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert '"minigraph.cli" = ["schema.json"]' in cfg and "jsonschema" in cfg


# -- 10. placement you can read ----------------------------------------------------------------
def test_copies_have_distinct_names_and_reasons():
    d = json_out("placement", "toy", "--devices", "cpu:1,cpu:0", "--layers", "4", "--slot-order",
                 "shared-first-layer")
    copies = d["report"]["copies"]
    names = [c["copy"] for c in copies]
    assert len(names) == len(set(names)), names
    assert {c["reason"] for c in copies} >= {"slot order", "input", "layer boundary"}
    slot = [c for c in copies if c["reason"] == "slot order"]
    assert len(slot) == 2 and slot[0]["copy"] != slot[1]["copy"]
    text = cli("placement", "toy", "--devices", "cpu:1,cpu:0", "--layers", "4", "--slot-order",
               "shared-first-layer").stdout
    assert "slot order" in text and "why copies exist:" in text and "layer boundary" in text


def test_focus_draws_only_that_part(tmp_path):
    full, part = tmp_path / "full.dot", tmp_path / "part.dot"
    cli("placement", "toy", "--devices", "cpu:1,cpu:0", "--layers", "4", "--dot", str(full))
    cli("placement", "toy", "--devices", "cpu:1,cpu:0", "--layers", "4", "--dot", str(part), "--focus", "conv-store")
    n_full, n_part = full.read_text().count("[label="), part.read_text().count("[label=")
    assert 0 < n_part < n_full / 2
    assert "SET_ROWS" in part.read_text() and "slot_order" in part.read_text()


def test_png_without_graphviz_uses_readable_matplotlib_labels(tmp_path, monkeypatch):
    import importlib
    draw = importlib.import_module("minigraph.draw")
    monkeypatch.setattr(draw.shutil, "which", lambda name: None)
    sizes = []
    import networkx as nx
    real = nx.draw_networkx_labels
    monkeypatch.setattr(nx, "draw_networkx_labels", lambda *a, **k: sizes.append(k["font_size"]) or real(*a, **k))
    ctx = mg.Context()
    a = ctx.new_tensor_1d(mg.f32, 4).set_name("a").set_input()
    gf = mg.Graph()
    gf.build_forward_expand(mg.scale(a, 2.0))
    files = draw.draw(gf, str(tmp_path / "g.png"))
    assert files == [str(tmp_path / "g.dot"), str(tmp_path / "g.png")] and sizes and min(sizes) >= 9


# -- 11. bench shows its progress --------------------------------------------------------------
def test_bench_shows_which_benchmark_runs_and_its_time():
    out = cli("bench", "--quick", "--only", "reuse").stdout
    assert "== [1/1] bench/reuse.py --quick" in out and "bench/reuse.py: done in" in out


def test_bench_quick_gives_the_long_scripts_a_time_budget(monkeypatch, capsys):
    # `minigraph bench --quick` stays near a minute because ops.py and models.py stop starting
    # rows after their budget (checked here by the arguments, not by timing the run)
    from minigraph.cli import bench as bench_cmd
    calls = []
    monkeypatch.setattr(bench_cmd.subprocess, "call", lambda argv: calls.append(argv) or 0)
    args = type("A", (), {"quick": True, "only": None})()
    assert bench_cmd.cmd_bench(args) == 0
    by_script = {os.path.basename(a[1]): a[2:] for a in calls}
    assert set(by_script) == {"ops.py", "models.py", "reuse.py"}
    for name in ("ops.py", "models.py"):
        assert "--quick" in by_script[name] and "--budget" in by_script[name], by_script[name]
    assert sum(float(by_script[n][by_script[n].index("--budget") + 1]) for n in ("ops.py", "models.py")) <= 40


def test_bench_ops_budget_counts_the_rows_left_out():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ops.py"), "--quick", "--budget", "0.001",
                          "--no-contention", "--threads", "1"], capture_output=True, text=True, timeout=300).stdout
    assert "budget: 0 s reached" in out and "rows not measured" in out
