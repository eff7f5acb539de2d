"""`benchmarks/decode_ramp.py`: the ramp grows its batch over the same live requests, and
the report compares it with the same batches held steady, bucket by bucket."""

from __future__ import annotations

import pytest

from benchmarks.decode_ramp import by_bucket, live_requests, ramp, steady
from benchmarks.model_step import StepBench
from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.workers.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def bench() -> StepBench:
    engine = LLMEngine(
        EngineConfig(
            model="qwen3-tiny",
            device="cpu",
            load_format="dummy",
            cache=CacheConfig(block_size=16, num_kv_blocks=4 * 3 + 1),
            scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=128),
        )
    )
    return StepBench(engine)


def test_the_ramp_adds_a_request_every_few_steps_over_the_same_requests(bench):
    requests = live_requests(bench, 4, context=40)  # 41 tokens: 3 blocks each
    assert [len(r.block_ids) for r in requests] == [3] * 4
    assert len({b for r in requests for b in r.block_ids}) == 12  # their own blocks
    ramped = ramp(bench, requests, low=2, steps_each=2, use_graphs=False)
    assert [b for b, _ in ramped] == [2, 2, 3, 3, 4, 4]
    held = steady(bench, requests, low=2, steps_each=2, use_graphs=False)
    assert [b for b, _ in held] == [2, 2, 3, 3, 4, 4]
    assert all(ms > 0 for _, ms in ramped + held)
    assert len(bench.step(requests[:3], use_graphs=False)) == 3  # a token a request


def test_ramp_and_steady_are_compared_by_batch_bucket():
    ramped = [(2, 4.0), (3, 6.0), (4, 6.0), (5, 9.0)]
    held = [(2, 4.0), (3, 4.0), (4, 4.0), (5, 9.0), (5, 9.0)]
    rows = by_bucket(ramped, held)
    assert [(r["bucket"], r["steps"]) for r in rows] == [(2, 1), (4, 2), (8, 1)]
    assert rows[1]["ramp_ms"] == 6.0 and rows[1]["steady_ms"] == 4.0
    assert rows[1]["ramp_over_steady"] == pytest.approx(1.5)
    assert rows[2]["ramp_over_steady"] == pytest.approx(1.0)
