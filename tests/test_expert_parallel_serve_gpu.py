"""Expert parallelism served on GPUs: ``-m gpu``.

- 4 GPUs: an EP2 prefill engine (GPUs 0, 1) hands each prompt's KV over NCCL to an EP2
  decode engine (GPUs 2, 3), from the rank that prefilled to the rank that decodes
  (tickets name the decode rank: ``decode/1``; rank 1's rendezvous goes through rank
  0); greedy tokens equal transformers'.
- 4 GPUs, served: an EP2 prefill worker and an EP2 decode worker with decode graphs on
  (dispatch through the ranks' shared buffers); the decode group's rank 1 killed
  mid-stream ends both streams with a clear error soon after, and the prefill group
  keeps no KV block (``test_expert_parallel_serve.killed_decode_rank_ends_its_streams``).
- 2 GPUs of at least 130 GB (nvidia-h200-x2): the GLM-4.5-Air shape (110B parameters,
  random bf16 weights), which does not fit one GPU, served by ``splitserve serve`` as
  one EP2 mixed worker (``configs/serve/bench/glm45-air-ep2-mixed1.yaml``): it answers,
  and both ranks' experts computed tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from splitserve.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
)
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.parallel.rank_owner import split_owner
from tests import checkpoints
from tests.serve_harness import one_prefill_one_decode_config, serving
from tests.test_disaggregation import Handoff
from tests.test_engine import NEW_TOKENS, _hf_greedy, _prompts
from tests.test_expert_parallel_serve import killed_decode_rank_ends_its_streams

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


class OnDevice:
    """An engine whose calls run with its own GPU current (two engines share the test's
    process; each rank 0 would own its process when served)."""

    def __init__(self, engine: LLMEngine, index: int):
        self._engine, self._index = engine, index

    def __getattr__(self, name: str):
        value = getattr(self._engine, name)
        if not callable(value):
            return value

        def on_device(*args, **kwargs):
            with torch.cuda.device(self._index):
                return value(*args, **kwargs)

        return on_device


def _gpus_with(memory_gb: float) -> int:
    count = torch.cuda.device_count()
    sizes = [torch.cuda.get_device_properties(i).total_memory / 1e9 for i in range(count)]
    return sum(size >= memory_gb for size in sizes)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_ep2_prefill_hands_kv_to_the_decode_rank_over_nccl(tmp_path):
    path = checkpoints.write_glm4_moe(tmp_path)
    prompts = _prompts(checkpoints.VOCAB_SIZE, [37, 61, 29, 50], seed=21)

    def config(role: str, device: str) -> EngineConfig:
        return EngineConfig(
            model=str(path), device=device, role=role,
            cache=CacheConfig(num_kv_blocks=128),
            scheduler=SchedulerConfig(max_model_len=256, async_scheduling=False),
            kv_transfer=KVTransferConfig(transport="nccl", timeout_s=60.0, auth_key="ep-test"),
            parallel=ParallelConfig(expert_parallel_size=2),
        )  # fmt: skip

    with torch.cuda.device(2):
        decode = LLMEngine(config("decode", "cuda:2"), owner="decode")

    def rendezvous(ticket, pair_key: str, unique_id: bytes) -> None:
        worker, rank = split_owner(ticket.owner)
        assert worker == "decode"
        decode.join_kv_pair(pair_key, unique_id, rank)

    with torch.cuda.device(0):
        prefill = LLMEngine(config("prefill", "cuda:0"), owner="prefill", rendezvous=rendezvous)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        run = Handoff(OnDevice(prefill, 0), OnDevice(decode, 2))
        for i, prompt in enumerate(prompts):
            run.submit(f"r{i}", prompt, greedy)
        run.run(timeout=300.0)
    finally:
        prefill.close()
        decode.close()
    assert {t.owner for t in run.tickets.values()} == {"decode", "decode/1"}
    assert [run.tokens[f"r{i}"] for i in range(len(prompts))] == _hf_greedy(path, prompts)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_killed_decode_rank_on_gpus_ends_its_streams_and_leaks_nothing(tmp_path):
    num_blocks = 64
    config = one_prefill_one_decode_config(checkpoints.write_glm4_moe(tmp_path), num_blocks, 512)
    config["engine"].update(
        device="cuda", dtype="bfloat16", parallel={"expert_parallel_size": 2},
        cuda_graph={"enabled": True}, kv_transfer={"transport": "nccl", "timeout_s": 60},
    )  # fmt: skip
    config["drain_timeout_s"] = 5.0
    with serving(config, tmp_path) as server:
        killed_decode_rank_ends_its_streams(server, num_blocks)


@pytest.mark.skipif(_gpus_with(130) < 2, reason="needs 2 GPUs of 130 GB or more (H200)")
def test_glm45_air_shape_is_served_across_two_gpus(tmp_path):
    config = yaml.safe_load((ROOT / "configs/serve/bench/glm45-air-ep2-mixed1.yaml").read_text())
    with serving(config, tmp_path, startup_s=1200.0) as server:
        body = {"prompt": list(range(1000, 1100)), "max_tokens": 16, "ignore_eos": True}
        status, resp = server.post("/v1/completions", {**body, "temperature": 0})
        assert status == 200, resp
        assert resp["usage"]["completion_tokens"] == 16
        per_rank = [0.0, 0.0]
        for name, value in server.metrics().items():
            hit = re.match(r'splitserve_expert_tokens_total\{.*rank="(\d)"', name)
            if hit:
                per_rank[int(hit.group(1))] += value
        assert all(count > 0 for count in per_rank), per_rank
