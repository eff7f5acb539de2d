"""``splitserve generate``: offline generation for prompts from flags or a JSONL file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from splitserve.config import DEVICES, DTYPES, KV_CACHE_DTYPES, speculative_config_from_json
from splitserve.sampling_params import SamplingParams

DEFAULT_PROMPTS = ["The capital of France is", "Prefill computes the prompt; decode"]
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate completions offline")
    p.add_argument("--model", default="qwen3-tiny", help="HF checkpoint directory or preset name")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help='JSONL: {"prompt": ...} or {"prompt_token_ids": [...]}')
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--device", default=None, help=f"one of {', '.join(DEVICES)} (default: auto)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help=f"one of {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype; fp8_e4m3 halves "
        "the KV bytes of bf16)",
    )
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="run a MoE model as an expert-parallel group of N ranks (processes; on GPUs, "
        "the device and the N - 1 after it)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per prompt, in input order")
    p.add_argument(
        "--speculative-config",
        help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\' (MTP drafts)',
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    defaults = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
    }
    items = [{"prompt": p} for p in args.prompt]
    if args.prompts_file:
        items += _read_prompts_file(args.prompts_file)
    if not items:
        items = [{"prompt": p} for p in DEFAULT_PROMPTS]
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        print(f"splitserve generate: {e}", file=sys.stderr)
        return 2

    from splitserve.llm import LLM  # heavy imports only once the arguments are good

    try:
        spec = None
        if args.speculative_config:
            spec = speculative_config_from_json(args.speculative_config)
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            kv_cache_dtype=args.kv_cache_dtype,
            speculative_config=spec,
            expert_parallel_size=args.expert_parallel_size,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"splitserve generate: {e}", file=sys.stderr)
        return 2
    prompts, params, errors = _requests(items, defaults)
    kept = [i for i in range(len(items)) if i not in errors]
    outputs = dict(zip(kept, llm.generate(prompts, params, use_tqdm=not args.json)))
    failed = 0
    for i, item in enumerate(items):
        out = outputs.get(i)
        error = errors.get(i) or (out.error if out is not None else None)
        failed += error is not None
        _print(item, out, error, args.json, spec is not None)
    return 1 if failed else 0


def _requests(items: list[dict], defaults: dict[str, Any]):
    """Per-item prompt and SamplingParams; items with bad fields become errors."""
    prompts, params, errors = [], [], {}
    for i, item in enumerate(items):
        fields = {k: v for k, v in item.items() if k not in ("prompt", "prompt_token_ids")}
        unknown = sorted(set(fields) - SAMPLING_FIELDS - {"error"})
        try:
            if "error" in item:
                raise ValueError(item["error"])
            if unknown:
                raise ValueError(
                    f"unknown field(s) {unknown}; accepted: prompt, prompt_token_ids, "
                    + ", ".join(sorted(SAMPLING_FIELDS))
                )
            params.append(SamplingParams(**{**defaults, **fields}))
            prompts.append({k: v for k, v in item.items() if k in ("prompt", "prompt_token_ids")})
        except (ValueError, TypeError) as e:
            errors[i] = str(e)
    return prompts, params, errors


def _read_prompts_file(path: str) -> list[dict]:
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                if not isinstance(item, dict):
                    raise ValueError("a line must be a JSON object")
            except ValueError as e:
                item = {"error": f"{path}:{n}: not a JSON object: {e}"}
            items.append(item)
    return items


def _print(item: dict, out, error: str | None, as_json: bool, speculative: bool) -> None:
    if as_json:
        if error is not None:
            record = {"error": error}
        else:
            completion = out.outputs[0]
            record = {
                "prompt_token_ids": out.prompt_token_ids,
                "token_ids": completion.token_ids,
                "text": completion.text,
                "finish_reason": completion.finish_reason,
            }
            if speculative:
                record["num_draft_tokens"] = out.num_draft_tokens
                record["num_accepted_tokens"] = out.num_accepted_tokens
        print(json.dumps(record, ensure_ascii=False), flush=True)
        return
    prompt = item.get("prompt", item.get("prompt_token_ids"))
    if error is not None:
        print(f"prompt: {prompt!r}\nerror: {error}\n", flush=True)
    else:
        c = out.outputs[0]
        print(f"prompt: {prompt!r}\noutput: {c.text!r}  [{c.finish_reason}]\n", flush=True)
