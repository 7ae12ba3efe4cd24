#!/usr/bin/env bash
# One short GPU check of the csrc/cuda ops (< 5 minutes with 16 cores), for a machine with an
# NVIDIA GPU and a CUDA build of torch:
#   1. builds the extension with the CUDA sources (VLLM_HYBRID_CUDA=1, sm_80 + sm_90 + PTX),
#   2. runs the CUDA-vs-reference tests (and the CPU ones, and the nvcc compile test),
#   3. prints the snapshot bandwidth table on the GPU (benchmarks/gpu_check.py).
# Usage: bash benchmarks/gpu_check.sh     (PYTHON=/path/to/python picks the interpreter; the
# default is the first of .venv/bin/python, python3 whose torch sees a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
  for py in "${PYTHON:-}" .venv/bin/python python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null || continue
    if "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
    then echo "$py"; return 0; fi
  done
  echo "gpu_check: no python whose torch sees a GPU (set PYTHON=...)" >&2
  return 2
}

PY=$(pick_python)
nvidia-smi -L 2>/dev/null || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
nvcc --version | tail -1

echo "== build (VLLM_HYBRID_CUDA=1)"
start=$(date +%s)
VLLM_HYBRID_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" setup.py build_ext --inplace -q
echo "build took $(( $(date +%s) - start )) s"
"$PY" -c "import torch, vllm_hybrid.ops as o; o._loader._load(); \
assert torch._C._dispatch_has_kernel_for_dispatch_key('vllm_hybrid::snapshot_copy', 'CUDA'), \
'extension built without its CUDA kernels'; print('CUDA kernels registered')"

echo "== tests"
"$PY" -m pytest -q -p no:cacheprovider tests/ops/test_snapshot_cuda.py tests/ops/test_snapshot.py \
  tests/ops/test_prefill_checkpoint.py tests/ops/test_cuda_compile.py

echo "== bandwidth"
"$PY" benchmarks/gpu_check.py
