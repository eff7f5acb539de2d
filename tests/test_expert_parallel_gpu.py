"""Expert parallelism on two GPUs (NCCL): ``-m gpu`` on a host with 2 GPUs.

- DECODE-mode dispatch, experts and combine captured in a CUDA graph replay as the
  eager layer does (bitwise), padding rows and a rank with no tokens included; through
  the ranks' shared buffers (``peer_memory.py``) they equal the NCCL exchange bitwise.
- EP2 bf16 log-probabilities within 1e-2 (relative) of EP1's, one request at a time (so
  each forward batches the same rows in both: a bf16 router flips near-ties when a
  matmul's batch changes).
- Decode graphs with EP: greedy tokens and log-probabilities of graph replays equal the
  eager run's; an idle rank replays padding.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from splitserve import LLM, SamplingParams
from splitserve.workers.parallel.dispatch import DispatchMode
from splitserve.workers.parallel.group import free_address
from tests import checkpoints, ep_ranks
from tests.test_engine import _prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

TOP = 20  # log-probabilities compared per position
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=TOP)


def test_decode_dispatch_replays_as_eager_on_nccl():
    mp.spawn(ep_ranks.graph_case, args=(free_address(),), nprocs=2)


def test_decode_dispatch_through_shared_buffers_equals_nccl():
    mp.spawn(ep_ranks.peer_case, args=(free_address(),), nprocs=2)


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def checkpoint(request, tmp_path_factory):
    write = {"qwen3_moe": checkpoints.write_qwen3_moe, "glm4_moe": checkpoints.write_glm4_moe}
    return write[request.param](tmp_path_factory.mktemp(request.param))


def _llm(path, ep: int, graphs: bool) -> LLM:
    return LLM(
        str(path), dtype="bfloat16", device="cuda", max_model_len=256,
        expert_parallel_size=ep, cuda_graph={"enabled": graphs},
    )  # fmt: skip


def _run(llm: LLM, prompts, one_at_a_time: bool, params=PARAMS):
    """Per prompt: (tokens, per position {token: logprob} of the top ``TOP``)."""
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    runs = []
    for batch in batches:
        for out in llm.generate(batch, params, use_tqdm=False):
            c = out.outputs[0]
            runs.append((c.token_ids, [dict(lp.top) for lp in c.logprobs]))
    return runs


def _rel_err(ours: dict, ref: dict) -> float:
    common = sorted(set(ours) & set(ref))
    assert len(common) >= TOP // 2
    a, b = torch.tensor([ours[t] for t in common]), torch.tensor([ref[t] for t in common])
    return float((a - b).norm() / b.norm())


def _close(runs, ref_runs, tolerance: float) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(runs, ref_runs):
        same = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
        for j in range(len(tokens) if same is None else same + 1):  # up to the first change
            assert _rel_err(logprobs[j], ref_logprobs[j]) < tolerance, j


def test_ep2_bf16_logprobs_within_1e_2_of_ep1(checkpoint):
    prompts = _prompts(512, [7, 30, 61], seed=8)
    ep1 = _llm(checkpoint, 1, graphs=True)
    want = _run(ep1, prompts, one_at_a_time=True)
    ep1.engine.close()
    ep2 = _llm(checkpoint, 2, graphs=True)
    try:
        got = _run(ep2, prompts, one_at_a_time=True)
    finally:
        ep2.engine.close()
    _close(got, want, 1e-2)


def test_decode_graphs_with_ep_replay_as_eager(checkpoint):
    """Four requests (ranks 0, 1, 0, 1): rank 0's end after 3 tokens, rank 1's after 8,
    so rank 0 replays padding while rank 1 decodes."""
    prompts = _prompts(512, [7, 30, 61, 12], seed=9)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP)
        for n in (3, 8, 3, 8)
    ]
    eager = _llm(checkpoint, 2, graphs=False)
    try:
        want = _run(eager, prompts, False, params) + _run(eager, prompts[:1], True)
    finally:
        eager.engine.close()
    llm = _llm(checkpoint, 2, graphs=True)
    graphs, replays = llm.engine.runner.decode_graphs, []
    for name in ("replay_steps", "replay_padding"):
        method = getattr(graphs, name)
        setattr(graphs, name, lambda *a, _m=method, _n=name: replays.append(_n) or _m(*a))
    try:
        got = _run(llm, prompts, False, params) + _run(llm, prompts[:1], True)
        modes = llm.engine.runner.lockstep.mode_counts
        assert llm.engine.runner.lockstep.group.peers is not None  # DECODE mode: shared buffers
    finally:
        llm.engine.close()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    _close(got, want, 1e-3)
    assert modes[DispatchMode.DECODE] and "replay_steps" in replays
    assert "replay_padding" in replays  # rank 0 idle while rank 1 decoded
