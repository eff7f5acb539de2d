"""Time to first token: disaggregated prefill (KV over NCCL, layer by layer) vs prefill alone.

Two Ray actors on two GPUs. The prefill actor holds a mixed engine (the
baseline: the prompt computed and its first token sampled, nothing sent) and a
prefill engine whose step streams each layer's KV to the decode actor's engine
while later layers compute. Disaggregated TTFT runs from adding the request
on the prefill side to the decode engine having the KV and the first token.
Median of several fresh prompts (prefix caching off), after warm-up.

    python benchmarks/disagg_ttft.py --model qwen3-8b-shape --prompt-len 4096 --json [--sync]

Every engine runs with async scheduling unless ``--sync`` (then the report is
``disagg_ttft_sync.json``).
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from pathlib import Path

import ray
import torch

from splitserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _config(args, role: str) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        role=role,
        cache=CacheConfig(
            block_size=16, kv_cache_memory_gb=args.kv_gb, enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.prompt_len + 16,
            max_model_len=args.prompt_len + 64,
            async_scheduling=not args.sync,
        ),
        kv_transfer=KVTransferConfig(transport="nccl", timeout_s=120, auth_key=args.auth_key),
    )


class Decode:
    def __init__(self, args):
        self.engine = LLMEngine(_config(args, "decode"), owner="decode")

    def join(self, pair_key: str, unique_id: bytes) -> None:
        self.engine.kv_transport.join(pair_key, unique_id)

    def reserve(self, rid: str, prompt: list[int]) -> bytes:
        self.engine.add_remote_request(rid, prompt, ONE_TOKEN)
        while True:
            for out in self.engine.step():
                if out.kv_ticket is not None:
                    return out.kv_ticket

    def wait_first_token(self, rid: str) -> float:
        """Wall time at which the KV and the first token are in place here."""
        while True:
            for out in self.engine.step():
                if out.request_id == rid and out.new_token_ids:
                    torch.cuda.synchronize()
                    return time.time()
            if not self.engine.has_runnable_requests():
                time.sleep(50e-6)  # leave the GIL to the transport's threads, as a server does


class Prefill:
    def __init__(self, args, decode):
        self.decode = decode
        rendezvous = lambda ticket, key, uid: ray.get(decode.join.remote(key, uid))
        self.alone = LLMEngine(_config(args, "mixed"))
        self.engine = LLMEngine(_config(args, "prefill"), owner="prefill", rendezvous=rendezvous)

    def ttft_alone(self, rid: str, prompt: list[int]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.alone.add_request(rid, prompt, ONE_TOKEN)
        while not any(out.new_token_ids for out in self.alone.step()):
            pass
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def start_disaggregated(self, rid: str, prompt: list[int], ticket: bytes) -> float:
        """Add the request and run its prefill step; returns the start wall time."""
        torch.cuda.synchronize()
        start = time.time()
        request = self.engine.add_request(rid, prompt, ONE_TOKEN, kv_ticket=ticket)
        while not request.output_token_ids:  # the prompt's step, then its token read back
            self.engine.step()  # (two calls with async scheduling)
        return start

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()
            time.sleep(0.0005)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b-shape")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-gb", type=float, default=8.0)
    p.add_argument("--json", action="store_true", help="write docs/perf/disagg_ttft.json")
    p.add_argument(
        "--sync", action="store_true", help="async scheduling off in every engine (on by default)"
    )
    args = p.parse_args()
    args.auth_key = secrets.token_hex(16)  # both actors' KV control plane
    ray.init(log_to_driver=True)
    decode = ray.remote(num_gpus=1, max_concurrency=4)(Decode).remote(args)  # join runs beside
    prefill = ray.remote(num_gpus=1)(Prefill).remote(args, decode)
    g = torch.Generator().manual_seed(0)
    alone, disagg = [], []
    for i in range(args.repeats + 2):  # the first two warm up (NCCL init, allocator)
        prompt = torch.randint(1000, 100000, (args.prompt_len,), generator=g).tolist()
        t_alone = ray.get(prefill.ttft_alone.remote(f"a{i}", prompt))
        ticket = ray.get(decode.reserve.remote(f"d{i}", prompt))
        arrived = decode.wait_first_token.remote(f"d{i}")
        start = ray.get(prefill.start_disaggregated.remote(f"d{i}", prompt, ticket))
        t_disagg = ray.get(arrived) - start
        ray.get(prefill.drain.remote())
        if i >= 2:
            alone.append(t_alone)
            disagg.append(t_disagg)
    a, d = statistics.median(alone), statistics.median(disagg)
    rows = {
        "prompt_tokens": args.prompt_len,
        "ttft_prefill_alone_ms": a * 1e3,
        "ttft_disaggregated_ms": d * 1e3,
        "overhead": d / a - 1,
        "samples_alone_ms": [x * 1e3 for x in alone],
        "samples_disaggregated_ms": [x * 1e3 for x in disagg],
        "async_scheduling": not args.sync,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "?",
    }
    print(f"{'prompt tokens':>14} {'alone ms':>10} {'disagg ms':>10} {'overhead':>9}")
    print(f"{args.prompt_len:>14} {a * 1e3:>10.2f} {d * 1e3:>10.2f} {100 * (d / a - 1):>8.2f}%")
    if args.json:
        name = "disagg_ttft_sync.json" if args.sync else "disagg_ttft.json"
        out = Path(__file__).resolve().parent.parent / "docs" / "perf" / name
        out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
