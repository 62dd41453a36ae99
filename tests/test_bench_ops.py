"""bench/ops.py's report plumbing (no timing): --write replaces its own section of RESULTS.md and
leaves the rest; the busy process of the contention rows is gone after its block."""
from __future__ import annotations

import pytest

import bench_scripts


@pytest.fixture(scope="module")
def ops():
    return bench_scripts.load("ops")


def test_write_inserts_then_replaces_its_section(ops, tmp_path):
    p = tmp_path / "RESULTS.md"
    p.write_text("# Op benchmarks\nold prose\n\n# Model benchmarks\nmodels\n")
    ops.write_results("first table", str(p))
    ops.write_results("second table", str(p))
    doc = p.read_text()
    begin, end = ops.section_markers()
    assert doc.count(begin) == 1 and doc.count(end) == 1
    assert "second table" in doc and "first table" not in doc
    assert doc.index("old prose") < doc.index("second table") < doc.index("# Model benchmarks")
    assert doc.endswith("models\n")


def test_write_appends_when_there_is_no_model_section(ops, tmp_path):
    p = tmp_path / "RESULTS.md"
    p.write_text("# Something")
    ops.write_results("t", str(p))
    assert p.read_text().startswith("# Something\n") and ops.section_markers()[1] in p.read_text()


def test_the_busy_process_stops_with_its_block(ops):
    with ops.BusyProcess() as b:
        assert b.p.poll() is None
    assert b.p.poll() is not None
