"""Shared measuring helpers of the GPU benchmarks: ceilings, timing, tables, reports.

The ceilings are measured, not taken from a data sheet: ``copy_bandwidth_gbps``
(a device-to-device copy, read + write bytes) is the floor's denominator for
anything bandwidth-bound, ``gemm_tflops`` for anything compute-bound. Timings
are medians of CUDA-event spans after warm-up, on random data.

A benchmark run as a script (``python benchmarks/x.py``) has ``benchmarks/`` on
its path and imports this module as ``roofline``; tests import it as
``benchmarks.roofline``. Nothing runs at import, and the pure parts (tables,
reports, slugs) need no GPU; matplotlib is imported only by ``plot_ratios``.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median

import torch

L2_FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2 (H100 50 MB, B200 126 MB)
HOST_AHEAD_CYCLES = 400_000  # ``time_cuda_ms(host_ahead=True)``: about 0.2 ms at 2 GHz


def time_cuda_ms(
    fn: Callable[[], object],
    warmup: int = 5,
    repeat: int = 20,
    flush_l2: bool = False,
    l2_flush_by: str = "read",
    sync_device: bool = True,
    host_ahead: bool = False,
) -> float:
    """Median milliseconds of one ``fn()``, from CUDA events around each call.

    ``sync_device=False`` waits for the current stream only, before and after: for a
    device with work on another stream that will not end while ``fn`` is timed (a
    posted receive whose sender waits, ``recv_spin.py``).

    ``flush_l2`` empties L2 of useful lines before each timed call (outside the
    span), so ``fn`` reads its inputs from memory, as a layer's weights and KV
    are read in a real forward, rather than from a warm L2 (``evict_l2``).
    ``l2_flush_by="write"`` is the older way, kept to compare: it charges the
    span with the write-back of the flush's own dirty lines.

    ``host_ahead`` holds the GPU (``torch.cuda._sleep``, about 0.2 ms) before each span,
    so that the host has queued ``fn``'s launches when the span starts: a kernel shorter
    than its wrapper's Python is timed alone, not with the host's launch time.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    flush = l2_flush_buffer() if flush_l2 else None
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeat)
    ]
    sync = torch.cuda.synchronize if sync_device else torch.cuda.current_stream().synchronize
    sync()
    for start, end in events:
        if flush is not None:
            evict_l2(flush, by=l2_flush_by)
        if host_ahead:
            torch.cuda._sleep(HOST_AHEAD_CYCLES)
        start.record()
        fn()
        end.record()
    sync()
    return median(start.elapsed_time(end) for start, end in events)


def time_cuda_ms_back_to_back(
    fns: Sequence[Callable[[], object]], warmup: int = 3, repeat: int = 20
) -> float:
    """Median milliseconds per call of ``fns`` replayed back to back from one CUDA graph.

    The steady state of a kernel inside a forward: no host gap between launches,
    and each call pays the write-back of the dirty lines the call before it left
    in L2 (a lone call leaves its own for after its span). Give each ``fn`` its
    own inputs and outputs, together larger than L2, so no call finds another's
    lines there; L2 is emptied (``evict_l2``) before each replay.
    """
    if repeat < 1 or not fns:
        raise ValueError(f"need repeat >= 1 and at least one call, got {repeat}, {len(fns)}")
    for fn in fns:  # compiles, autotunes and allocates outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = time_cuda_ms(graph.replay, warmup=warmup, repeat=repeat, flush_l2=True)
    return ms / len(fns)


