"""GPU model steps of a Qwen3-8B-shaped model (random bf16 weights) against the roofline.

    python benchmarks/model_step.py [--quick] [--json PATH]

Measured in one run, on one GPU, after measuring its copy bandwidth and bf16
GEMM rate:

- decode steps at batch 1, 8 and 64 with 1k tokens of context each, through
  the decode CUDA graphs, against the memory floor ``(weight bytes + KV bytes)
  / copy bandwidth``; batch 1 also eagerly (graphs against eager);
- a 4096-token prefill against the compute floor ``FLOPs / GEMM rate``;
- prefill steps (one prompt) and mixed steps (a prompt chunk beside 8 decodes
  at 1k context) of 16 to 256 tokens, piecewise graphs against eager.

A step is timed from building its inputs to its logits and greedy tokens
(CUDA events, median), so host work that is not hidden behind the GPU counts.
The forward (the graph replay) with the LM head of the sampled rows, calls
queued back to back, is reported beside it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gaps import gpu_gaps, print_gaps  # noqa: E402
from roofline import (  # noqa: E402
    copy_bandwidth_gbps,
    device_slug,
    environment,
    gemm_tflops,
    plot_ratios,
    print_table,
    time_cuda_ms,
    write_report,
)

from splitserve.config import (  # noqa: E402
    CacheConfig,
    CudaGraphConfig,
    EngineConfig,
    KernelConfig,
    SchedulerConfig,
)
from splitserve.workers.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch  # noqa: E402

MODEL = "qwen3-8b-shape"
CONTEXT = 1024
DECODE_BATCHES = (1, 8, 64)
PIECEWISE_SIZES = (16, 32, 64, 128, 256)
MIXED_DECODES = 8
PREFILL_TOKENS = 4096


@dataclass
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_bytes: int  # every weight a forward reads (the embedding table only by row)
    linear_params: int  # parameters of the per-token matmuls, LM head excluded

    def kv_bytes(self, tokens: int, elem: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem * tokens

    def prefill_flops(self, tokens: int) -> float:
        """Matmuls of every token, causal attention, the LM head of the last token."""
        pairs = tokens * (tokens + 1) / 2
        attention = 4 * pairs * self.heads * self.head_dim * self.layers
        return 2 * self.linear_params * tokens + attention + 2 * self.vocab * self.hidden


def model_shape(engine: LLMEngine) -> Shape:
    model = engine.runner.model
    c = engine.hf_config
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= embed.numel() * embed.element_size()
    if c.tie_word_embeddings:  # the tied LM head reads the whole table
        weights += embed.numel() * embed.element_size()
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    return Shape(
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        model.head_dim,
        c.vocab_size,
        weights,
        linear,
    )


def bench_engine(
    kv_cache_gb: float, kernels: KernelConfig | None = None, max_num_seqs: int = 64
) -> LLMEngine:
    """The benchmarks' engine: MODEL with random bf16 weights on the GPU, prefix caching
    off, up to ``max_num_seqs`` requests (decode graphs 1, 2, 4, 8, then every 16) and
    PREFILL_TOKENS tokens a step; ``kernels``: the config's kernel choices (default: the
    measured best)."""
    return LLMEngine(
        EngineConfig(
            model=MODEL,
            dtype="bfloat16",
            device="cuda",
            load_format="dummy",
            cache=CacheConfig(kv_cache_memory_gb=kv_cache_gb, enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=PREFILL_TOKENS, max_model_len=8192
            ),
            cuda_graph=CudaGraphConfig(prefill_sizes=list(PIECEWISE_SIZES)),
            kernels=kernels or KernelConfig(),
        )
    )


class StepBench:
    """Times hand-made steps through the engine's model runner over its KV cache."""

    def __init__(self, engine: LLMEngine, seed: int = 0):
        self.engine = engine
        self.runner = engine.runner
        self.block_size = engine.kv_cache.block_size
        self._next_block = 1
        self.gen = torch.Generator().manual_seed(seed)
        for layer in range(engine.kv_cache.layout.num_layers):
            for t in engine.kv_cache.layer(layer):
                t[1:].normal_()  # random KV, never zeros; the null page stays zero

    def reset_blocks(self) -> None:
        """Hand out the cache's blocks from the start again (earlier steps are done)."""
        self._next_block = 1

    def blocks(self, tokens: int) -> list[int]:
        n = -(-tokens // self.block_size)
        start, self._next_block = self._next_block, self._next_block + n
        if self._next_block > self.engine.kv_cache.num_blocks:
            raise ValueError("benchmark KV cache too small")
        return list(range(start, start + n))

    def tokens(self, n: int) -> list[int]:
        vocab = self.engine.hf_config.vocab_size
        return torch.randint(1, vocab, (n,), generator=self.gen).tolist()

    def decode_steps(self, batch: int) -> list[StepRequest]:
        return [
            StepRequest(self.tokens(1), CONTEXT, self.blocks(CONTEXT + 1), sample=True)
            for _ in range(batch)
        ]

    def prefill_step(self, tokens: int) -> list[StepRequest]:
        return [StepRequest(self.tokens(tokens), 0, self.blocks(tokens), sample=True)]

    @torch.inference_mode()
    def step(self, steps: list[StepRequest], use_graphs: bool) -> list[int]:
        """Inputs -> forward -> logits of the sampled rows -> greedy tokens on the host.

        The host waits for the tokens, as the engine's sampler does, so host
        work that the GPU does not hide counts.
        """
        runner = self.runner
        fb = build_forward_batch(
            steps, runner.kv_cache, runner.attn_backend, runner.device, plan=False
        )
        hidden = runner.forward(fb, use_graphs=use_graphs)
        return runner.model.compute_logits(fb.sampled_hidden(hidden)).argmax(-1).tolist()

    def time_step(self, steps: list[StepRequest], use_graphs: bool, repeat: int) -> float:
        return time_cuda_ms(lambda: self.step(steps, use_graphs), warmup=3, repeat=repeat)

    @torch.inference_mode()
    def time_forward(self, steps: list[StepRequest], use_graphs: bool, repeat: int) -> float:
        """The forward and the LM head of the sampled rows, calls queued back to back
        (the GPU-bound figure: every weight the floor counts is read)."""
        runner = self.runner
        fb = build_forward_batch(
            steps, runner.kv_cache, runner.attn_backend, runner.device, plan=False
        )

        def forward() -> torch.Tensor:
            hidden = runner.forward(fb, use_graphs=use_graphs)
            return runner.model.compute_logits(fb.sampled_hidden(hidden))

        return time_cuda_ms(forward, 3, repeat)


def profile_step(
    bench: StepBench,
    steps: list[StepRequest],
    title: str,
    use_graphs: bool = False,
    trace: Path | None = None,
) -> None:
    """GPU time per kernel of one step (eager: a graph replays the same kernels), where
    the GPU waits between them (``gpu_gaps``), and with ``trace`` a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        bench.step(steps, use_graphs=use_graphs)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        bench.step(steps, use_graphs=use_graphs)
    print(f"\nGPU kernels of one {'graph' if use_graphs else 'eager'} step: {title}")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    )
    print_gaps(gpu_gaps(prof))
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--json", help="report path (default docs/perf/model_step_<gpu>.json)")
    parser.add_argument("--kv-cache-gb", type=float, default=24.0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print the GPU kernels of eager batch-1 and batch-64 decode steps and a "
        "4096-token prefill",
    )
    parser.add_argument("--trace-dir", help="with --profile: write Chrome traces there")
    parser.add_argument("--profile-only", action="store_true", help="--profile, then stop")
    args = parser.parse_args()
    repeat = 5 if args.quick else 20
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_gbps(device)
    gemm = gemm_tflops(device)
    print(f"copy bandwidth {bandwidth:.0f} GB/s, bf16 GEMM {gemm:.0f} TFLOP/s")

    engine = bench_engine(args.kv_cache_gb)
    shape = model_shape(engine)
    bench = StepBench(engine)
    report = {
        **environment("python benchmarks/model_step.py" + (" --quick" if args.quick else "")),
        "model": MODEL,
        "attention_backend": engine.runner.attn_backend.name,
        "copy_bandwidth_gbps": round(bandwidth, 1),
        "gemm_tflops": round(gemm, 1),
        "weight_bytes": shape.weight_bytes,
    }

    if args.profile or args.profile_only:
        traces = Path(args.trace_dir) if args.trace_dir else None

        def trace(name: str) -> Path | None:
            return None if traces is None else traces / f"{name}.json"

        profile_step(bench, bench.decode_steps(1), "decode, batch 1", trace=trace("decode_b1"))
        profile_step(
            bench, bench.decode_steps(64), "decode, batch 64", True, trace("decode_b64_graph")
        )
        profile_step(bench, bench.decode_steps(64), "decode, batch 64", trace=trace("decode_b64"))
        profile_step(
            bench,
            bench.prefill_step(PREFILL_TOKENS),
            f"prefill, {PREFILL_TOKENS} tokens",
            trace=trace("prefill"),
        )
        if args.profile_only:
            return
        bench.reset_blocks()

    decode_rows, labels, ratios = [], [], []
    for batch in DECODE_BATCHES:
        steps = bench.decode_steps(batch)
        floor_ms = (shape.weight_bytes + shape.kv_bytes(batch * (CONTEXT + 1))) / bandwidth / 1e6
        graph_ms = bench.time_step(steps, True, repeat)
        forward_ms = bench.time_forward(steps, True, repeat)
        eager_ms = bench.time_step(steps, False, repeat) if batch == 1 else None
        decode_rows.append(
            {
                "batch": batch,
                "context": CONTEXT,
                "floor_ms": round(floor_ms, 3),
                "graph_ms": round(graph_ms, 3),
                "ratio_to_floor": round(graph_ms / floor_ms, 3),
                "forward_ms": round(forward_ms, 3),
                "forward_ratio_to_floor": round(forward_ms / floor_ms, 3),
                "eager_ms": None if eager_ms is None else round(eager_ms, 3),
                "graph_speedup": None if eager_ms is None else round(eager_ms / graph_ms, 2),
            }
        )
        labels.append(f"decode b{batch}")
        ratios.append(graph_ms / floor_ms)
    print("\nDecode step (inputs -> logits -> greedy tokens), 1k context per request")
    print_table(
        [
            "batch",
            "floor ms",
            "step ms",
            "step / floor",
            "forward ms",
            "forward / floor",
            "eager step ms",
            "graphs speed-up",
        ],
        [
            [
                r["batch"],
                r["floor_ms"],
                r["graph_ms"],
                r["ratio_to_floor"],
                r["forward_ms"],
                r["forward_ratio_to_floor"],
                r["eager_ms"],
                r["graph_speedup"],
            ]
            for r in decode_rows
        ],
    )

    steps = bench.prefill_step(PREFILL_TOKENS)
    prefill_ms = bench.time_step(steps, True, max(3, repeat // 4))
    flops = shape.prefill_flops(PREFILL_TOKENS)
    prefill_floor = flops / gemm / 1e9
    prefill = {
        "tokens": PREFILL_TOKENS,
        "tflop": round(flops / 1e12, 2),
        "floor_ms": round(prefill_floor, 3),
        "ms": round(prefill_ms, 3),
        "ratio_to_floor": round(prefill_ms / prefill_floor, 3),
    }
    labels.append(f"prefill {PREFILL_TOKENS}")
    ratios.append(prefill_ms / prefill_floor)
    print(f"\nPrefill of {PREFILL_TOKENS} tokens (eager above the largest piecewise size)")
    print_table(
        ["tokens", "TFLOP", "floor ms", "ms", "ratio to floor"],
        [
            [
                prefill["tokens"],
                prefill["tflop"],
                prefill["floor_ms"],
                prefill["ms"],
                prefill["ratio_to_floor"],
            ]
        ],
    )

    piecewise_rows = []
    for kind in ("prefill", "mixed"):
        for size in PIECEWISE_SIZES:
            if kind == "prefill":
                steps = bench.prefill_step(size)
            else:
                steps = bench.prefill_step(size - MIXED_DECODES) + bench.decode_steps(MIXED_DECODES)
            graph_ms = bench.time_step(steps, True, repeat)
            eager_ms = bench.time_step(steps, False, repeat)
            piecewise_rows.append(
                {
                    "step": kind,
                    "tokens": size,
                    "piecewise_ms": round(graph_ms, 3),
                    "eager_ms": round(eager_ms, 3),
                    "speedup": round(eager_ms / graph_ms, 2),
                }
            )
    print("\nPiecewise CUDA graphs against eager (prefill: one prompt; mixed: chunk + 8 decodes)")
    print_table(
        ["step", "tokens", "piecewise ms", "eager ms", "speed-up"],
        [
            [r["step"], r["tokens"], r["piecewise_ms"], r["eager_ms"], r["speedup"]]
            for r in piecewise_rows
        ],
    )

    report.update(decode=decode_rows, prefill=prefill, piecewise=piecewise_rows)
    path = Path(args.json or f"docs/perf/model_step_{device_slug(report['device'])}.json")
    write_report(path, report)
    plot_ratios(
        path.with_suffix(".png"), labels, ratios, f"{MODEL} steps, ratio to the floor", 1.10
    )
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
