"""Where the GPU waits during a profiled step: idle gaps between its kernels.

``gpu_gaps(prof)`` reads a ``torch.profiler`` result: the step's span runs from
its first host op to the end of its last GPU activity; busy time is the union
of the kernels, copies and memsets; a gap is a stretch with none of them. The
largest gaps are listed with the activity before and after each and the host
op that launched the one after (where the host fell behind).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.autograd import DeviceType


@dataclass
class Gap:
    start_us: float  # from the step's first host op
    length_us: float
    before: str
    after: str
    launched_by: str  # the innermost host op around the launch of ``after``


def _name(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _innermost(host_ops: list, t: float) -> str:
    """The shortest host op whose span holds ``t``, runtime calls (``cuda*``, ``cu*``)
    left out: the op that issued a launch made at ``t``."""
    around = [
        op
        for op in host_ops
        if op.time_range.start <= t <= op.time_range.end and not op.name.startswith("cu")
    ]
    return min(around, key=lambda op: op.time_range.elapsed_us()).name if around else "-"


def gpu_gaps(prof, top: int = 8, min_us: float = 5.0) -> dict:
    """Span, busy and idle microseconds of the profiled step, and its ``top`` largest
    gaps of at least ``min_us`` (each a ``Gap``)."""
    events = prof.events()
    gpu = sorted(
        (e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    host = [e for e in events if e.device_type == DeviceType.CPU]
    if not gpu or not host:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
    begin = min(e.time_range.start for e in host)
    by_id = {e.id: e for e in host if e.name.startswith("cu")}  # launches, by correlation
    busy, gaps, end, last = 0.0, [], begin, None
    for e in gpu:
        r = e.time_range
        if r.start > end and r.start - end >= min_us:
            launcher = by_id.get(getattr(e, "linked_correlation_id", 0))
            at = launcher.time_range.start if launcher is not None else r.start
            gaps.append(
                Gap(
                    end - begin,
                    r.start - end,
                    _name(last.name) if last else "(step start)",
                    _name(e.name),
                    _name(_innermost(host, at)),
                )
            )
        busy += max(0.0, r.end - max(r.start, end))
        if r.end > end:
            end, last = r.end, e
    span = end - begin
    gaps.sort(key=lambda g: g.length_us, reverse=True)
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "gaps": gaps[:top]}


def print_gaps(summary: dict) -> None:
    span, busy, idle = summary["span_us"], summary["busy_us"], summary["idle_us"]
    print(
        f"step span {span / 1e3:.3f} ms: GPU busy {busy / 1e3:.3f} ms, "
        f"idle {idle / 1e3:.3f} ms ({idle / max(span, 1e-9):.1%})"
    )
    for g in summary["gaps"]:
        print(
            f"  gap {g.length_us:8.1f} us at {g.start_us / 1e3:8.3f} ms: "
            f"{g.before} -> {g.after} (launched in {g.launched_by})"
        )
