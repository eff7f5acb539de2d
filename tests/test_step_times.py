"""The engine loop's steps by kind and batch (``workers/engine/step_times.py``), their
Prometheus counters, and ``serve_bench``'s decode rate from them
(``benchmarks/serve_steps.py``)."""

from __future__ import annotations

import functools
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks import serve_bench, serve_engine, serve_process, serve_steps
from splitserve import LLM, SamplingParams
from splitserve.cluster.metrics import PoolCollector
from splitserve.cluster.ports import free_port
from splitserve.workers.engine.messages import WorkerStats
from splitserve.workers.engine.step_times import StepTimes, batch_bucket, step_kind


def test_kind_and_bucket_of_a_step():
    assert [step_kind(4, n) for n in (0, 1, 4)] == ["decode", "mixed", "prefill"]
    edges = {n: batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 96, 97)}
    assert edges == {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 32, 96: 96, 97: 112}


def test_step_times_sum_steps_requests_context_and_seconds_by_kind_and_bucket():
    times = StepTimes()
    times.record(90, 0, 90 * 2100, 0.013, 0.011)
    times.record(96, 0, 96 * 2100, 0.014, 0.012)
    times.record(96, 3, 93 * 2100 + 3 * 1000, 0.060, 0.058)
    times.record(2, 2, 2000, 0.045)  # no wait given: none
    assert times.rows() == [
        ["decode", 96, 2, 186, 186 * 2100, pytest.approx(0.027), pytest.approx(0.023)],
        ["mixed", 96, 1, 96, 93 * 2100 + 3000, 0.060, 0.058],
        ["prefill", 2, 1, 2, 2000, 0.045, 0.0],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one request"):
        times.record(0, 0, 0, 0.001)
    with pytest.raises(ValueError, match="at most all of them"):
        times.record(2, 3, 10, 0.001)


def test_an_engine_step_says_how_many_requests_it_ran_and_how_many_computed_prompts():
    """Two prompts, the second longer than the step's budget (chunked): a prefill step,
    a mixed one (the first decodes while the second's chunk goes on), then decodes."""
    llm = LLM(
        "qwen3-tiny",
        device="cpu",
        scheduler={"max_num_batched_tokens": 16, "max_num_seqs": 4},
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(5, 11)), params)  # 6 tokens
    engine.add_request("b", list(range(20, 40)), params)  # 20 tokens: 10 now, 10 next step
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.last_step
        steps.append((s.num_requests, s.num_prompt_requests, s.num_context_tokens))
        assert 0 <= s.wait_seconds <= s.seconds  # the read-back's wait is part of the step
    # a: 6 prompt tokens, then one a step; b: 10 of its 20, the other 10, then one a step
    assert steps[:4] == [(2, 2, 6 + 10), (2, 1, 7 + 20), (2, 0, 8 + 21), (2, 0, 9 + 22)]
    assert all(prompting == 0 for _, prompting, _ in steps[2:])


def test_a_step_counts_its_wait_for_the_devices_tokens(monkeypatch):
    """The read-back's wait is the step's ``wait_seconds``: here the tokens come 30 ms
    late (as a device still computing would give them), and every step that read one
    back counts those 30 ms of its time; the rest is the host's."""
    from splitserve.workers.runner.model_runner import LaunchedStep

    result = LaunchedStep.result

    def late_result(self):
        time.sleep(0.03)
        return result(self)

    monkeypatch.setattr(LaunchedStep, "result", late_result)
    llm = LLM("qwen3-tiny", device="cpu", scheduler={"max_num_seqs": 2})
    engine = llm.engine
    engine.add_request("a", list(range(5, 11)), SamplingParams(max_tokens=4, ignore_eos=True))
    waits = []
    while engine.has_unfinished_requests():
        engine.step()
        waits.append((engine.last_step.wait_seconds, engine.last_step.seconds))
    assert len(waits) >= 4
    assert all(0.03 <= wait <= seconds for wait, seconds in waits)


