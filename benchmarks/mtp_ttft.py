"""What the MTP drafter adds to a prompt's time to first token.

    python benchmarks/mtp_ttft.py [--k 3] [--input-len 1024] [--prompts 8] [--json PATH]
    python benchmarks/mtp_ttft.py --prefill-worker ...

One prompt at a time on a GLM-4.5-Air-shaped model with 8 layers (dummy bf16 weights,
eager steps). By default on one mixed engine: the time to first token and the
drafter's part of it, its first pass over the prompt and its K - 1 chained passes
(``MTPProposer.propose``, synchronized on both sides). ``--prefill-worker``: a prefill
and a decode engine in this process on one GPU, the KV over the socket transport, and
the prefill worker's time to first token (from its ``add_request`` to the output with
the token) when its drafts follow the first token (what it does) and when they come
first (its order before, set on the engine for this comparison), in the same run.
Acceptance plays no part here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

try:
    import roofline
except ImportError:  # imported as benchmarks.mtp_ttft
    from benchmarks import roofline


def engine_config(
    k: int, input_len: int, backend: str, model: str, device: str, role: str = "mixed"
) -> dict:
    transfer = {"kv_transfer": {"transport": "cpu"}} if role != "mixed" else {}
    return transfer | {
        "role": role,
        "model": model,
        "load_format": "dummy",
        "device": device,
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "attention_backend": backend,
        "cache": {"block_size": 16, "kv_cache_memory_gb": 8},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": input_len,
                      "max_model_len": input_len + 64},
        "cuda_graph": {"enabled": False},
        "speculative_config": {"method": "mtp", "num_speculative_tokens": k},
    }  # fmt: skip


def device_name(args) -> str:
    return torch.cuda.get_device_name() if args.device == "cuda" else "cpu"


def timed_propose(proposer, spent: list[float], sync):
    propose = proposer.propose

    def wrapped(*args, **kwargs):
        sync()
        start = time.perf_counter()
        out = propose(*args, **kwargs)
        sync()
        spent.append(time.perf_counter() - start)
        return out

    return wrapped


def prefill_worker_ttft(args, values: dict, prompts: list[list[int]]) -> list[dict]:
    """TTFT on a prefill worker with its drafts after the first token, then before."""
    from splitserve.config import EngineConfig
    from splitserve.sampling_params import SamplingParams
    from splitserve.workers.engine.llm_engine import LLMEngine

    prefill = LLMEngine(EngineConfig.from_dict(values | {"role": "prefill"}))
    decode = LLMEngine(EngineConfig.from_dict(values | {"role": "decode"}))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ttft: dict[bool, list[float]] = {True: [], False: []}
    for i, prompt in enumerate(prompts):
        for after in (True, False) if i % 2 else (False, True):  # interleaved
            prefill.defers_drafts = after  # the order under comparison (not a setting)
            rid = f"{after}-{i}"
            decode.add_remote_request(rid, prompt, params)
            ticket = None
            while ticket is None:
                ticket = next((o.kv_ticket for o in decode.step() if o.kv_ticket), None)
            start, first = time.perf_counter(), None
            prefill.add_request(rid, prompt, params, kv_ticket=ticket)
            while first is None:
                if any(o.new_token_ids for o in prefill.step()):
                    first = time.perf_counter() - start
            while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
                prefill.step()
                decode.step()
            if i:  # the first one warms up
                ttft[after].append(first * 1e3)
    rows = [
        {"order": "drafts after the first token", "ttft_ms": statistics.median(ttft[True])},
        {"order": "drafts before it", "ttft_ms": statistics.median(ttft[False])},
    ]
    prefill.close()
    decode.close()
    return rows


def main(argv: list[str] | None = None) -> dict:
    from splitserve.config import EngineConfig
    from splitserve.sampling_params import SamplingParams
    from splitserve.workers.engine.llm_engine import LLMEngine
    from splitserve.workers.model.loader import load_hf_config

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--attention-backend", default="torch")
    p.add_argument("--model", default="glm45-air-8l-shape")
    p.add_argument("--device", default="cuda", help="cpu: a check of the script")
    p.add_argument("--prefill-worker", action="store_true", help="see the module docstring")
    p.add_argument("--json")
    args = p.parse_args(argv)
    values = engine_config(args.k, args.input_len, args.attention_backend, args.model, args.device)
    if args.prefill_worker:
        values = engine_config(
            args.k, args.input_len, args.attention_backend, args.model, args.device, "prefill"
        )
        vocab = load_hf_config(args.model)[0].vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(1, vocab, (args.input_len,), generator=g).tolist()
            for _ in range(args.prompts + 1)
        ]
        rows = prefill_worker_ttft(args, values, prompts)
        for row in rows:
            row |= {"k": args.k, "input_len": args.input_len, "device": device_name(args)}
        roofline.print_table(list(rows[0]), [list(r.values()) for r in rows])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return {"rows": rows}
    config = EngineConfig.from_dict(values)
    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    engine = LLMEngine(config)
    proposer = engine.runner.speculator.proposer
    spent: list[float] = []
    proposer.propose = timed_propose(proposer, spent, sync)
    params = SamplingParams(
        max_tokens=2,  # drafts follow a token that does not end it
        temperature=0.0,
        ignore_eos=True,
    )
    g = torch.Generator().manual_seed(0)
    vocab = engine.hf_config.vocab_size
    ttft, drafter = [], []
    for i in range(args.prompts + 1):  # the first one warms up
        prompt = torch.randint(1, vocab, (args.input_len,), generator=g).tolist()
        spent.clear()
        start = time.perf_counter()
        engine.add_request(f"p{i}", prompt, params)
        first, drafting = None, 0.0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first, drafting = time.perf_counter() - start, sum(spent)
        if i:
            ttft.append(first * 1e3)
            drafter.append(drafting * 1e3)
    row = {
        "k": args.k,
        "input_len": args.input_len,
        "ttft_ms": statistics.median(ttft),
        "drafter_ms": statistics.median(drafter),
        "attention_backend": args.attention_backend,
        "device": device_name(args),
    }
    row["drafter_share"] = row["drafter_ms"] / row["ttft_ms"]
    roofline.print_table(list(row), [list(row.values())])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return row


if __name__ == "__main__":
    main()
