#!/usr/bin/env bash
# One GPU run: the GPU tests, then the single-GPU benchmarks; full logs and
# reports go to OUT_DIR. Usage: bash benchmarks/gpu_suite.sh OUT_DIR [tests|bench|all] [--quick]
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [tests|bench|all] [--quick]}
what=${2:-all}
quick=${3:-}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 python benchmarks/warm_flashinfer.py >"$out/warm_flashinfer.log" 2>&1  # JIT, in parallel
if [[ $what == tests || $what == all ]]; then
  timeout 420 python -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/test_cuda_graphs.py tests/test_layers_gpu.py tests/kernels \
    tests/test_pinned_ring.py tests/test_sampler.py \
    >"$out/gpu_tests.log" 2>&1
  tail -40 "$out/gpu_tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 300 python benchmarks/model_step.py $quick --json "$out/model_step.json" >"$out/model_step.log" 2>&1
  tail -40 "$out/model_step.log"
  timeout 200 python benchmarks/kernels_roofline.py $quick --json "$out/kernels.json" >"$out/kernels.log" 2>&1
  tail -40 "$out/kernels.log"
  timeout 120 python benchmarks/attention_roofline.py $quick --json "$out/attention.json" >"$out/attention.log" 2>&1
  tail -20 "$out/attention.log"
  timeout 250 python benchmarks/linear_roofline.py $quick --json "$out/linear.json" >"$out/linear.log" 2>&1
  tail -20 "$out/linear.log"
fi