def test_step_times_are_counters_by_pool_kind_and_batch():
    def stats(rows) -> dict:
        return WorkerStats("decode", 1, step_times=rows).as_dict()

    snapshot = {
        "d1": (
            "decode",
            stats([["decode", 96, 10, 950, 9500, 0.14, 0.125], ["decode", 8, 2, 14, 140, 0.01, 0]]),
        ),
        "d2": ("decode", stats([["decode", 96, 5, 480, 4800, 0.07, 0.0625]])),
        "p1": ("prefill", stats([["prefill", 1, 3, 3, 30, 0.15, 0.1]])),
    }
    registry = CollectorRegistry()
    registry.register(PoolCollector(snapshot))
    text = generate_latest(registry).decode()
    labels = '{batch="96",kind="decode",pool="decode"}'
    assert f"splitserve_engine_steps_total{labels} 15.0" in text
    assert f"splitserve_engine_step_requests_total{labels} 1430.0" in text
    assert f"splitserve_engine_step_context_tokens_total{labels} 14300.0" in text
    assert f"splitserve_engine_step_seconds_total{labels} 0.21" in text
    assert f"splitserve_engine_step_wait_seconds_total{labels} 0.1875" in text
    assert 'splitserve_engine_steps_total{batch="1",kind="prefill",pool="prefill"} 3.0' in text
    # what serve_bench reads back from the same text, buckets in numeric order
    rows = serve_steps.step_times(serve_process.parse_metrics(text))
    assert [(r["pool"], r["kind"], r["batch"]) for r in rows] == [
        ("decode", "decode", 8), ("decode", "decode", 96), ("prefill", "prefill", 1),
    ]  # fmt: skip
    assert rows[1] == {
        "pool": "decode", "kind": "decode", "batch": 96,
        "steps": 15.0, "requests": 1430.0, "context_tokens": 14300.0,
        "seconds": pytest.approx(0.21), "wait_seconds": pytest.approx(0.1875),
    }  # fmt: skip


def _row(pool, kind, batch, steps, requests, seconds, context=2048, wait=0.0) -> dict:
    keys = {"pool": pool, "kind": kind, "batch": batch}
    counts = {"steps": steps, "requests": requests, "context_tokens": requests * context}
    return keys | counts | {"seconds": seconds, "wait_seconds": wait}


def test_a_runs_steps_are_the_difference_of_two_reads():
    before = [_row("decode", "decode", 96, 10, 960, 0.13, wait=0.125)]
    after = [
        _row("decode", "decode", 96, 30, 2880, 0.40, wait=0.375),
        _row("decode", "mixed", 96, 2, 192, 0.1),
    ]
    assert serve_steps.difference(before, after) == [
        _row("decode", "decode", 96, 20, 1920, pytest.approx(0.27), wait=0.25),
        _row("decode", "mixed", 96, 2, 192, 0.1),
    ]
    assert serve_steps.difference(after, after) == []
    # a server without the wait counter: no wait, rather than a wait of 0
    old = [{k: v for k, v in row.items() if k != "wait_seconds"} for row in after]
    d = serve_steps.decode_against_engine(serve_steps.difference([], old), None)
    assert d["wait_s"] is None and d["buckets"][0]["wait_ms"] is None
    assert d["served_s"] == pytest.approx(0.40)


def test_the_engine_alones_step_is_moved_to_the_context_then_linear_in_the_batch():
    engine = {
        "decode_step_ms_by_batch": {"1": 6.0, "16": 7.5, "96": 13.5},
        "decode_context_by_batch": {"1": 2400, "16": 2300, "96": 2100},
        "decode_ms_per_context_token": 1e-5,  # a request's context token
    }
    at = functools.partial(serve_steps.engine_step_ms, engine)
    assert at(1, 2400) == 6.0
    assert at(96, 2100) == 13.5 and at(96, 2600) == pytest.approx(13.5 + 96 * 500 * 1e-5)
    assert at(8.5, 2400) == pytest.approx(6.0 + 0.5 * (7.5 + 16 * 100 * 1e-5 - 6.0))
    assert at(56, 2100) == pytest.approx((7.5 - 16 * 200 * 1e-5 + 13.5) / 2)
    assert at(120, 2100) == 13.5  # beyond: the nearest one's
    assert serve_steps.engine_step_ms({"decode_step_ms_by_batch": {"8": 5.0}}, 4, 9999) == 5.0


