"""bench/e2e.py in its short mode (tiny models, one repetition): every model llama.cpp can run is
decoded by both engines in worker processes and the logits must agree before a speed is
printed; no timing is asserted. Its --write plumbing replaces only its own section."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from minigraph.testing import llama_oracle as lo

import bench_scripts

SCRIPT = bench_scripts.path("e2e")


@pytest.fixture(scope="module")
def e2e():
    return bench_scripts.load("e2e")


@pytest.mark.llama
def test_quick_mode_checks_logits_on_every_row(e2e, tmp_path):
    if not lo.installed():
        pytest.skip(lo.not_installed_reason())
    p = subprocess.run([sys.executable, SCRIPT, "--quick", "--dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    print(p.stdout[-6000:])
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    lines = p.stdout.strip().splitlines()
    # the phase may carry its file type (a quantized row: "decode1 q8_0")
    assert re.fullmatch(r"e2e: worst tokens/s ratio minigraph/llama\.cpp: [0-9.]+ \(\w+, \w+(?: \w+)?, \d+\)", lines[-1])
    rows = [s for s in lines if re.match(r"\s+(prefill|decode)\S* +\w+ +\d+ ", s)]
    # every phase of every model llama.cpp runs is a row with a speed (a refused or failed row prints no ratio)
    measured = {m for m in e2e.MODELS if f"## {m}:" in p.stdout and f"SKIPPED: llama.cpp cannot run minigraph's {m}" not in p.stdout}
    assert {"mamba2", "lfm2", "qwen35", "kimi"} <= measured, p.stdout     # every default file runs in llama.cpp
    # and one row of lfm2 from a Q8_0 file, checked against its own (activation rounding) bound
    q8 = [s for s in rows if s.split()[1] == "q8_0"]
    assert len(q8) == 1 and q8[0].split()[0] == "decode1", p.stdout
    assert len(rows) == len(measured) * len(e2e.PHASES) + 1, p.stdout
    for row in rows:
        assert "FAILED" not in row and "logits differ" not in row, row
        ftype, err = row.split()[1], float(row.split()[6].rstrip("!"))
        assert err <= (e2e.BOUND if ftype == "f32" else e2e.QBOUND[ftype]), row


def test_cached_file_follows_the_writer_source(e2e, tmp_path, monkeypatch):
    """A file written by other model or writer code is not reused: a kimi file cached before its
    MLA default (no attention block) made llama.cpp abort."""
    spec = e2e.model_specs(True)["kimi"]
    src = tmp_path / "src.py"
    monkeypatch.setattr(e2e, "writer_sources", lambda cls: [str(src)])
    src.write_text("# one version")
    a = e2e.write_model("kimi", spec, str(tmp_path))
    assert e2e.write_model("kimi", spec, str(tmp_path)) == a           # the same code: the cached file
    src.write_text("# another version")
    b = e2e.write_model("kimi", spec, str(tmp_path))
    assert b != a and os.path.getsize(b) > 0


def test_writer_sources_name_the_model_and_the_writer(e2e):
    from minigraph.models.kda import KDAModel
    names = {os.path.basename(f) for f in e2e.writer_sources(KDAModel)}
    assert {"kda.py", "base.py", "gguf_io.py", "gguf_types.py", "codec.py"} <= names, names


@pytest.mark.llama
def test_ttft_rows(tmp_path):
    """--ttft: one row per file type, both engines' times and the logits of the first token checked."""
    if not lo.installed():
        pytest.skip(lo.not_installed_reason())
    p = subprocess.run([sys.executable, SCRIPT, "--quick", "--ttft", "--models", "lfm2", "--ftype", "f32,q8_0",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    rows = [s.split() for s in p.stdout.splitlines() if re.match(r"\s+ttft +(f32|q8_0) ", s)]
    assert [r[1] for r in rows] == ["f32", "q8_0"], p.stdout
    for r in rows:
        assert float(r[3]) > 0 and float(r[5]) > 0 and float(r[8]) <= 1e-2, r


def test_write_replaces_only_its_section(e2e, tmp_path):
    """One section per model set: a second run of the same set replaces its own, another set adds one."""
    p = tmp_path / "RESULTS.md"
    p.write_text("# Op benchmarks\nprose\n")

    class Args:
        models = "mamba2"
    e2e.write_results("first", Args(), str(p))
    e2e.write_results("second", Args(), str(p))
    Args.models = "lfm2"
    e2e.write_results("third", Args(), str(p))
    doc = p.read_text()
    assert doc.startswith("# Op benchmarks\nprose\n")
    assert doc.count(e2e.results.markers("bench/e2e.py --write (mamba2)")[0]) == 1
    assert doc.count(e2e.results.markers("bench/e2e.py --write (lfm2)")[1]) == 1
    assert "second" in doc and "third" in doc and "first" not in doc
    assert doc.index("second") < doc.index("third")


def test_bad_flags_are_one_line(tmp_path):
    p = subprocess.run([sys.executable, SCRIPT, "--models", "gpt9", "--dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "unknown model or phase 'gpt9'" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, SCRIPT, "--ftype", "q3_x", "--dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--ftype 'q3_x'" in p.stderr and "Traceback" not in p.stderr


def test_write_sections_by_file_type_and_ttft(e2e, tmp_path):
    """A quantized run or a --ttft run of a model set keeps a section of its own."""
    p = tmp_path / "RESULTS.md"

    class Args:
        models, ftype, ttft = "lfm2", "f32", False
    e2e.write_results("f32 rows", Args(), str(p))
    Args.ftype = "q8_0,q4_k_m"
    e2e.write_results("quantized rows", Args(), str(p))
    Args.ftype, Args.ttft = "f32", True
    e2e.write_results("ttft rows", Args(), str(p))
    doc = p.read_text()
    for key, text in [(" (lfm2)", "f32 rows"), (" (lfm2, q8_0,q4_k_m)", "quantized rows"), (" (lfm2, ttft)", "ttft rows")]:
        begin, end = e2e.results.markers(f"bench/e2e.py --write{key}")
        assert doc.count(begin) == 1, doc
        assert text in doc[doc.index(begin):doc.index(end)]


def test_a_full_run_takes_out_the_sections_it_measured_again(e2e, tmp_path):
    """A run of every phase at 1 and 2 threads replaces the sections of earlier runs whose models
    and file types it covers (same kind of run); a partial run, another kind (ttft) and sections
    with models or types it did not run are kept."""
    p = tmp_path / "RESULTS.md"
    p.write_text("# Results\n")

    class Args:
        models, ftype, ttft, phases, threads = "lfm2", "q8_0,q4_k_m", False, ",".join(e2e.PHASES), "1,2"
    e2e.write_results("old lfm2 quantized", Args(), str(p))
    Args.models, Args.ftype = "mamba2,qwen35", "f32"
    e2e.write_results("old f32 pair", Args(), str(p))
    Args.models, Args.ftype = "kimi", "bf16"
    e2e.write_results("old kimi bf16", Args(), str(p))
    Args.models, Args.ftype, Args.ttft = "lfm2", "f32", True
    e2e.write_results("old ttft", Args(), str(p))
    Args.models, Args.ftype, Args.ttft, Args.phases = "mamba2,lfm2,qwen35,kimi", "f32,q8_0,q4_k_m", False, "decode1"
    e2e.write_results("partial run", Args(), str(p))
    doc = p.read_text()
    assert all(t in doc for t in ("old lfm2 quantized", "old f32 pair", "old kimi bf16", "old ttft", "partial run"))
    Args.phases = ",".join(e2e.PHASES)
    e2e.write_results("full run", Args(), str(p))
    doc = p.read_text()
    assert "full run" in doc and "old kimi bf16" in doc and "old ttft" in doc, doc
    assert "old lfm2 quantized" not in doc and "old f32 pair" not in doc, doc
    assert "\n\n\n\n" not in doc and doc.startswith("# Results\n"), doc


def test_a_worker_peak_rss_is_its_own_not_its_parents(tmp_path):
    """The RSS column is each engine worker's peak: a worker started by a parent holding 400 MB
    must not report those 400 MB (ru_maxrss does on Linux: it survives fork and exec)."""
    child = tmp_path / "child.py"
    child.write_text("import importlib.util\n"
                     f"spec = importlib.util.spec_from_file_location('e2e', {SCRIPT!r})\n"
                     "m = importlib.util.module_from_spec(spec)\n"
                     "spec.loader.exec_module(m)\n"
                     "print(m.peak_rss())\n")
    parent = tmp_path / "parent.py"
    parent.write_text("import subprocess, sys\n"
                      "hold = bytearray(400 << 20)\n"
                      "for i in range(0, len(hold), 4096): hold[i] = 1\n"
                      f"print(subprocess.run([sys.executable, {str(child)!r}], capture_output=True, text=True,"
                      " check=True).stdout)\n")
    out = subprocess.run([sys.executable, str(parent)], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) < 300 << 20, out.stdout


def _one_call(v):
    """outputs of one call of one sequence (the arithmetic check's input form)"""
    return [{0: v}]


def test_arithmetic_check_bounds_by_llama_cpps_own_spread(e2e):
    """A quantized row passes within NMSE_BOUND or SPREAD_SLACK x llama.cpp's own spread (of the
    float model's NMSE), and only while minigraph is nearer llama.cpp than the float model.
    Outputs built on orthogonal directions, so every NMSE is known exactly."""
    import numpy as np
    e = np.eye(6)
    llama = 10 * e[0]
    floats = llama + e[1]                                        # NMSE 0.01 from llama.cpp
    mine = llama + np.sqrt(0.8) * e[2]                           # 0.8 x the float model's
    variant = llama + np.sqrt(0.7) * e[3]                        # llama.cpp's own spread: 0.7 x
    assert e2e.NMSE_BOUND["q8_0"] < 0.8 < e2e.SPREAD_SLACK * 0.7
    refusal, note = e2e.arithmetic_check("q8_0", _one_call(mine), _one_call(llama), _one_call(floats),
                                         _one_call(variant))
    assert refusal is None and "llama.cpp 0.70 x" in note and "0.80 x float products" in note, note
    # without the variant only the fixed bound holds
    refusal, _ = e2e.arithmetic_check("q8_0", _one_call(mine), _one_call(llama), _one_call(floats),
                                      {"error": "refused"})
    assert refusal and "not ggml's arithmetic" in refusal, refusal
    # an engine of float products: within the bound, but nearer the float model than llama.cpp
    refusal, _ = e2e.arithmetic_check("q8_0", _one_call(floats + 0.01 * e[4]), _one_call(llama), _one_call(floats),
                                      _one_call(variant))
    assert refusal and "nearer float products" in refusal, refusal
    # llama.cpp's own arithmetic: passes
    own = e2e.arithmetic_check("q8_0", _one_call(llama + 1e-3 * e[5]), _one_call(llama), _one_call(floats),
                               _one_call(variant))
    assert own[0] is None


def test_arithmetic_check_takes_the_models_rounding_spread_into_account(e2e):
    """Where a rounding-level change of minigraph's own inputs (norm weights one ulp apart) moves
    the logits about as far as the float model is, the bound follows that spread, and being a
    little nearer the float model than llama.cpp is no longer a refusal; float products (next to
    the float model) still are, and so is a row beyond the spread."""
    import numpy as np
    e = np.eye(8)
    llama = 10 * e[0]
    floats = llama + e[1]                                        # NMSE 0.01 from llama.cpp
    variant = llama + np.sqrt(0.3) * e[3]                        # llama.cpp's own spread: 0.3 x
    mine = llama + 0.6 * e[1] + np.sqrt(0.95 - 0.36) * e[2]      # 0.95 x, and 0.75 x from the floats
    perturbed = mine + np.sqrt(0.9) * e[4]                       # rounding carries it ~0.9 x
    assert e2e.arithmetic_check("q8_0", _one_call(mine), _one_call(llama), _one_call(floats), _one_call(variant))[0]
    refusal, note = e2e.arithmetic_check("q8_0", _one_call(mine), _one_call(llama), _one_call(floats), _one_call(variant),
                                         _one_call(perturbed))
    assert refusal is None and "rounding 0.89 x" in note and "bound 1.34" in note, note
    # float products: next to the float model, and rounding carries them nowhere
    products = floats + 0.01 * e[5]
    wide = llama + np.sqrt(0.7) * e[3]                           # a bound of 1.05: the ratio passes
    refusal, _ = e2e.arithmetic_check("q8_0", _one_call(products), _one_call(llama), _one_call(floats), _one_call(wide),
                                      _one_call(products + 1e-4 * e[7]))
    assert refusal and "nearer float products" in refusal, refusal
    # beyond 1.5 x the spread
    far = llama + np.sqrt(1.4) * e[6]
    refusal, _ = e2e.arithmetic_check("q8_0", _one_call(far), _one_call(llama), _one_call(floats), _one_call(variant),
                                      _one_call(far + np.sqrt(0.9) * e[4]))
    assert refusal and "not ggml's arithmetic" in refusal, refusal
    # a reference that failed counts for nothing
    refusal, note = e2e.arithmetic_check("q8_0", _one_call(mine), _one_call(llama), _one_call(floats), _one_call(variant),
                                         {"error": "died"})
    assert refusal and "rounding failed: died" in refusal, refusal


def test_a_refused_row_says_where_ggmls_dot_product_order_lands(e2e):
    """The note a refusal gets: the ref backend's NMSE (ggml's block dot-product order) in the same
    units, and its exact calls; a reference that failed is said to have failed."""
    import numpy as np
    e = np.eye(4)
    llama = [{0: 10 * e[0]}, {0: 10 * e[0] + e[2]}]
    floats = [{0: 10 * e[0] + e[1]}, {0: 10 * e[0] + e[2] + e[1]}]     # NMSE 2 / 201 from llama.cpp
    ref = [{0: 10 * e[0]}, {0: 10 * e[0] + e[2] + e[3]}]               # half of it, first call exact
    note = e2e.ggml_order_note(ref, llama, floats)
    assert note == "; the ref backend (ggml's dot-product order) measures 0.5 x, calls exact 1/2", note
    assert e2e.ggml_order_note({"error": "timed out"}, llama, floats) == "; ref backend failed: timed out"


def test_ggmls_own_dot_order_can_lift_the_bound(e2e):
    """A row beyond 1.5 x both spreads passes when the ref backend (ggml's vec_dot order) lands
    about as far from llama.cpp: within REF_SLACK x its NMSE; beyond that, or with the ref
    backend failed, the refusal stands, and float products are still refused."""
    import numpy as np
    e = np.eye(8)
    llama = 10 * e[0]
    floats = llama + e[1]                                        # NMSE 0.01 from llama.cpp
    variant = llama + np.sqrt(0.5) * e[3]                        # llama.cpp's own spread: 0.5 x
    mine = llama + np.sqrt(0.78) * e[2]                          # 0.78 x: above 1.5 x 0.5
    perturbed = mine + np.sqrt(0.5) * e[4]                       # rounding: 0.5 x
    args = (_one_call(mine), _one_call(llama), _one_call(floats), _one_call(variant), _one_call(perturbed))
    assert "not ggml's arithmetic" in e2e.arithmetic_check("q8_0", *args)[0]
    ref = llama + np.sqrt(0.77) * e[5]
    refusal, note = e2e.arithmetic_check("q8_0", *args, _one_call(ref))
    assert refusal is None and "ggml's dot order (ref backend) 0.77 x" in note and "bound 0.85" in note, note
    near = llama + np.sqrt(0.6) * e[5]                           # 1.1 x 0.6 = 0.66 < 0.78
    refusal, _ = e2e.arithmetic_check("q8_0", *args, _one_call(near))
    assert refusal and "not ggml's arithmetic" in refusal, refusal
    refusal, _ = e2e.arithmetic_check("q8_0", *args, {"error": "died"})
    assert refusal and "ggml's dot order failed: died" in refusal, refusal
    # float products stay refused, however far the ref backend lands
    products = floats + 0.01 * e[6]
    refusal, _ = e2e.arithmetic_check("q8_0", _one_call(products), _one_call(llama), _one_call(floats), _one_call(variant),
                                      _one_call(products + 1e-4 * e[7]), _one_call(llama + 2 * e[5]))
    assert refusal and "nearer float products" in refusal, refusal