def kernel_times_us(
    fn: Callable[[], object], repeat: int = 4, device_type: str = "CUDA"
) -> dict[str, float]:
    """Mean microseconds a call of ``fn`` spends in each kernel, by name, from the profiler
    (CUPTI shows a CUDA graph's replay kernel by kernel), L2 emptied before each call; the
    flush's own kernels are profiled alone and taken off. ``device_type="CPU"`` gives the
    ops' CPU times instead (no flush)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device_type == "CUDA"
    flush = l2_flush_buffer() if cuda else None
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU

    def profiled(call: Callable[[], object]) -> Counter:
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[activity]) as prof:
            for _ in range(repeat):
                if flush is not None:
                    evict_l2(flush)
                call()
            if cuda:
                torch.cuda.synchronize()
        totals: Counter = Counter()
        for event in prof.events():
            if event.device_type.name == device_type:
                totals[event.name] += event.device_time_total if cuda else event.cpu_time_total
        return totals

    totals = profiled(fn)
    totals.subtract(profiled(lambda: None))
    return {name: us / repeat for name, us in totals.items() if us > 0}


def l2_flush_buffer() -> torch.Tensor:
    return torch.ones(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")


def evict_l2(buffer: torch.Tensor, by: str = "read") -> None:
    """Fill L2 with ``buffer``'s lines (larger than any L2), pushing out what was there.

    By reading it: L2 is then full of clean lines, which a timed call evicts for
    free. Writing it (``by="write"``) leaves up to an L2 of dirty lines, whose
    write-back then lands in the next timed span: 0-32 us on an H200 in the KV
    store rows of ``kernels_roofline.py``, which once read as a fixed cost of
    every small kernel.
    """
    if by == "read":
        buffer.amax()
    elif by == "write":
        buffer.fill_(1)
    else:
        raise ValueError(f"evict L2 by 'read' or 'write', got {by!r}")


def copy_bandwidth_gbps(device: torch.device | str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate in GB/s (1e9), counting read + write: ``2 * nbytes / time``."""
    device = torch.device(device)
    with torch.cuda.device(device):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = time_cuda_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def gemm_tflops(
    device: torch.device | str,
    m: int = 8192,
    n: int = 8192,
    k: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
    sustain_s: float = 0.0,
) -> float:
    """Measured dense GEMM rate (``torch.matmul``) in TFLOP/s: ``2 * m * n * k / time``.

    By default a burst of about 40 ms, at the clock of a GPU that was idle.
    ``sustain_s`` first runs GEMMs that long: the rate under sustained load,
    where the power limit lowers the clock.
    """
    device = torch.device(device)
    with torch.cuda.device(device):
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        end = time.perf_counter() + sustain_s
        while time.perf_counter() < end:
            for _ in range(20):
                a @ b
            torch.cuda.synchronize(device)
        ms = time_cuda_ms(lambda: a @ b)
    return 2 * m * n * k / ms / 1e9


def command_line(script: str, path_options: Sequence[str] = ("--json",)) -> str:
    """This run's command, without the paths given to ``path_options`` (machine-specific)."""
    words, argv = [], sys.argv[1:]
    skip = False
    for word in argv:
        if skip and not word.startswith("--"):
            skip = False
            continue
        skip = word in path_options
        words.append(word)
    return " ".join([f"python benchmarks/{script}", *words])


def environment(command: str) -> dict:
    """Where and how a result was measured: device, versions, date, command."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton_version,
            "cuda": torch.version.cuda,
        },
    }


def device_slug(name: str) -> str:
    """A file-name form of a device name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown"


def format_cell(value: object) -> str:
    """A table cell: ``-`` for None, four significant digits for floats (no exponent above 1)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def format_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; columns of numbers (None allowed) are right-aligned."""
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {list(row)} has {len(row)} cells, the table {len(columns)}")
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    numeric = [_is_numeric([r[i] for r in rows]) for i in range(len(columns))]

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric))
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if n else "-" * (w + 2) for w, n in zip(widths, numeric))
        + "|"
    )
    return "\n".join([line(columns), rule, *(line(r) for r in cells)])


def _is_numeric(values: list) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in present
    )


def print_table(columns: list[str], rows: list[list]) -> None:
    """Print ``format_table(columns, rows)`` to stdout."""
    print(format_table(columns, rows), flush=True)


def write_report(path: str | Path, payload: dict) -> None:
    """Write ``payload`` as indented JSON, creating parent folders; NaN and inf become null."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n")


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def plot_ratios(
    path: str | Path,
    labels: Sequence[str],
    ratios: Sequence[float],
    title: str,
    target: float | None = None,
) -> None:
    """A bar chart (PNG) of ratios to the floor, 1.0 marked, with an optional target line."""
    if len(labels) != len(ratios):
        raise ValueError(f"{len(labels)} labels for {len(ratios)} ratios")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(labels) + 2), 4.0))
    values = [r if r is not None and math.isfinite(r) else 0.0 for r in ratios]
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8, label="floor")
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", label=f"target {target:g}")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_ylabel("ratio to floor")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
