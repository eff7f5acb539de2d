"""An engine's steps read out of its torch.profiler trace: host against device, by batch.

    python benchmarks/trace_steps.py TRACE [TRACE ...] [--kernels-at BATCH] [--json PATH]

A trace is what an engine writes between the server's ``POST /start_profile`` and
``/stop_profile`` (``splitserve serve --torch-profiler-dir``; ``serve_bench.py
--torch-profiler-dir`` profiles each load point's first run). Each engine step is a
range there (``engine_step[<kind> b<requests>]``, ``workers/engine/torch_profiler.py``);
the device work a step launched is found through the CUDA runtime calls inside the
range (kernels, copies and graph replays carry the call's correlation id). For each
kind and batch bucket (1, 2, 4, 8, then every 16) the table gives, a step's mean:

- host ms: the range, the host's work to launch the step;
- device ms: from the step's first kernel's start to its last one's end;
- busy ms: its kernels' own time (the rest of the device span is idle within it);
- gap ms: from the step before's last kernel to this one's first (the device idle
  between steps: the host was late);
- NCCL %: of the device span, the share with an NCCL kernel of another stream
  running (a KV receive or send, which takes SMs from the step).

``--kernels-at BATCH`` lists that bucket's kernels by their mean time a step, one
column a trace (say, the same load under two configs), and its host operators (the
outermost torch operators inside the step's range: on a CPU engine, the forward's
own pieces).
"""

from __future__ import annotations

import argparse
import bisect
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import print_table, write_report  # noqa: E402

from splitserve.workers.engine.step_times import batch_bucket  # noqa: E402
from splitserve.workers.engine.torch_profiler import STEP_RANGE, read_trace  # noqa: E402

STEP_NAME = re.compile(rf"^{STEP_RANGE}\[(\w+) b(\d+)\]$")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass
class Step:
    kind: str
    batch: int
    start_us: float
    host_us: float
    kernels: list[tuple[str, float, float]] = field(default_factory=list)  # name, ts, dur
    host_ops: list[tuple[str, float]] = field(default_factory=list)  # outermost: name, dur

    @property
    def device_start(self) -> float:
        return min(ts for _, ts, _ in self.kernels)

    @property
    def device_end(self) -> float:
        return max(ts + dur for _, ts, dur in self.kernels)


def steps_of(events: list[dict]) -> list[Step]:
    """The trace's engine steps in order, each with the device work it launched."""
    steps, ranges = [], []
    for e in events:
        host_range = e.get("ph") == "X" and e.get("cat") == "user_annotation"
        match = STEP_NAME.match(e.get("name", "")) if host_range else None
        if match:
            steps.append(Step(match[1], int(match[2]), e["ts"], e["dur"]))
            ranges.append((e["ts"], e["ts"] + e["dur"], e["tid"]))
    order = sorted(range(len(steps)), key=lambda i: steps[i].start_us)
    steps, ranges = [steps[i] for i in order], [ranges[i] for i in order]
    within = _StepRanges(ranges)
    step_of_call: dict[int, Step] = {}
    for e in events:
        if e.get("cat") in RUNTIME_CATEGORIES and "correlation" in e.get("args", {}):
            i = within.step_of(e)
            if i is not None:
                step_of_call[e["args"]["correlation"]] = steps[i]
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            step = step_of_call.get(e.get("args", {}).get("correlation"))
            if step is not None:
                step.kernels.append((e["name"], e["ts"], e["dur"]))
    _add_host_ops(steps, within, events)
    return steps


class _StepRanges:
    """The steps' host ranges, sorted: which one holds an event of its thread."""

    def __init__(self, ranges: list[tuple[float, float, int]]):
        self.ranges = ranges  # (start, end, thread)
        self.starts = [start for start, _, _ in ranges]

    def step_of(self, event: dict) -> int | None:
        i = bisect.bisect_right(self.starts, event["ts"]) - 1
        if i < 0 or event["ts"] > self.ranges[i][1] or event["tid"] != self.ranges[i][2]:
            return None
        return i


def _add_host_ops(steps: list[Step], within: _StepRanges, events: list[dict]) -> None:
    """Each step's outermost torch operators on its own thread (not those inside
    another)."""
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    outer_end: dict[int, float] = {}  # step index -> where its last outermost op ends
    for e in ops:
        i = within.step_of(e)
        if i is None or e["ts"] < outer_end.get(i, -1.0):
            continue  # in no step, or inside the last outermost one
        outer_end[i] = e["ts"] + e["dur"]
        steps[i].host_ops.append((e["name"], e["dur"]))


def nccl_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """NCCL kernels' spans, merged."""
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()
    )
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap(
    start: float, end: float, intervals: list[tuple[float, float]], starts: list[float]
) -> float:
    """Time in ``[start, end]`` covered by the sorted, disjoint ``intervals`` (``starts``:
    theirs)."""
    i = max(bisect.bisect_right(starts, start) - 1, 0)
    covered = 0.0
    for a, b in intervals[i:]:
        if a >= end:
            break
        covered += max(0.0, min(b, end) - max(a, start))
    return covered


