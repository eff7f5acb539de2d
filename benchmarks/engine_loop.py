"""Steps through the whole engine loop, async scheduling on against off, vs the roofline.

    python benchmarks/engine_loop.py [--steps N] [--batches B ...] [--json PATH] [--profile]
                                     [--sustained N]

The Qwen3-8B-shaped model of ``model_step.py`` (random bf16 weights, one GPU)
serves real requests through ``LLMEngine.step``: scheduling, inputs, the graph
replay, sampling, stop checks and detokenization, each step's outputs on the
host. Measured, with the same engine, with async scheduling (step i + 1 is
queued before step i's tokens are read back) and without:

- decode at batch 1, 8 and 64 from 1k tokens of context: wall time per step over
  ``--steps`` steps, against the memory floor ``(weight bytes + KV bytes at the
  steps' mean context) / copy bandwidth``. The prompts are prefilled in chunks of
  the step's token budget, so the first requests are a few tokens ahead of the
  last; the mean context is counted from the requests, and every request lasts
  past the timed steps (the batch stays whole);
- back-to-back 4096-token prompts (one a step, one token each): wall time per
  prompt, against the compute floor ``FLOPs / GEMM rate``.

"host ms" is the time ``step()`` itself takes: with async scheduling the host
work it measures overlaps the device's previous step. ``--sustained N`` instead
times N back-to-back prefill forwards one by one, with the GPU's clock.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import clocks_now, describe  # noqa: E402
from gpu_gaps import gpu_gaps, print_gaps  # noqa: E402
from model_step import (  # noqa: E402
    CONTEXT,
    DECODE_BATCHES,
    MODEL,
    PREFILL_TOKENS,
    StepBench,
    bench_engine,
    model_shape,
)
from roofline import (  # noqa: E402
    command_line,
    copy_bandwidth_gbps,
    device_slug,
    environment,
    gemm_tflops,
    print_table,
    write_report,
)

from splitserve.config import KernelConfig  # noqa: E402
from splitserve.kernels.triton import pdl  # noqa: E402
from splitserve.sampling_params import SamplingParams  # noqa: E402
from splitserve.workers.engine.llm_engine import LLMEngine  # noqa: E402
from splitserve.workers.runner.input_batch import build_forward_batch  # noqa: E402

PREFILL_PROMPTS = 6
WARMUP_STEPS = 3  # decode steps run before the timed ones


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class LoopBench:
    def __init__(self, engine: LLMEngine, seed: int = 0):
        self.engine = engine
        self.gen = torch.Generator().manual_seed(seed)
        self._ids = 0

    def add(self, num_prompt_tokens: int, max_tokens: int) -> str:
        vocab = self.engine.hf_config.vocab_size
        prompt = torch.randint(1, vocab, (num_prompt_tokens,), generator=self.gen).tolist()
        rid = f"r{self._ids}"
        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def drain(self) -> None:
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def run_steps(self, n: int) -> tuple[float, float]:
        """Wall and host milliseconds per step over ``n`` steps."""
        host = 0.0
        _synchronize()
        start = time.perf_counter()
        for _ in range(n):
            self.engine.step()
            host += self.engine.last_step.seconds
        _synchronize()
        return (time.perf_counter() - start) * 1e3 / n, host * 1e3 / n

    def decode(self, batch: int, steps: int) -> tuple[float, float, float]:
        """Per-step ms (wall, host) of ``steps`` decode steps of ``batch`` requests from
        CONTEXT tokens, and the mean context a step read (tokens a request).

        The prompts are prefilled in chunks, so the first requests decode while the last
        ones are still prefilling. Every request is given tokens to last past the timed
        steps, so the batch stays whole through them (checked)."""
        chunks = -(-batch * CONTEXT // self.engine.config.scheduler.max_num_batched_tokens)
        for _ in range(batch):
            self.add(CONTEXT, max_tokens=chunks + WARMUP_STEPS + steps + 8)
        while any(not r.output_token_ids for r in self.engine.scheduler.requests.values()):
            self.engine.step()  # the prompts, then their first tokens
        self.run_steps(WARMUP_STEPS)
        before = self._contexts()
        wall, host = self.run_steps(steps)
        after = self._contexts()
        if len(after) != batch:
            raise RuntimeError(f"{batch - len(after)} of {batch} requests ended while timed")
        self.drain()
        return wall, host, (sum(before) + sum(after)) / 2 / batch

    def _contexts(self) -> list[int]:
        """The tokens of each unfinished request (its context at the next step)."""
        return [r.num_tokens for r in self.engine.scheduler.requests.values()]

    def prefill(self, prompts: int) -> tuple[float, float]:
        """Per-prompt ms of ``prompts`` back-to-back PREFILL_TOKENS-token prompts."""
        for _ in range(2):  # warm-up
            self.add(PREFILL_TOKENS, max_tokens=1)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        for _ in range(prompts):
            self.add(PREFILL_TOKENS, max_tokens=1)
        host, steps = 0.0, 0
        torch.cuda.synchronize()
        start = time.perf_counter()
        while self.engine.has_unfinished_requests():
            self.engine.step()
            host += self.engine.last_step.seconds
            steps += 1
        wall = (time.perf_counter() - start) * 1e3 / prompts
        return wall, host * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per batch")
    parser.add_argument(
        "--json",
        help="report path (default docs/perf/engine_loop_<gpu>.json; with --sustained "
        "docs/perf/prefill_sustained_<gpu>.json)",
    )
    parser.add_argument("--kv-cache-gb", type=float, default=24.0)
    parser.add_argument(
        "--sustained",
        type=int,
        default=0,
        metavar="N",
        help="only time N back-to-back prefill forwards, each on its own, after 2 s idle",
    )
    parser.add_argument(
        "--split-kv-max-batch",
        type=int,
        metavar="N",
        help="decode batches up to N run the Triton split-KV attention (the config's "
        "kernels.split_kv_max_batch; default: its default; 0: FlashInfer for every batch)",
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=DECODE_BATCHES,
        help=f"decode batches to time (default {' '.join(map(str, DECODE_BATCHES))}); one "
        "between two graph sizes replays the larger graph, padded",
    )
    parser.add_argument(
        "--pdl",
        choices=["on", "off"],
        help="programmatic dependent launch between the Triton kernels (default: on, "
        "unless SPLITSERVE_PDL=0)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="first print where the GPU waits in async decode (b1, b64) and prefill loops",
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_gbps(device)
    gemm = gemm_tflops(device)
    print(f"copy bandwidth {bandwidth:.0f} GB/s, bf16 GEMM {gemm:.0f} TFLOP/s")
    if args.pdl is not None:
        pdl.set_enabled(args.pdl == "on")
    kernels = KernelConfig()
    if args.split_kv_max_batch is not None:
        kernels = KernelConfig(split_kv_max_batch=args.split_kv_max_batch)
    engine = bench_engine(args.kv_cache_gb, kernels, max(64, *args.batches))
    shape = model_shape(engine)
    bench = LoopBench(engine)
    if args.sustained:
        flops = shape.prefill_flops(PREFILL_TOKENS)
        report = {
            **environment(command_line("engine_loop.py")),
            "model": MODEL,
            "sustained_prefill": sustained_prefill(engine, args.sustained, flops, gemm),
        }
        path = args.json or f"docs/perf/prefill_sustained_{device_slug(report['device'])}.json"
        write_report(path, report)
        print(f"\nwrote {path}")
        return
    if args.profile:
        profile_loops(bench)
    rows = []
    for batch in args.batches:

        def measure(b=batch):
            wall, host, context = bench.decode(b, args.steps)
            kv = shape.kv_bytes(round(b * context))
            return wall, host, (shape.weight_bytes + kv) / bandwidth / 1e6

        rows.append(_row(engine, f"decode b{batch}", measure))
    floor = shape.prefill_flops(PREFILL_TOKENS) / gemm / 1e9
    prefill = lambda: (*bench.prefill(PREFILL_PROMPTS), floor)  # noqa: E731
    rows.append(_row(engine, f"prefill {PREFILL_TOKENS}", prefill))
    print("\nEngine loop: ms per step (prefill: per prompt), async scheduling off / on")
    columns = ["step", "floor ms", "sync ms", "sync / floor", "sync host ms"]
    columns += ["async ms", "async / floor", "async host ms", "async speed-up"]
    keys = ["step", "floor_ms", "sync_ms", "sync_ratio", "sync_host_ms"]
    keys += ["async_ms", "async_ratio", "async_host_ms", "speedup"]
    print_table(columns, [[r[k] for k in keys] for r in rows])
    report = {
        **environment(command_line("engine_loop.py")),
        "model": MODEL,
        "copy_bandwidth_gbps": round(bandwidth, 1),
        "gemm_tflops": round(gemm, 1),
        "decode_steps": args.steps,
        "split_kv_max_batch": getattr(engine.runner.attn_backend, "split_kv_max_batch", None),
        "pdl": pdl.enabled(device),
        "rows": rows,
    }
    path = Path(args.json or f"docs/perf/engine_loop_{device_slug(report['device'])}.json")
    write_report(path, report)
    print(f"\nwrote {path}")


def sustained_prefill(engine: LLMEngine, n: int, flops: float, burst_tflops: float) -> dict:
    """``n`` back-to-back PREFILL_TOKENS-token forwards, each timed by CUDA events, after
    2 s idle, then the GEMM rate with the GPU as hot: each state against its own floor."""
    steps = StepBench(engine).prefill_step(PREFILL_TOKENS)
    runner = engine.runner
    fb = build_forward_batch(steps, engine.kv_cache, runner.attn_backend, runner.device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(n)
    ]
    with torch.inference_mode():
        runner.model(fb.input_ids, fb.positions, fb)  # warm
        torch.cuda.synchronize()
        time.sleep(2.0)
        idle = describe(clocks_now(runner.device.index or 0))
        for start, end in events:
            start.record()
            runner.model(fb.input_ids, fb.positions, fb)
            end.record()
        load = describe(clocks_now(runner.device.index or 0))  # while the forwards run
        torch.cuda.synchronize()
    ms = [round(start.elapsed_time(end), 2) for start, end in events]
    sustained_tflops = gemm_tflops(runner.device, sustain_s=2.0)
    hot = statistics.median(ms[2:])
    rows = [
        ("first after 2 s idle", ms[0], burst_tflops),
        (f"sustained (median of forwards 3-{n})", hot, sustained_tflops),
    ]
    print(f"\nPrefill forwards of {PREFILL_TOKENS} tokens, back to back, ms: {ms}")
    print(f"idle: {idle}; under load: {load}")
    table = [
        [name, t, round(r, 1), round(flops / r / 1e9, 2), round(t * r * 1e9 / flops, 3)]
        for name, t, r in rows
    ]
    print_table(["state", "forward ms", "GEMM TFLOP/s", "floor ms", "ratio"], table)
    return {
        "forward_ms": ms,
        "clocks_idle": idle,
        "clocks_load": load,
        "burst_gemm_tflops": round(burst_tflops, 1),
        "sustained_gemm_tflops": round(sustained_tflops, 1),
        "first_ratio_to_burst_floor": table[0][-1],
        "sustained_ratio_to_sustained_floor": table[1][-1],
    }


def profile_loops(bench: LoopBench) -> None:
    """GPU idle time and its largest gaps over a few async steps of each kind."""
    from torch.profiler import ProfilerActivity, profile

    bench.engine.async_scheduling = True
    loops = {
        "decode b1, 8 steps": lambda: bench.decode(1, 8),
        "decode b64, 8 steps": lambda: bench.decode(64, 8),
        "prefill, 3 prompts": lambda: bench.prefill(3),
    }
    for title, loop in loops.items():
        loop()  # warm
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            loop()
        print(f"\nasync engine loop, {title} (warm-up and set-up steps included)")
        print_gaps(gpu_gaps(prof, top=12))


def _row(engine: LLMEngine, name: str, measure) -> dict:
    """``measure()`` (wall ms, host ms, floor ms) with async scheduling off, then on (the
    same engine, idle between); the floor of the async run is the row's."""
    row = {"step": name}
    for mode in ("sync", "async"):
        engine.async_scheduling = mode == "async"
        wall, host, floor_ms = measure()
        row["floor_ms"] = round(floor_ms, 3)
        row[f"{mode}_ms"] = round(wall, 3)
        row[f"{mode}_ratio"] = round(wall / floor_ms, 3)
        row[f"{mode}_host_ms"] = round(host, 3)
    row["speedup"] = round(row["sync_ms"] / row["async_ms"], 3)
    return row


if __name__ == "__main__":
    main()