def test_served_decode_steps_are_compared_bucket_by_bucket_with_the_engine_alone():
    engine = {
        "decode_batch": 96,
        "decode_step_ms_by_batch": {"16": 8.0, "96": 12.0},
        "decode_context_by_batch": {"16": 2048, "96": 2048},
    }
    steps = [
        _row("decode", "decode", 16, 10, 160, 0.1, wait=0.0625),  # 16 a step, 10 ms (alone: 8)
        _row("decode", "decode", 96, 100, 9400, 1.3, wait=1.25),  # 94 a step, 13 ms (alone: 11.9)
        _row("decode", "mixed", 96, 10, 960, 0.6),  # not a decode step: not compared
        _row("prefill", "prefill", 4, 10, 40, 2.0),
    ]
    d = serve_steps.decode_against_engine(steps, engine)
    assert (d["pool"], d["steps"]) == ("decode", 110)
    small, top = d["buckets"]
    assert (small["mean_batch"], small["step_ms"]) == (16, pytest.approx(10.0))
    assert (small["wait_ms"], top["wait_ms"]) == (pytest.approx(6.25), pytest.approx(12.5))
    assert d["wait_s"] == pytest.approx(1.3125)  # of the decode steps' 1.4 s
    assert small["served_vs_engine"] == pytest.approx(0.8)
    assert top["mean_batch"] == 94 and top["engine_step_ms"] == pytest.approx(11.9)
    assert top["served_vs_engine"] == pytest.approx(11.9 / 13.0)
    assert d["at_batch"] == top
    assert d["served_s"] == pytest.approx(1.4)
    assert d["served_vs_engine"] == pytest.approx((10 * 8.0 + 100 * 11.9) / 1e3 / 1.4)
    # the engine's own batch never reached: all decode steps compared, no "at batch"
    assert serve_steps.decode_against_engine(steps[:1], engine)["at_batch"] is None
    # no decode step: nothing; no engine alone (or no timings by batch): the served alone
    assert serve_steps.decode_against_engine(steps[2:], engine) is None
    for no_engine in (None, {"decode_batch": 96}):
        served = serve_steps.decode_against_engine(steps, no_engine)
        assert [b["step_ms"] for b in served["buckets"]] == pytest.approx([10.0, 13.0])
        assert served["served_s"] == pytest.approx(1.4) and served["steps"] == 110
        assert served["engine_s"] is served["served_vs_engine"] is served["at_batch"] is None
        assert all(b["engine_step_ms"] is b["served_vs_engine"] is None for b in served["buckets"])
    # a mixed pool only: its decode steps are compared
    mixed = [_row("mixed", "decode", 96, 4, 384, 0.06)]
    assert serve_steps.decode_against_engine(mixed, engine)["pool"] == "mixed"
    share = serve_steps.loop_time_by_kind(steps, "decode")
    assert share["mixed"]["share"] == pytest.approx(0.6 / 2.0)
    assert sum(v["share"] for v in share.values()) == pytest.approx(1.0)


def test_the_engine_alone_times_decode_steps_at_smaller_batches_too():
    assert serve_engine.smaller_batches(96) == [80, 64, 48, 32, 16, 8, 1]
    assert serve_engine.smaller_batches(2) == [1]
    assert serve_engine.smaller_batches(1) == []
    llm = LLM("qwen3-tiny", device="cpu", scheduler={"max_num_seqs": 20})
    prompts = [[3 + i, 5, 8, 13, 21] for i in range(20)]
    timed = serve_engine.decode_step(llm, prompts, [4] * 20)  # past max_tokens: none ends
    assert timed["decode_batch"] == 20
    assert list(timed["decode_step_ms_by_batch"]) == ["1", "8", "16", "20"]
    assert timed["decode_step_ms_by_batch"]["20"] == timed["decode_step_ms"]
    assert all(ms > 0 for ms in timed["decode_step_ms_by_batch"].values())
    # the batch built up, each timed near the prompts' length: the first request alone
    # for 16 steps (its 5-token prompt and first token, then one more a step), then 8,
    # 16 and 20 of them (each new one joins at 6); 32 untimed steps (half the longest
    # output, at least 32) come only after the last timing that is kept
    context = timed["decode_context_by_batch"]
    assert context["1"] == pytest.approx(5 + 1 + 7.5)
    assert context["1"] < context["8"] < context["16"] < context["20"] < 5 + 1 + 5 * 16
    assert serve_engine.context_steps([4, 1024, 256]) == 512
    assert serve_engine.context_steps([4]) == serve_engine.DECODE_STEPS
    assert timed["decode_ms_per_context_token"] >= 0
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_usable_blocks


def test_a_runs_counters_come_from_one_metrics_read_and_none_without_a_server():
    text = "\n".join(
        [
            'splitserve_requests_total{outcome="ok",route="disaggregated"} 4.0',
            'splitserve_requests_total{outcome="error",route="local_short"} 1.0',
            'splitserve_engine_steps_total{batch="2",kind="decode",pool="decode"} 7.0',
            'splitserve_forwards_total{how="eager",kind="decode",pool="decode"} 7.0',
        ]
    )
    values = serve_process.parse_metrics(text)
    assert serve_process.route_counts_of(values) == {
        '{outcome="ok",route="disaggregated"}': 4.0,
        '{outcome="error",route="local_short"}': 1.0,
    }
    # no server answers: nothing counted, no error (a --url server without /metrics)
    port = free_port()
    assert serve_bench.settled_counters(f"http://127.0.0.1:{port}") == {"routes": {}, "steps": []}
