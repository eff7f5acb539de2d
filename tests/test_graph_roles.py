"""CUDA graphs by worker role: a prefill worker captures piecewise graphs only, a decode
worker decode (and MTP draft) graphs only, a mixed worker both.

On CPU the runner's choice of graph runners is checked (no graph is captured off a
GPU); on a GPU (``gpu`` marker) the engines capture them, the owner keeps the memory
each runner's graphs took, and a prefill worker's graphs take less than a mixed one's.
"""

from __future__ import annotations

import logging

import pytest
import torch

from splitserve import LLM
from splitserve.config import CudaGraphConfig, EngineConfig, KVTransferConfig
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.runner.cuda_graphs.decode_runner import DecodeGraphRunner
from splitserve.workers.runner.cuda_graphs.draft_runner import DraftGraphRunner
from splitserve.workers.runner.cuda_graphs.piecewise_runner import PiecewiseGraphRunner
from splitserve.workers.runner.cuda_graphs.roles import DECODE, DRAFT, PIECEWISE, graphs_for
from splitserve.workers.runner.model_runner import GraphLimits


@pytest.fixture(scope="module")
def runner():
    llm = LLM("qwen3-tiny", device="cpu", max_model_len=64, block_size=4, num_kv_blocks=64)
    return llm.engine.runner


@pytest.mark.parametrize(
    ("role", "captured"),
    [("prefill", ["piecewise"]), ("decode", ["decode"]), ("mixed", ["decode", "piecewise"])],
)
def test_each_role_registers_only_the_graphs_it_replays(runner, role, captured):
    limits = GraphLimits(CudaGraphConfig(), 8, 64, 64, role)
    owner = runner.graph_owner(limits)
    assert owner.role == role
    assert sorted(r.name for r in owner.runners) == captured
    assert (runner.decode_graphs is not None) == ("decode" in captured)


def test_role_table_names_the_graph_runners():
    assert tuple(r.name for r in (PiecewiseGraphRunner, DecodeGraphRunner, DraftGraphRunner)) == (
        PIECEWISE,
        DECODE,
        DRAFT,
    )
    assert graphs_for("prefill") == {PIECEWISE}
    assert graphs_for("decode") == {DECODE, DRAFT}
    assert graphs_for("mixed") == {PIECEWISE, DECODE, DRAFT}
    with pytest.raises(ValueError, match="unknown worker role 'router'.*prefill, decode, mixed"):
        graphs_for("router")


def _gpu_engine(role: str) -> LLMEngine:
    config = EngineConfig(
        model="qwen3-tiny",
        dtype="bfloat16",
        device="cuda",
        role=role,
        kv_transfer=KVTransferConfig(transport="cpu"),
    )
    config.scheduler.max_model_len = 512
    return LLMEngine(config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prefill_worker_captures_no_decode_graphs_and_saves_their_memory(caplog):
    captured = {}
    with caplog.at_level(logging.INFO):
        for role in ("prefill", "decode", "mixed"):
            engine = _gpu_engine(role)
            captured[role] = dict(engine.runner.graphs.captured_bytes)
            engine.close()
    assert sorted(captured["prefill"]) == ["piecewise"]
    assert sorted(captured["decode"]) == ["decode"]
    assert sorted(captured["mixed"]) == ["decode", "piecewise"]
    assert sum(captured["prefill"].values()) < sum(captured["mixed"].values())
    assert "prefill worker captured" in caplog.text and "MiB" in caplog.text
