"""bench/results.py, the section writer every benchmark script's --write goes through (no timing):
a report printed while it runs is shown and also written, with the command and machine lines,
into the script's own section; a second run replaces that section and leaves the others."""
from __future__ import annotations

import re

import pytest

import bench_scripts


@pytest.fixture(scope="module")
def results():
    return bench_scripts.load("results")


def test_run_and_write_prints_and_writes_the_report(results, tmp_path, capsys):
    p = tmp_path / "RESULTS.md"
    p.write_text("# Benchmark results\n")
    other = results.markers("bench/other.py --write")
    results.replace_section(*other, "other report", str(p))
    for n in (1, 2):
        def run():
            print(f"row A {n}")
            print(f"last line {n}")
            return n
        rv = results.run_and_write("bench/x.py", ["--quick", "--write"], "X (bench/x.py)", run, path=str(p))
        assert rv == n
        assert f"row A {n}\nlast line {n}\n" in capsys.readouterr().out
    doc = p.read_text()
    begin, end = results.markers("bench/x.py --write")
    assert doc.count(begin) == 1 and doc.count(end) == 1 and "row A 1" not in doc
    body = doc[doc.index(begin):doc.index(end)]
    assert "# X (bench/x.py)" in body and "`python bench/x.py --quick` at commit " in body
    assert "Machine: " in body and " at the end." in body and "row A 2\nlast line 2\n```" in body
    assert doc.startswith("# Benchmark results\n") and "other report" in doc


def test_machine_line_names_cpu_cores_and_load(results):
    line = results.machine_line()
    assert line.startswith("Machine: ") and " cores, load average " in line
    # the SIMD level the host offers (the kernels are built for it): AVX-512 and AVX2 hosts run other code
    assert re.search(r"\((AVX-512|AVX2|no AVX2|SIMD unknown)\), \d+ cores", line), line
