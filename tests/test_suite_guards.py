"""The suite's own guards (tests/conftest.py) work: a CPU extension that does not load stops the
run with the load error, and a skip without a reason fails. Each runs pytest on a small probe
folder with a copy of the conftest."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# a plugin that makes the CPU extension fail to import, as on a broken install
BLOCK_CPU_KERNELS = '''
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "minigraph.backends.cpu._kernels":
            raise ImportError("pretend the C extension is not built")

sys.meta_path.insert(0, _Block())
'''


def run_probe(tmp_path: Path, tests: str, *plugins: str) -> subprocess.CompletedProcess:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(tests)
    (tmp_path / "block_cpu_kernels.py").write_text(BLOCK_CPU_KERNELS)
    args = [arg for p in plugins for arg in ("-p", p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_cpu_extension_that_does_not_load_stops_the_run(tmp_path):
    p = run_probe(tmp_path, "def test_nothing():\n    pass\n", "block_cpu_kernels")
    assert p.returncode != 0, p.stdout
    assert "expected backends do not load" in p.stdout and "pretend the C extension is not built" in p.stdout, p.stdout
    assert "1 passed" not in p.stdout


def test_a_skip_without_a_reason_fails(tmp_path):
    p = run_probe(tmp_path, "import pytest\n\n"
                            "def test_quiet():\n    pytest.skip()\n\n"
                            "@pytest.mark.skip\ndef test_marked():\n    pass\n\n"
                            "def test_said_why():\n    pytest.skip('needs a GPU')\n")
    assert p.returncode != 0, p.stdout
    assert "1 failed, 1 skipped, 1 error" in p.stdout, p.stdout
    assert p.stdout.count("skipped without a reason") >= 2, p.stdout
