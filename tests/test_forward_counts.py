"""Forwards counted by step kind and how they ran (``workers/runner/forward_counts.py``),
and their Prometheus counter ``splitserve_forwards_total{pool, kind, how}``.

On CPU every forward is eager (no CUDA graphs): the counts say which kinds of step an
engine ran. The GPU side (graph and piecewise hits) is ``tests/test_cuda_graphs.py``."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.cluster.metrics import PoolCollector
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.messages import WorkerStats
from splitserve.workers.runner.forward_counts import ForwardCounts, merge_rows
from tests.mtp_checkpoints import write_glm4_moe_drafter
from tests.test_spec_decode import engine, prompts


def test_counts_are_rows_by_kind_and_how_and_merge_by_sum():
    counts = ForwardCounts()
    for kind, how in [("decode", "graph"), ("decode", "graph"), ("prefill", "eager")]:
        counts.add(kind, how)
    assert counts.rows() == [["decode", "graph", 2], ["prefill", "eager", 1]]
    other = [["decode", "eager", 3], ["decode", "graph", 1]]
    assert merge_rows(counts.rows(), other) == [
        ["decode", "eager", 3], ["decode", "graph", 3], ["prefill", "eager", 1],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'warmup'"):
        counts.add("warmup", "eager")


def test_an_engine_counts_every_step_s_forward_by_kind(tmp_path):
    """Greedy MTP (K = 2) on CPU: prompts (prefill), verifies of drafts, the drafter's
    passes, all eager; one forward a step, one drafter pass a step and chained draft."""
    eng = engine(write_glm4_moe_drafter(tmp_path / "glm"), k=2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts()[:3]):
        eng.add_request(f"r{i}", prompt, params)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    rows = {(kind, how): n for kind, how, n in eng.runner.forward_rows()}
    assert {how for _, how in rows} == {"eager"}
    assert rows[("prefill", "eager")] >= 1 and rows[("verify", "eager")] >= 1
    target = sum(n for (kind, _), n in rows.items() if kind != "draft")
    assert target == steps
    assert rows[("draft", "eager")] >= 2 * rows[("verify", "eager")]  # first pass + chain


def test_forwards_are_a_counter_per_pool_kind_and_how():
    def stats(rows) -> dict:
        return WorkerStats("decode", 1, forward_counts=rows).as_dict()

    snapshot = {
        "d1": ("decode", stats([["decode", "graph", 90], ["decode", "eager", 10]])),
        "d2": ("decode", stats([["decode", "graph", 5]])),
        "p1": ("prefill", stats([["prefill", "piecewise", 7]])),
    }
    registry = CollectorRegistry()
    registry.register(PoolCollector(snapshot))
    text = generate_latest(registry).decode()
    assert 'splitserve_forwards_total{how="graph",kind="decode",pool="decode"} 95.0' in text
    assert 'splitserve_forwards_total{how="eager",kind="decode",pool="decode"} 10.0' in text
    assert 'splitserve_forwards_total{how="piecewise",kind="prefill",pool="prefill"} 7.0' in text
