"""Decode steps while the batch grows across the decode-attention switch, against the
same batches held steady.

    python benchmarks/decode_ramp.py [--low 56] [--high 96] [--steps-each 3]
                                     [--context 2048] [--split-kv-max-batch N] [--json [PATH]]

A served decode worker's batch grows a request at a time while prompts arrive, and its
steps cross ``kernels.split_kv_max_batch`` (the Triton split-KV decode up to it,
FlashInfer's above) with the same requests live. In the 1P1D runs of 2026-11-27 the
steps just above the switch took 2.7 ms more than with one kernel throughout
(docs/perf/HISTORY.md). This asks whether the engine's model runner shows it without
serving: the Qwen3-8B shape (random bf16 weights, decode graphs), --high requests of
--context tokens each,

- ramp: --low of them, then one more every --steps-each steps up to --high, the same
  requests throughout (the first --low cross the switch live);
- steady: each of those batches on its own, --steps-each steps after as many warm-up
  steps.

A step is timed from its inputs to its greedy tokens on the host (``StepBench.step``).
Prints ramp against steady by batch bucket (1, 2, 4, 8, then every 16: the graphs'
sizes); ``--json`` writes ``decode_ramp_<device>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_step import StepBench, bench_engine  # noqa: E402
from roofline import command_line, device_slug, environment, print_table, write_report  # noqa: E402

from splitserve.config import KernelConfig  # noqa: E402
from splitserve.workers.engine.step_times import batch_bucket  # noqa: E402
from splitserve.workers.runner.input_batch import StepRequest  # noqa: E402


def live_requests(bench: StepBench, count: int, context: int) -> list[StepRequest]:
    """``count`` decoding requests of ``context`` tokens each, their own blocks."""
    return [
        StepRequest(bench.tokens(1), context, bench.blocks(context + 1), sample=True)
        for _ in range(count)
    ]


def _timed_step(bench: StepBench, steps: list[StepRequest], use_graphs: bool) -> float:
    start = time.perf_counter()
    bench.step(steps, use_graphs)
    return (time.perf_counter() - start) * 1e3


def ramp(
    bench: StepBench, requests: list[StepRequest], low: int, steps_each: int, use_graphs: bool
) -> list[tuple[int, float]]:
    """``(batch, ms)`` of each step: ``requests[:low]``, then one more request every
    ``steps_each`` steps, up to all of them."""
    return [
        (batch, _timed_step(bench, requests[:batch], use_graphs))
        for batch in range(low, len(requests) + 1)
        for _ in range(steps_each)
    ]


def steady(
    bench: StepBench, requests: list[StepRequest], low: int, steps_each: int, use_graphs: bool
) -> list[tuple[int, float]]:
    """``(batch, ms)`` of ``steps_each`` steps at each batch from ``low`` up, each after
    as many untimed steps of that batch."""
    timed = []
    for batch in range(low, len(requests) + 1):
        live = requests[:batch]
        for _ in range(steps_each):
            bench.step(live, use_graphs)
        timed += [(batch, _timed_step(bench, live, use_graphs)) for _ in range(steps_each)]
    return timed


def by_bucket(ramped: list[tuple[int, float]], held: list[tuple[int, float]]) -> list[dict]:
    """Mean ms a step of each batch bucket, ramp against steady."""
    rows = []
    for edge in sorted({batch_bucket(b) for b, _ in ramped}):
        r = [ms for b, ms in ramped if batch_bucket(b) == edge]
        s = [ms for b, ms in held if batch_bucket(b) == edge]
        rows.append(
            {
                "bucket": edge,
                "steps": len(r),
                "ramp_ms": statistics.fmean(r),
                "steady_ms": statistics.fmean(s),
                "ramp_over_steady": statistics.fmean(r) / statistics.fmean(s),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--low", type=int, default=56)
    parser.add_argument("--high", type=int, default=96)
    parser.add_argument("--steps-each", type=int, default=3)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=float, default=40.0)
    parser.add_argument("--split-kv-max-batch", type=int, help="default: the config's")
    parser.add_argument("--json", nargs="?", const="", default=None)
    args = parser.parse_args()
    kernels = KernelConfig()
    if args.split_kv_max_batch is not None:
        kernels = KernelConfig(split_kv_max_batch=args.split_kv_max_batch)
    engine = bench_engine(args.kv_cache_gb, kernels, max(64, args.high))
    bench = StepBench(engine)
    requests = live_requests(bench, args.high, args.context)
    ramped = ramp(bench, requests, args.low, args.steps_each, use_graphs=True)
    held = steady(bench, requests, args.low, args.steps_each, use_graphs=True)
    rows = by_bucket(ramped, held)
    split = getattr(engine.runner.attn_backend, "split_kv_max_batch", None)
    print(f"\nDecode steps, ms, {args.context} tokens a request, split-KV up to {split}:")
    keys = ["bucket", "steps", "ramp_ms", "steady_ms", "ramp_over_steady"]
    print_table(["batch <=", "steps", "ramp ms", "steady ms", "ramp / steady"], [
        [row[k] for k in keys] for row in rows
    ])  # fmt: skip
    if args.json is not None:
        report = {
            **environment(command_line("decode_ramp.py")),
            "split_kv_max_batch": split,
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "buckets": rows,
            "ramp": ramped,
            "steady": held,
        }
        path = args.json or f"decode_ramp_{device_slug(report['device'])}.json"
        write_report(path, report)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
