"""Decode tokens/s with MTP speculative decoding (K = 1, 2, 3) against without, on one GPU.

    python benchmarks/spec_decode.py [--batches 1 8 32] [--ks 0 1 2 3]
        [--alphas 0.6 0.85 1.0] [--steps 48] [--prompt-len 512] [--json PATH]

The model has GLM-4.5-Air's shape with random bf16 weights (``load_format: dummy``):
hidden 4096, 96 query and 8 KV heads of 128, 128 routed experts (top 8) and a shared
one, vocab 151,552, one MTP layer; but 8 decoder layers instead of 46, so that one
80 GB GPU holds it (about 43 GB). Every step runs through ``LLMEngine.step`` with CUDA
graphs on (decode graphs for decode and verify steps, the drafter's graphs for its first pass
and chained steps).

Random weights make the drafter almost never right, so acceptance is set, honestly
labelled: with ``alpha``, each drafted token is replaced by the target's own next token
with probability alpha when it is verified (SIMULATED acceptance: the drafter and the
verify forward run at full cost on the drafter's tokens; only the accept decision is
simulated: ``speculative_config.simulated_acceptance``). ``alpha = real`` is the random
drafter's own acceptance. Every row, table and JSON says which.

Per (K, batch, alpha): ``batch`` requests of ``--prompt-len`` random tokens are
prefilled, 3 steps warm up, then ``--steps`` steps are timed; tokens/s counts every
token the requests emitted in them. The speedup is against K = 0 at the same batch.
Each (K, batch) first runs once untimed (graph capture, kernel compiles).

The floor: the bytes a step must read (``step_floor_bytes``: weights, the experts
its tokens route to, the KV once) over the copy bandwidth measured in the same run,
for the tokens the step emitted. Dummy weights route uniformly at random, so a step
of ``t`` tokens touches ``E (1 - (1 - k/E)^t)`` experts a layer: a verify step of
``1 + K`` tokens a request reads up to ``1 + K`` times the experts of a decode step,
and the MTP layer (a MoE layer with its own 1.2 GB vocabulary head) runs ``K``
times. ``bound`` is the floor's speedup: what K would reach over K = 0 were both
steps at their floors, at this acceptance under random routing (real routers pick
correlated experts for neighbouring tokens, which lowers a verify step's bytes). A
measured speedup can pass it where the K = 0 step sits further above its floor than
the K step does (batch 1: K = 0 at about 1.3x its floor).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gaps import gpu_gaps, print_gaps  # noqa: E402
from roofline import (  # noqa: E402
    command_line,
    copy_bandwidth_gbps,
    environment,
    print_table,
    write_report,
)

from splitserve.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from splitserve.sampling_params import SamplingParams  # noqa: E402
from splitserve.workers.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.workers.model.tokenizer import save_tiny_tokenizer  # noqa: E402

GLM_45_AIR_SHAPE = {
    "model_type": "glm4_moe",
    "architectures": ["Glm4MoeForCausalLM"],
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 8,  # 46 in GLM-4.5-Air: fewer so that one GPU holds it
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "use_qk_norm": False,
    "attention_bias": True,
    "partial_rotary_factor": 0.5,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 151329,
    "bos_token_id": 151329,
    "pad_token_id": 151329,
}
WARMUP_STEPS = 3


def expected_experts(shape: dict, tokens: int) -> float:
    """Distinct routed experts ``tokens`` tokens touch in one layer, routing uniformly."""
    e, k = shape["n_routed_experts"], shape["num_experts_per_tok"]
    return e * (1 - (1 - k / e) ** tokens)


def layer_bytes(shape: dict, tokens: int, dense: bool, width: int = 2) -> float:
    """Weight bytes one decoder layer reads for a step of ``tokens`` tokens."""
    h, d = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    attention = h * (q + 2 * kv) + q * h
    if dense:
        return width * (attention + 3 * h * shape["intermediate_size"])
    expert = 3 * h * shape["moe_intermediate_size"]
    experts = shape["n_shared_experts"] + expected_experts(shape, tokens)
    return width * (attention + experts * expert + h * shape["n_routed_experts"])


def step_floor_bytes(shape: dict, batch: int, k: int, context: int, width: int = 2) -> float:
    """Bytes a step of ``batch`` requests must read: the target over ``batch (1 + k)``
    tokens, the KV of ``context`` tokens a request once, the MTP layer's first pass over
    the same tokens and its ``k - 1`` chained passes over ``batch`` tokens."""
    h, n = shape["hidden_size"], shape["num_hidden_layers"]
    head = width * h * shape["vocab_size"]
    kv_token = width * 2 * shape["num_key_value_heads"] * shape["head_dim"]
    tokens = batch * (1 + k)
    dense = shape["first_k_dense_replace"]
    target = sum(layer_bytes(shape, tokens, i < dense) for i in range(n)) + head
    total = target + batch * context * kv_token * n
    if k:
        mtp = lambda t: width * 2 * h * h + layer_bytes(shape, t, False) + head  # noqa: E731
        total += mtp(tokens) + (k - 1) * mtp(batch) + batch * context * kv_token * k
    return total


def model_dir() -> Path:
    """A checkpoint directory without weights: the config and a tokenizer."""
    path = Path(tempfile.mkdtemp(prefix="glm45-air-shape-"))
    (path / "config.json").write_text(json.dumps(GLM_45_AIR_SHAPE))
    save_tiny_tokenizer(path)
    return path


def make_engine(path: Path, k: int, max_batch: int, max_model_len: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="bfloat16",
            device="cuda",
            load_format="dummy",
            cache=CacheConfig(kv_cache_memory_gb=8, enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=max_batch, max_num_batched_tokens=4096, max_model_len=max_model_len
            ),
            speculative_config=SpeculativeConfig("mtp", k) if k else None,
        )
    )


def simulate_acceptance(engine: LLMEngine, alpha: float | None) -> None:
    """Benchmark only: at verification each draft becomes the target's own next token
    with probability ``alpha`` (the forwards already ran on the drafter's tokens; the
    engine's ``speculative_config.simulated_acceptance``); None: the drafter's own."""
    engine.runner.speculator.rejection_sampler.simulated_acceptance = alpha


def time_decode(engine: LLMEngine, batch: int, prompt_len: int, steps: int, profiler=None) -> dict:
    """Prefill ``batch`` prompts, warm up, then time ``steps`` decode steps (inside
    ``profiler``, a ``torch.profiler.profile`` not yet entered, when given)."""
    vocab = engine.hf_config.vocab_size
    k = engine.config.num_speculative_tokens
    params = SamplingParams(
        max_tokens=(steps + WARMUP_STEPS + 2) * (k + 1), temperature=0.0, ignore_eos=True
    )
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(1, vocab, (prompt_len,)).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefill: every request has its first token
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(WARMUP_STEPS):
        engine.step()
    drafts, accepted = engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens
    torch.cuda.synchronize()
    with profiler or contextlib.nullcontext():
        tokens, start = 0, time.perf_counter()
        for _ in range(steps):
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        seconds = time.perf_counter() - start
    drafts = engine.spec_stats.num_draft_tokens - drafts
    accepted = engine.spec_stats.num_accepted_tokens - accepted
    for rid in ids:
        engine.abort_request(rid)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "tokens_per_request_step": tokens / (steps * batch),
        "acceptance_rate": accepted / drafts if drafts else None,
    }


def profile_steps(engine: LLMEngine, batch: int, prompt_len: int, title: str) -> None:
    """GPU time per kernel over two decode steps, and where the GPU waited for the host
    (``gpu_gaps``: span, busy, idle, the largest gaps and what launched the next kernel)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])
    time_decode(engine, batch, prompt_len, 2, profiler=prof)
    print(f"\nprofile of two decode steps, {title}")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    print(table)
    print_gaps(gpu_gaps(prof, top=16))


