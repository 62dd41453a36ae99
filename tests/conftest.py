"""Session-wide rules: hypothesis profiles, and tests never shrink silently.

- The CPU backend's C extension is always expected: if it does not load, the run stops with the
  load error (instead of its tests skipping).
- CUDA is expected only where CuPy is installed and a device is visible; then it must load too.
  Elsewhere the GPU tests skip, each with its reason (pytest -ra lists them).
- llama.cpp (the optional `llama` extra, llama-cpp-python) is expected only where it is installed;
  then it must load (checked in a process of its own), else the run stops with the reason. Where it
  is not installed, tests/test_llama_oracle.py skips, saying how to install and run it. The ggml
  backend (ggml:cpu, from the same extra) is held to the same rule: installed means it must load.
- A skip must say why: a skip with no reason fails."""
import os

import pytest
from hypothesis import HealthCheck, settings

import minigraph as mg

# sized for a 2-core CI machine: the whole suite must stay well under five minutes
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def cuda_absent_reason() -> str | None:
    """Why no CUDA device is expected here, or None when CuPy sees one."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:           # no driver, driver too old for this CuPy
        return f"CuPy sees no CUDA device ({e})"
    return None if n > 0 else "CuPy sees no CUDA device"


def backends_that_must_load_but_do_not() -> list[str]:
    expected = ["cpu"] + (["cuda:0"] if cuda_absent_reason() is None else [])
    failures = []
    for name in expected:
        try:
            mg.backend(name)
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
    return failures


def llama_extra_problem() -> str | None:
    """Why the installed llama extra does not load; None when it loads or is not installed."""
    from minigraph.testing import llama_oracle
    if not llama_oracle.installed():
        return None
    problem = llama_oracle.load_problem_isolated()
    return None if problem is None else f"llama-cpp-python (the llama extra) is installed but: {problem}"


def ggml_backend_problem() -> str | None:
    """Why the ggml backend (ggml 0.25 from the llama extra) does not load where the extra is
    installed; None when it loads or the extra is absent. Checked in a process of its own: it must
    not share one with the op oracle's libggml-python."""
    from minigraph.testing import llama_oracle
    if not llama_oracle.installed():
        return None
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", "import minigraph as mg; mg.backend('ggml:cpu')"],
                       capture_output=True, text=True, timeout=120)
    if p.returncode == 0:
        return None
    lines = (p.stderr.strip() or f"status {p.returncode}").splitlines()
    return f"the llama extra is installed but the ggml backend (ggml:cpu) does not load: {lines[-1]}"


def pytest_sessionstart(session):
    failures = backends_that_must_load_but_do_not()
    for problem in (llama_extra_problem(), ggml_backend_problem()):
        if problem:
            failures.append(problem)
    if failures:
        pytest.exit("expected backends do not load (their tests would silently not run):\n  "
                    + "\n  ".join(failures), returncode=pytest.ExitCode.INTERNAL_ERROR)


# -- a skip must say why -----------------------------------------------------------------------
_NO_REASON = {"", "skipped", "unconditional skip"}


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")
    return reason.removeprefix("Skipped:").strip()


def _fail_if_skipped_without_reason(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and _skip_reason(report).lower() in _NO_REASON:
        report.outcome = "failed"
        report.longrepr = f"{report.nodeid}: skipped without a reason; say why it cannot run here"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_skipped_without_reason(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_if_skipped_without_reason(outcome.get_result())


# -- the llama.cpp oracle's agreement table, after the run ----------------------------------------
def pytest_terminal_summary(terminalreporter):
    import sys
    mod = sys.modules.get("test_llama_oracle") or sys.modules.get("tests.test_llama_oracle")
    results = getattr(mod, "RESULTS", None)
    if results:
        terminalreporter.write_line(f"llama.cpp oracle, max relative error of the logits (bound {mod.BOUND:g}):")
        for (arch, scenario), e in sorted(results.items()):
            terminalreporter.write_line(f"  {arch:12s} {scenario:34s} {e:.2e}")
