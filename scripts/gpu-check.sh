#!/usr/bin/env bash
# Check the CUDA backend on a machine with an NVIDIA GPU (needs python3 and PyPI, nothing else):
# a fresh venv with the project's [test,cuda] extras, the CUDA and op-table tests, then a short
# bandwidth benchmark. Runs in well under 8 minutes on an H200.
#
#   bash scripts/gpu-check.sh     # env: VENV (default $TMPDIR/minigraph-gpu-venv), PYTHON (python3)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-${TMPDIR:-/tmp}/minigraph-gpu-venv}
start=$(date +%s)
step() { printf '\n==== [%3ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

step "GPU and driver"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
    echo "nvidia-smi not found (continuing: CuPy will say whether a device is visible)"
fi

step "virtual environment $VENV ($($PYTHON --version))"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip

step "pip install -e '.[test,cuda]'"
"$PY" -m pip install --quiet -e '.[test,cuda]'
"$PY" -m pip list 2>/dev/null | grep -i -E '^(cupy|nvidia-|cuda-)' || true

# CuPy's wheel needs the CUDA runtime libraries, NVRTC above all (the backend compiles its
# kernels at run time): from a CUDA toolkit on the machine, or from PyPI.
probe() {
    "$PY" - <<'EOF'
import cupy
n = cupy.cuda.runtime.getDeviceCount()
props = cupy.cuda.runtime.getDeviceProperties(0)
k = cupy.RawModule(code='extern "C" __global__ void probe(float *x) { x[threadIdx.x] += 1.0f; }').get_function("probe")
x = cupy.zeros(32, cupy.float32)
k((1,), (32,), (x,))
assert float(x.sum()) == 32.0
print(f"{n} device(s); cuda:0 = {props['name'].decode()}, compute capability {props['major']}.{props['minor']}; "
      f"driver {cupy.cuda.runtime.driverGetVersion()}, runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
      f"CuPy {cupy.__version__}")
EOF
}
step "CuPy can compile and run a kernel"
if ! probe; then
    step "CuPy cannot run a kernel yet: adding the CUDA runtime and NVRTC from PyPI"
    "$PY" -m pip install --quiet 'cuda-toolkit[cudart,nvrtc]==12.*'
    if ! probe; then
        step "still not: adding all of CuPy's CUDA libraries (cupy-cuda12x[ctk])"
        "$PY" -m pip install --quiet 'cupy-cuda12x[ctk]'
        probe
    fi
fi

step "tests: tests/test_cuda_backend.py tests/test_ops.py"
timeout 330 "$PY" -m pytest -q -rs tests/test_cuda_backend.py tests/test_ops.py

step "benchmark: python -m minigraph.backends.cuda.bench"
timeout 180 "$PY" -m minigraph.backends.cuda.bench

step "done"
