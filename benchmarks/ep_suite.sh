#!/usr/bin/env bash
# The expert-parallel GPU run on a host with 2 GPUs, most telling first: the EP kernel
# tests, dispatch through the shared buffers against NCCL (test), the dispatch
# benchmark, the fused MoE's decode tiles, then the other EP GPU tests. Logs and
# reports go to OUT_DIR. Usage: bash benchmarks/ep_suite.sh OUT_DIR [--quick-tiles]
set -uo pipefail
out=${1:?usage: ep_suite.sh OUT_DIR [--quick-tiles]}
tiles=${2:-}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
nvidia-smi topo -m >"$out/topo.txt" 2>&1
source "$(dirname "$0")/suite_step.sh"
step kernel_tests 120 python -m pytest -q -p no:cacheprovider -rf \
  tests/kernels/test_ep_rows.py tests/kernels/test_fused_moe.py
step peer_test 120 python -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/test_expert_parallel_gpu.py -k shared_buffers
step ep_dispatch 150 python benchmarks/ep_dispatch.py --json "$out/ep_dispatch.json"
step moe_tiles 200 python benchmarks/moe_tiles.py $tiles --json "$out/moe_tiles.json"
step ep_gpu_tests 240 python -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/test_expert_parallel_gpu.py -k "not shared_buffers"
