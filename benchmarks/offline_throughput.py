"""Offline throughput of the engine: prefill and decode tokens/s per preset.

    python benchmarks/offline_throughput.py [--models qwen3-tiny ...] [--json docs/perf/x.json]

Each figure is the median of --repeat runs.
- prefill: a batch of random prompts with max_tokens=1; tokens/s over prompt tokens.
- decode: a batch of short prompts generating a fixed number of tokens with
  ignore_eos; only decode-only steps are timed.
- baseline, measured in the same run: transformers' own greedy ``generate`` on
  a model of the same config (batch of equal-length prompts, KV cache on).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import zlib
from pathlib import Path
from statistics import median

import torch

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine

PRESETS = ["qwen3-tiny", "qwen3-moe-tiny", "glm4-moe-tiny"]


def run_to_completion(engine: LLMEngine) -> tuple[float, float, int]:
    """Drain the engine; return (total seconds, decode-step seconds, decode tokens)."""
    start = time.perf_counter()
    decode_s, decode_tokens = 0.0, 0
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.last_step
        if s.num_prefill_tokens == 0:
            decode_s += s.seconds
            decode_tokens += s.num_decode_tokens
    return time.perf_counter() - start, decode_s, decode_tokens


def bench_prefill(engine: LLMEngine, num_prompts: int, prompt_len: int, tag: str) -> float:
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))  # new prompts: no cache hits
    vocab = engine.hf_config.vocab_size
    for i in range(num_prompts):
        ids = torch.randint(1, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"{tag}-p{i}", ids, SamplingParams(max_tokens=1, temperature=0))
    seconds, _, _ = run_to_completion(engine)
    return num_prompts * prompt_len / seconds


def bench_decode(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, tag: str):
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    vocab = engine.hf_config.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(1, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"{tag}-d{i}", ids, params)
    _, decode_s, decode_tokens = run_to_completion(engine)
    return decode_tokens / decode_s, 1e3 * decode_s / max(1, new_tokens - 1)


def bench_transformers(engine: LLMEngine, args) -> tuple[float, float]:
    """transformers on a model of the same config: (prefill tok/s, generate tok/s)."""
    from transformers import AutoModelForCausalLM

    # Speed is compared, not outputs: the baseline keeps its own random weights.
    hf = AutoModelForCausalLM.from_config(engine.hf_config).eval()
    vocab = engine.hf_config.vocab_size
    prompts = torch.randint(1, vocab, (args.num_prompts, args.prompt_len))
    ids = torch.randint(1, vocab, (args.batch, 16))
    n = args.new_tokens
    with torch.inference_mode():
        hf(prompts[:2], use_cache=False)  # warm-up
        start = time.perf_counter()
        hf(prompts, use_cache=False)
        prefill = prompts.numel() / (time.perf_counter() - start)
        mask = torch.ones_like(ids)
        hf.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return prefill, args.batch * n / (time.perf_counter() - start)


def bench_model(model: str, args) -> dict:
    config = EngineConfig(
        model=model,
        cache=CacheConfig(block_size=16, num_kv_blocks=4096),
        scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=4096),
    )
    engine = LLMEngine(config)
    bench_prefill(engine, 2, args.prompt_len, "warm")
    bench_decode(engine, 4, 8, 4, "warm")
    runs = range(args.repeat)
    prefill = median(
        bench_prefill(engine, args.num_prompts, args.prompt_len, f"r{i}") for i in runs
    )
    decode_runs = [bench_decode(engine, args.batch, 16, args.new_tokens, f"r{i}") for i in runs]
    decode, step_ms = median(d for d, _ in decode_runs), median(ms for _, ms in decode_runs)
    hf_runs = [bench_transformers(engine, args) for _ in runs]
    hf_prefill, hf_decode = median(p for p, _ in hf_runs), median(d for _, d in hf_runs)
    return {
        "model": model,
        "prefill_tok_s": round(prefill),
        "hf_prefill_tok_s": round(hf_prefill),
        "prefill_vs_hf": round(prefill / hf_prefill, 2),
        "decode_tok_s": round(decode),
        "hf_generate_tok_s": round(hf_decode),
        "decode_vs_hf": round(decode / hf_decode, 2),
        "decode_step_ms": round(step_ms, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=PRESETS)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is shown")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = [bench_model(m, args) for m in args.models]
    header = list(rows[0])
    print(" | ".join(f"{h:>17}" for h in header))
    for r in rows:
        print(" | ".join(f"{r[h]!s:>17}" for h in header))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
        }
        args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
