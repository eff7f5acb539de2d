"""`benchmarks/trace_steps.py`: an engine's steps out of its torch.profiler trace.

A real CPU engine's trace gives each step's host range (no device work on CPU); the
device arithmetic (a step's kernels through its runtime calls' correlation ids, the gap
between steps, the NCCL share) is checked on a trace in Kineto's format written here."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.trace_steps import (
    host_ops_at,
    kernels_at,
    main,
    nccl_intervals,
    steps_of,
    table_rows,
)
from splitserve import LLM, SamplingParams
from splitserve.workers.engine.torch_profiler import read_trace, step_names


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


# Two decode steps of 70 and 80 requests on the engine's thread (1): each replays a graph
# (correlation 1, 3) and copies its tokens back (2, 4). A KV receive's NCCL kernel runs
# on another stream from 1,150 to 1,250 us; a runtime call of another thread (9) and a
# kernel launched outside any step (5) belong to no step. Kineto repeats a range that
# launched device work on the device's row (``gpu_user_annotation``): not a step.
TRACE = [
    _x("engine_step[decode b70]", "user_annotation", 1000, 100),
    _x("cudaGraphLaunch", "cuda_runtime", 1010, 20, correlation=1),
    _x("cudaMemcpyAsync", "cuda_runtime", 1050, 5, correlation=2),
    _x("engine_step[decode b80]", "user_annotation", 1200, 50),
    _x("engine_step[decode b80]", "gpu_user_annotation", 1300, 100, tid=7),  # its device span
    _x("cudaGraphLaunch", "cuda_runtime", 1210, 20, correlation=3),
    _x("cudaMemcpyAsync", "cuda_runtime", 1240, 5, correlation=4),
    _x("cudaLaunchKernel", "cuda_runtime", 1215, 5, tid=9, correlation=9),
    _x("cudaLaunchKernel", "cuda_runtime", 1300, 5, correlation=5),
    _x("gemm", "kernel", 1040, 60, tid=7, correlation=1),
    _x("attention", "kernel", 1110, 30, tid=7, correlation=1),
    _x("Memcpy DtoH", "gpu_memcpy", 1140, 10, tid=7, correlation=2),
    _x("gemm", "kernel", 1300, 80, tid=7, correlation=3),
    _x("Memcpy DtoH", "gpu_memcpy", 1380, 20, tid=7, correlation=4),
    _x("ncclDevKernel_Recv", "kernel", 1150, 100, tid=8, correlation=6),
    _x("elementwise", "kernel", 1500, 10, tid=7, correlation=5),
    _x("recv_thread_kernel", "kernel", 1220, 10, tid=8, correlation=9),
    # Host operators: an outermost one with one inside it in step 1, one in step 2, one
    # on another thread.
    _x("aten::linear", "cpu_op", 1005, 40),
    _x("aten::mm", "cpu_op", 1006, 30),
    _x("aten::linear", "cpu_op", 1201, 20),
    _x("aten::index", "cpu_op", 1202, 10, tid=9),
]


def test_a_steps_device_work_gap_and_nccl_share_come_from_the_trace():
    assert step_names(TRACE) == ["engine_step[decode b70]", "engine_step[decode b80]"]
    steps = steps_of(TRACE)
    assert [(s.kind, s.batch) for s in steps] == [("decode", 70), ("decode", 80)]
    assert [len(s.kernels) for s in steps] == [3, 2]
    rows = table_rows(steps, nccl_intervals(TRACE))
    assert [(r["batch"], r["steps"]) for r in rows] == [(80, 2)]  # both in bucket 80
    row = rows[0]
    # Step 1: host 100 us, device 1040-1150 (110 us, busy 100); step 2: host 50 us, device
    # 1300-1400 (100 us, busy 100), 150 us after step 1's end. NCCL: 0 of step 1's
    # span (it starts at 1150, the span's end), none of step 2's (it ended at 1250).
    assert row["host_ms"] == pytest.approx(0.075)
    assert row["device_ms"] == pytest.approx(0.105)
    assert row["busy_ms"] == pytest.approx(0.100)
    assert row["gap_ms"] == pytest.approx(0.150)  # one gap: the first step has none before
    assert row["nccl_share"] == pytest.approx(0.0)
    assert kernels_at(steps, 80) == pytest.approx(
        {"gemm": 70.0, "attention": 15.0, "Memcpy DtoH": 15.0}
    )
    assert [s.host_ops for s in steps] == [[("aten::linear", 40)], [("aten::linear", 20)]]
    assert host_ops_at(steps, 80) == pytest.approx({"aten::linear": 30.0})


def test_the_nccl_share_is_the_overlap_with_the_steps_device_span():
    trace = [*TRACE, _x("ncclDevKernel_Recv", "kernel", 1350, 100, tid=8, correlation=8)]
    rows = table_rows(steps_of(trace), nccl_intervals(trace))
    assert rows[0]["nccl_share"] == pytest.approx((0 + 50 / 100) / 2)


def test_a_cpu_engines_trace_gives_each_steps_host_time(tmp_path, capsys):
    llm = LLM("qwen3-tiny", max_model_len=64, torch_profiler_dir=str(tmp_path))
    llm.start_profile()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]] * 5, params, use_tqdm=False)
    path = llm.stop_profile()
    rows = table_rows(steps_of(read_trace(path)), [])
    assert [(r["kind"], r["batch"], r["steps"]) for r in rows] == [
        ("decode", 8, 2),
        ("prefill", 8, 1),
    ]
    assert all(r["host_ms"] > 0 and r["device_ms"] is None for r in rows)
    ops = host_ops_at(steps_of(read_trace(path)), 8)  # the forward's own pieces
    assert {"aten::linear", "aten::scaled_dot_product_attention"} <= set(ops)
    main([path, "--kernels-at", "8", "--json", str(tmp_path / "steps.json")])
    printed = capsys.readouterr().out
    assert "host operator" in printed and "each kernel" not in printed  # none on CPU
    report = json.loads((tmp_path / "steps.json").read_text())
    assert report["traces"][path]["buckets"] == rows
    with gzip.open(path, "rt") as f:  # the trace is Chrome's JSON
        assert "traceEvents" in json.load(f)
