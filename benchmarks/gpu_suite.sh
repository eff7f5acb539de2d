#!/usr/bin/env bash
# One GPU session: the GPU tests, then the single-GPU benchmarks; full logs and
# reports go to OUT_DIR. Usage: bash benchmarks/gpu_suite.sh OUT_DIR [tests|bench|all] [--quick]
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [tests|bench|all] [--quick]}
what=${2:-all}
quick=${3:-}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  timeout 420 python -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/test_cuda_graphs.py tests/test_layers_gpu.py tests/kernels >"$out/gpu_tests.log" 2>&1
  tail -40 "$out/gpu_tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 300 python benchmarks/model_step.py $quick --json "$out/model_step.json" >"$out/model_step.log" 2>&1
  tail -40 "$out/model_step.log"
  timeout 200 python benchmarks/kernels_roofline.py $quick --json "$out/kernels.json" >"$out/kernels.log" 2>&1
  tail -40 "$out/kernels.log"
fi