def acceptance_label(alpha: str, k: int) -> str:
    if k == 0:
        return "none"
    return "real (random drafter)" if alpha == "real" else f"simulated alpha={alpha}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument(
        "--alphas", nargs="+", default=["0.6", "0.85", "1.0"], help="floats, or 'real'"
    )
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--json", help="write the rows and the environment here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each timed (K, batch, alpha): the GPU kernels of two steps and where the "
        "GPU waited between them (host time)",
    )
    args = parser.parse_args()
    path = model_dir()
    max_model_len = args.prompt_len + (args.steps + WARMUP_STEPS + 4) * (max(args.ks) + 1)
    bandwidth = copy_bandwidth_gbps("cuda") * 1e9
    rows, baseline, floor_baseline = [], {}, {}
    for k in sorted(args.ks):
        engine = make_engine(path, k, max(args.batches), max_model_len)
        warmed: set[int] = set()
        for alpha in ["-"] if k == 0 else args.alphas:
            if k:
                simulate_acceptance(engine, None if alpha == "real" else float(alpha))
            for batch in args.batches:
                if batch not in warmed:  # graph capture and kernel compiles, untimed
                    time_decode(engine, batch, args.prompt_len, WARMUP_STEPS)
                    warmed.add(batch)
                result = time_decode(engine, batch, args.prompt_len, args.steps)
                context = args.prompt_len + (WARMUP_STEPS + args.steps // 2) * (k + 1)
                floor_s = step_floor_bytes(GLM_45_AIR_SHAPE, batch, k, context) / bandwidth
                floor_tok_s = result["tokens_per_request_step"] * batch / floor_s
                if k == 0:
                    baseline[batch], floor_baseline[batch] = result["tok_per_s"], floor_tok_s
                step_s = result["seconds"] / args.steps
                rows.append(
                    {
                        "k": k,
                        "batch": batch,
                        "acceptance": acceptance_label(alpha, k),
                        "speedup": result["tok_per_s"] / baseline[batch],
                        "step_ms": 1e3 * step_s,
                        "floor_step_ms": 1e3 * floor_s,
                        "vs_floor": step_s / floor_s,
                        "bound": floor_tok_s / floor_baseline[batch],
                        **result,
                    }
                )
                print(rows[-1], flush=True)
                if args.profile:
                    profile_steps(engine, batch, args.prompt_len, f"K={k} batch={batch} {alpha}")
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    columns = [
        "K",
        "batch",
        "acceptance",
        "accept rate",
        "tokens/req/step",
        "ms/step",
        "floor ms",
        "vs floor",
        "tok/s",
        "speedup",
        "bound",
    ]
    print_table(
        columns,
        [
            [
                r["k"],
                r["batch"],
                r["acceptance"],
                r["acceptance_rate"],
                r["tokens_per_request_step"],
                r["step_ms"],
                r["floor_step_ms"],
                r["vs_floor"],
                r["tok_per_s"],
                r["speedup"],
                r["bound"],
            ]
            for r in rows
        ],
    )
    print("acceptance marked 'simulated': drafts replaced by the target's token with prob alpha")
    print(f"floor: bytes a step must read / {bandwidth / 1e9:.0f} GB/s (copy, measured); bound:")
    print("the speedup over K = 0 were both steps at their floors (random routing: a verify")
    print("step touches more experts)")
    if args.json:
        payload = {
            "environment": environment(command_line("spec_decode.py")),
            "model": GLM_45_AIR_SHAPE,
            "acceptance_note": "simulated: each draft replaced by the target's own next token "
            "with probability alpha at verification; forwards at full cost",
            "copy_bandwidth_gbps": bandwidth / 1e9,
            "rows": rows,
        }
        write_report(args.json, payload)


if __name__ == "__main__":
    main()
