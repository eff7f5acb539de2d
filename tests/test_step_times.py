"""The engine loop's steps by kind and batch (``workers/engine/step_times.py``), their
Prometheus counters, and ``serve_bench``'s decode rate from them
(``benchmarks/serve_steps.py``)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks import serve_process, serve_steps
from splitserve import LLM, SamplingParams
from splitserve.cluster.metrics import PoolCollector
from splitserve.workers.engine.messages import WorkerStats
from splitserve.workers.engine.step_times import StepTimes, batch_bucket, step_kind


def test_kind_and_bucket_of_a_step():
    assert [step_kind(4, n) for n in (0, 1, 4)] == ["decode", "mixed", "prefill"]
    edges = {n: batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 96, 97)}
    assert edges == {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 32, 96: 96, 97: 112}


def test_step_times_sum_steps_requests_and_seconds_by_kind_and_bucket():
    times = StepTimes()
    times.record(90, 0, 0.013)
    times.record(96, 0, 0.014)
    times.record(96, 3, 0.060)
    times.record(2, 2, 0.045)
    assert times.rows() == [
        ["decode", 96, 2, 186, pytest.approx(0.027)],
        ["mixed", 96, 1, 96, 0.060],
        ["prefill", 2, 1, 2, 0.045],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one request"):
        times.record(0, 0, 0.001)
    with pytest.raises(ValueError, match="at most all of them"):
        times.record(2, 3, 0.001)


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
        steps.append((s.num_requests, s.num_prompt_requests))
    assert steps[:3] == [(2, 2), (2, 1), (2, 0)]
    assert all(prompting == 0 for _, prompting in steps[2:])


def test_step_times_are_counters_by_pool_kind_and_batch():
    def stats(rows) -> dict:
        return WorkerStats("decode", 1, step_times=rows).as_dict()

    snapshot = {
        "d1": ("decode", stats([["decode", 96, 10, 950, 0.14], ["decode", 8, 2, 14, 0.01]])),
        "d2": ("decode", stats([["decode", 96, 5, 480, 0.07]])),
        "p1": ("prefill", stats([["prefill", 1, 3, 3, 0.15]])),
    }
    registry = CollectorRegistry()
    registry.register(PoolCollector(snapshot))
    text = generate_latest(registry).decode()
    labels = '{batch="96",kind="decode",pool="decode"}'
    assert f"splitserve_engine_steps_total{labels} 15.0" in text
    assert f"splitserve_engine_step_requests_total{labels} 1430.0" in text
    assert f"splitserve_engine_step_seconds_total{labels} 0.21" in text
    assert 'splitserve_engine_steps_total{batch="1",kind="prefill",pool="prefill"} 3.0' in text
    # what serve_bench reads back from the same text, buckets in numeric order
    rows = serve_steps.step_times(serve_process.parse_metrics(text))
    assert [(r["pool"], r["kind"], r["batch"]) for r in rows] == [
        ("decode", "decode", 8), ("decode", "decode", 96), ("prefill", "prefill", 1),
    ]  # fmt: skip
    assert rows[1] == {
        "pool": "decode", "kind": "decode", "batch": 96,
        "steps": 15.0, "requests": 1430.0, "seconds": pytest.approx(0.21),
    }  # fmt: skip


def _row(pool, kind, batch, steps, requests, seconds) -> dict:
    keys = {"pool": pool, "kind": kind, "batch": batch}
    return keys | {"steps": steps, "requests": requests, "seconds": seconds}


def test_a_runs_steps_are_the_difference_of_two_reads():
    before = [_row("decode", "decode", 96, 10, 960, 0.13)]
    after = [_row("decode", "decode", 96, 30, 2880, 0.40), _row("decode", "mixed", 96, 2, 192, 0.1)]
    assert serve_steps.difference(before, after) == [
        _row("decode", "decode", 96, 20, 1920, pytest.approx(0.27)),
        _row("decode", "mixed", 96, 2, 192, 0.1),
    ]
    assert serve_steps.difference(after, after) == []


def test_the_decode_rate_is_compared_at_the_engine_alones_batch():
    engine = {"decode_batch": 96, "decode_step_ms": 13.0}
    steps = [
        _row("decode", "decode", 64, 50, 3000, 0.5),
        _row("decode", "decode", 96, 100, 9400, 1.4),  # 94 a step, 14 ms each
        _row("decode", "decode", 112, 5, 500, 0.1),
        _row("decode", "mixed", 96, 10, 960, 0.6),
    ]
    d = serve_steps.decode_at_batch(steps, engine)
    assert (d["pool"], d["batch_bucket"], d["steps"]) == ("decode", 96, 100)
    assert d["mean_batch"] == pytest.approx(94.0) and d["step_ms"] == pytest.approx(14.0)
    assert d["tok_s"] == pytest.approx(9400 / 1.4)
    assert d["engine_tok_s"] == pytest.approx(96 / 0.013)
    assert d["served_vs_engine"] == pytest.approx((9400 / 1.4) / (96 / 0.013))
    # no decode step at that batch or above: nothing to compare
    assert serve_steps.decode_at_batch(steps[:1], engine) is None
    # a mixed pool only: its steps are compared
    mixed = [_row("mixed", "decode", 96, 4, 384, 0.06)]
    assert serve_steps.decode_at_batch(mixed, engine)["pool"] == "mixed"
    share = serve_steps.decode_share(steps, "decode")
    assert share["mixed"]["share"] == pytest.approx(0.6 / 2.6)
    assert sum(v["share"] for v in share.values()) == pytest.approx(1.0)
