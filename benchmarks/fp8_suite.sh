#!/usr/bin/env bash
# The FP8 KV GPU run on a host with 2 GPUs, most telling first: the decode kernels'
# GPU tests, the FP8 decode and hand-off benchmark (decode on one GPU, hand-off between
# two), the split-KV tiles at 8 requests, the engine's FP8 GPU tests, and the engine
# loop (bf16, to see the decode kernel's int64-table change in a whole step). Logs and
# reports go to OUT_DIR. Usage: bash benchmarks/fp8_suite.sh OUT_DIR
set -uo pipefail
out=${1:?usage: fp8_suite.sh OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
source "$(dirname "$0")/suite_step.sh"
step kernel_tests 150 python -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/kernels/test_decode_attention.py tests/kernels/test_fp8_kv_decode.py
step fp8_kv 240 python benchmarks/fp8_kv.py --skip graphs --json "$out/fp8_kv.json"
step decode_tiles_b8 60 python benchmarks/decode_tiles.py --shapes b8x8k --quick \
  --json "$out/decode_tiles_b8.json"
step engine_tests 150 python -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_fp8_kv_gpu.py
step engine_loop 120 python benchmarks/engine_loop.py --steps 48 --json "$out/engine_loop.json"
