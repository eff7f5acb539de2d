"""The idle-gap summary of a profiled step, on hand-made profiler events."""

from types import SimpleNamespace

from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

from benchmarks.gpu_gaps import gpu_gaps


def _event(name, start, end, device=DeviceType.CUDA, id=0, linked=0):
    return SimpleNamespace(
        name=name,
        time_range=Interval(start, end),
        device_type=device,
        id=id,
        linked_correlation_id=linked,
    )


def _prof(events):
    return SimpleNamespace(events=lambda: events)


def test_gaps_busy_and_launcher():
    host = [
        _event("step", 0, 200, DeviceType.CPU, id=1),
        _event("aten::mm", 10, 20, DeviceType.CPU, id=2),
        _event("sample", 100, 150, DeviceType.CPU, id=3),
        _event("cudaLaunchKernel", 120, 121, DeviceType.CPU, id=7),
    ]
    gpu = [
        _event("gemm", 30, 60),
        _event("norm", 50, 70),  # overlaps the gemm: busy counts the union
        _event("topk", 130, 140, linked=7),
    ]
    summary = gpu_gaps(_prof(host + gpu), min_us=5)
    assert summary["span_us"] == 140
    assert summary["busy_us"] == 50  # 30-70 and 130-140
    assert summary["idle_us"] == 90
    first, second = sorted(summary["gaps"], key=lambda g: g.start_us)
    assert (first.start_us, first.length_us, first.before, first.after) == (
        0,
        30,
        "(step start)",
        "gemm",
    )
    assert (second.length_us, second.before, second.after) == (60, "norm", "topk")
    assert second.launched_by == "sample"  # the innermost non-runtime op at the launch
    assert summary["gaps"][0] is second  # largest first


def test_no_gpu_events():
    assert gpu_gaps(_prof([_event("x", 0, 1, DeviceType.CPU)]))["gaps"] == []