def table_rows(steps: list[Step], nccl: list[tuple[float, float]]) -> list[dict]:
    """Per kind and batch bucket: steps, and a step's mean host, device, busy and gap ms and
    NCCL share (device figures over the steps that launched device work)."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    nccl_starts = [a for a, _ in nccl]
    last_end = None
    for step in steps:
        row = {"host": step.host_us / 1e3}
        if step.kernels:
            start, end = step.device_start, step.device_end
            row["device"] = (end - start) / 1e3
            row["busy"] = sum(dur for _, _, dur in step.kernels) / 1e3
            row["nccl"] = overlap(start, end, nccl, nccl_starts) / max(end - start, 1e-9)
            if last_end is not None:
                row["gap"] = max(0.0, start - last_end) / 1e3
            last_end = end
        groups[step.kind, batch_bucket(step.batch)].append(row)
    rows = []
    for (kind, edge), group in sorted(groups.items()):
        row = {"kind": kind, "batch": edge, "steps": len(group)}
        for key in ("host", "device", "busy", "gap", "nccl"):
            values = [g[key] for g in group if key in g]
            row[f"{key}_ms" if key != "nccl" else "nccl_share"] = (
                statistics.fmean(values) if values else None
            )
        rows.append(row)
    return rows


def kernels_at(steps: list[Step], edge: int, kind: str = "decode") -> dict[str, float]:
    """Mean us a step of ``kind`` in bucket ``edge`` spends in each kernel name."""
    return _mean_at(steps, edge, kind, lambda s: [(n, dur) for n, _, dur in s.kernels])


def host_ops_at(steps: list[Step], edge: int, kind: str = "decode") -> dict[str, float]:
    """Mean us a step of ``kind`` in bucket ``edge`` spends in each outermost operator."""
    return _mean_at(steps, edge, kind, lambda s: s.host_ops)


def _mean_at(steps: list[Step], edge: int, kind: str, items) -> dict[str, float]:
    chosen = [s for s in steps if s.kind == kind and batch_bucket(s.batch) == edge]
    totals: dict[str, float] = defaultdict(float)
    for step in chosen:
        for name, dur in items(step):
            totals[name] += dur
    return {name: t / len(chosen) for name, t in totals.items()} if chosen else {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--kernels-at", type=int, metavar="BATCH", help="a bucket's kernels")
    parser.add_argument("--top", type=int, default=15, help="kernels listed (--kernels-at)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report, kernel_columns, op_columns = {"traces": {}}, {}, {}
    columns = ["kind", "batch", "steps", "host ms", "device ms", "busy ms", "gap ms", "NCCL %"]
    for path in args.traces:
        events = read_trace(path)
        steps = steps_of(events)
        rows = table_rows(steps, nccl_intervals(events))
        print(f"\n{path}: {len(steps)} steps")
        keys = ["kind", "batch", "steps", "host_ms", "device_ms", "busy_ms", "gap_ms"]
        print_table(columns, [
            [r[k] for k in keys] + [None if r["nccl_share"] is None else 100 * r["nccl_share"]]
            for r in rows
        ])  # fmt: skip
        report["traces"][str(path)] = {"buckets": rows}
        if args.kernels_at is not None:
            name = f"{path.parent.name}/{path.name}"  # serve_bench: a folder per config
            kernel_columns[name] = kernels_at(steps, args.kernels_at)
            op_columns[name] = host_ops_at(steps, args.kernels_at)
            report["traces"][str(path)]["kernels_at"] = kernel_columns[name]
            report["traces"][str(path)]["host_ops_at"] = op_columns[name]
    if any(kernel_columns.values()):  # a GPU engine's
        print_means(kernel_columns, f"batch <= {args.kernels_at}: us a step in each kernel",
                    "kernel", args.top)  # fmt: skip
    if args.kernels_at is not None:
        print_means(op_columns, f"batch <= {args.kernels_at}: us a step in each host operator",
                    "operator", args.top)  # fmt: skip
    if args.json:
        write_report(args.json, report)
        print(f"\nwrote {args.json}")


def print_means(columns: dict[str, dict[str, float]], title: str, what: str, top: int) -> None:
    """The ``top`` names (by their largest mean over the traces), one column a trace."""
    names = sorted(
        {n for c in columns.values() for n in c},
        key=lambda n: -max(c.get(n, 0.0) for c in columns.values()),
    )[:top]
    print(f"\nDecode steps at {title}")
    rows = [[name[:70]] + [c.get(name) for c in columns.values()] for name in names]
    rows.append([f"all ({what}s)"] + [sum(c.values()) for c in columns.values()])
    print_table([what, *columns], rows)


if __name__ == "__main__":
    main()
