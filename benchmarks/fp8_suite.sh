#!/usr/bin/env bash
# The FP8 KV GPU run, most telling first: the decode kernels' GPU tests (the Triton
# kernel and the CUDA tensor-core one), the FP8 decode and hand-off benchmark (decode on
# one GPU, hand-off between two where there are two), the FP8 decode tiles of both
# kernels at 8 to 64 requests x 8k, the engine's FP8 GPU tests, and the engine loop
# (bf16). Logs and reports go to OUT_DIR. Usage: bash benchmarks/fp8_suite.sh OUT_DIR
set -uo pipefail
out=${1:?usage: fp8_suite.sh OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
source "$(dirname "$0")/suite_step.sh"
step kernel_tests 200 python -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/kernels/test_decode_attention.py tests/kernels/test_fp8_kv_decode.py \
  tests/kernels/test_fp8_decode_cuda.py
step fp8_kv 300 python benchmarks/fp8_kv.py --skip graphs --json "$out/fp8_kv.json"
step decode_tiles_fp8 150 python benchmarks/decode_tiles.py --dtypes fp8 \
  --tiles n128/s1/w2/f16 cuda/w8/s3/b1 cuda/w8/s2/b2 cuda/w4/s3/b2 cuda/w8/s3/b2 \
  --json "$out/decode_tiles_fp8.json"
step engine_tests 150 python -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_fp8_kv_gpu.py
step engine_loop 120 python benchmarks/engine_loop.py --steps 48 --json "$out/engine_loop.json"
