#!/usr/bin/env bash
# The GPU checks in one call, for a machine with an NVIDIA GPU, cuda-bindings and torch (nothing is installed
# from the network): the C library built in place, the CUDA backend's tests (Python, and its rules on the C
# surface too), the C library's CUDA backend (tests/test_c_cuda.py), then the GPU benchmark. Results go to $OUT
# (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export VMMSHARE_SOCKET=${VMMSHARE_SOCKET:-/tmp/vmmshare-gpu-check/broker.sock}
export VMMSHARE_BROKER_IDLE=5
export VMMSHARE_REQUIRE_GPU=1  # the CUDA tests must run on the GPU, never on the CPU stand-in
{
  nvidia-smi -L
  $PY -c 'import sys, cuda.bindings, torch; print(sys.version.split()[0], "cuda-bindings", cuda.bindings.__version__, "torch", torch.__version__)'
  $PY -c 'from vmmshare.backends.cuda import CudaBackend as B; b = B(); print("GPUs", b.count, "granularity", b.granularity(0), "memory", b.total_memory(0), "free/total", b.mem_info(0))'
} 2>&1 | tee "$OUT/env.txt"
timeout 120 $PY setup.py -q build_ext --inplace > "$OUT/build_clib.txt" 2>&1  # libascendcl.so (cuda.c included)
build_rc=$?
timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs 2>&1 | tee "$OUT/pytest_cuda.txt"
test_rc=${PIPESTATUS[0]}
timeout 180 $PY -m pytest -q -p no:cacheprovider tests/test_c_cuda.py -rs 2>&1 | tee "$OUT/pytest_c_cuda.txt"
c_test_rc=${PIPESTATUS[0]}
timeout 240 $PY -m vmmshare.cli bench --gpu --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt"
bench_rc=${PIPESTATUS[0]}
echo "build rc=$build_rc tests rc=$test_rc C tests rc=$c_test_rc bench rc=$bench_rc"
exit $(( build_rc || test_rc || c_test_rc || bench_rc ))
