"""Async scheduling: step i + 1 is queued before step i's tokens are read back.

Every test runs the same requests with ``async_scheduling`` on and off and
asserts identical tokens, logprobs, finish reasons and free KV blocks; the
CPU engine runs the same code path as a GPU one (its device work simply
finishes before the host reads it).
"""

from __future__ import annotations

import time

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.scheduler.block_manager import BlockManager
from splitserve.scheduler.request import PLACEHOLDER, Request, RequestStatus
from splitserve.scheduler.scheduler import Scheduler
from splitserve.workers.engine.llm_engine import LLMEngine
from tests import checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3"))


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in lengths]


def _run(checkpoint, prompts, params, async_scheduling: bool, **kwargs):
    llm = LLM(
        str(checkpoint),
        max_model_len=kwargs.pop("max_model_len", 96),
        async_scheduling=async_scheduling,
        **kwargs,
    )
    assert llm.engine.async_scheduling is async_scheduling
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    summary = [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            o.outputs[0].text,
            [(lp.token_id, round(lp.logprob, 4)) for lp in o.outputs[0].logprobs or []],
        )
        for o in outs
    ]
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    return summary, engine.block_manager.num_free_blocks, engine.block_manager.num_usable_blocks


def _same_both_ways(checkpoint, prompts, params, **kwargs):
    sync = _run(checkpoint, prompts, params, False, **dict(kwargs))
    overlapped = _run(checkpoint, prompts, params, True, **dict(kwargs))
    assert overlapped == sync
    summary, free, usable = overlapped
    assert free == usable  # every block is back
    return summary


def test_mixed_sampling_matches_sync(checkpoint):
    prompts = _prompts([5, 17, 33, 9, 12, 40])
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=7, temperature=0.8, seed=11, logprobs=3),
        SamplingParams(max_tokens=15, temperature=0.0, min_tokens=4, logprobs=0),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=5),
        SamplingParams(max_tokens=25, temperature=0.0, stop_token_ids=[7, 8, 9, 10, 11, 12]),
    ]
    out = _same_both_ways(checkpoint, prompts, params, block_size=8, num_kv_blocks=64)
    assert [len(tokens) for tokens, *_ in out][:3] == [20, 1, 7]


def test_stop_strings_and_the_context_length(checkpoint):
    prompts = _prompts([20, 30, 88], seed=1)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, stop=["a", "e"]),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    ]
    out = _same_both_ways(checkpoint, prompts, params, block_size=8, num_kv_blocks=64)
    assert out[2][1] == "length" and len(out[2][0]) == 96 - 88  # ends at max_model_len


def test_chunked_prefill_and_preemption_match_sync(checkpoint):
    """A small budget splits prompts into chunks; a small cache forces preemption."""
    prompts = _prompts([30, 45, 38, 26], seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kwargs = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)
    _same_both_ways(checkpoint, prompts, params, **kwargs)
    llm = LLM(str(checkpoint), max_model_len=96, async_scheduling=True, **kwargs)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0  # the case under test happened


def test_penalties_and_bad_words_read_the_previous_token_first(checkpoint):
    prompts = _prompts([10, 14, 9], seed=3)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, bad_words=["a"]),
    ]
    _same_both_ways(checkpoint, prompts, params, block_size=8, num_kv_blocks=64)


def test_a_request_stopped_by_the_early_read_back_leaves_the_batch(checkpoint):
    """A penalty request makes the step in flight be read back before the next launch;
    a request that this read-back stops must not be launched again."""
    prompts = _prompts([12, 15], seed=7)
    probe = LLM(str(checkpoint), max_model_len=96).generate(
        [{"prompt_token_ids": prompts[1]}],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    third = probe[0].outputs[0].token_ids[2]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[third]),
    ]
    out = _same_both_ways(checkpoint, prompts, params, block_size=4, num_kv_blocks=32)
    assert out[1][1] == "stop" and len(out[1][0]) == 3


def _engine(checkpoint, **scheduler) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            device="cpu",
            cache=CacheConfig(block_size=8, num_kv_blocks=64),
            scheduler=SchedulerConfig(max_model_len=96, async_scheduling=True, **scheduler),
        )
    )


def test_tokens_arrive_one_step_later():
    """The first step only queues the prompt; its token is read back by the second."""
    engine = LLMEngine(EngineConfig(device="cpu", scheduler=SchedulerConfig(async_scheduling=True)))
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    assert engine.step() == []
    request = engine.scheduler.get_request("a")
    assert request.num_pending_tokens == 1 and request.output_token_ids == []
    assert request.token_ids_between(3, 4) == [PLACEHOLDER]
    assert engine.has_runnable_requests()
    (out,) = engine.step()  # queues the decode of the pending token, then reads it back
    assert len(out.new_token_ids) == 1 and request.num_pending_tokens == 1
    steps = 2
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 4  # 3 tokens: 3 forwards and one last read-back, no wasted forward
    assert request.output_token_ids and len(request.output_token_ids) == 3


def test_abort_while_a_step_is_in_flight_frees_every_block(checkpoint):
    engine = _engine(checkpoint)
    free = engine.block_manager.num_free_blocks
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts([20, 25, 30], seed=4)):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for _ in range(4):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine.abort_request("r1")  # r1 is in the step in flight
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "r1"
            tokens[out.request_id] += out.new_token_ids
    assert len(tokens["r0"]) == len(tokens["r2"]) == 30 and len(tokens["r1"]) == 3
    assert engine.block_manager.num_free_blocks == free


def test_a_request_stopped_by_eos_wastes_one_step_and_no_block(checkpoint):
    """EOS is known only after the next step was queued: that step's token is dropped."""
    engine = _engine(checkpoint)
    free = engine.block_manager.num_free_blocks
    prompt = _prompts([12], seed=5)[0]
    probe = LLM(str(checkpoint), max_model_len=96).generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    third = probe[0].outputs[0].token_ids[2]
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[third])
    engine.add_request("a", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert sum(len(o.new_token_ids) for o in outs) == 3
    assert engine.block_manager.num_free_blocks == free


def test_scheduler_does_not_schedule_past_a_last_pending_token():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(32, 4, True), 64)
    req = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2))
    sched.add_request(req)
    out = sched.schedule()
    sched.advance(out)  # the prompt step is queued: one pending token
    assert req.num_tokens == 6 and req.num_output_tokens == 1
    out2 = sched.schedule()  # its decode goes out before the token is known
    assert out2.requests == [req] and out2.num_scheduled_tokens == [1]
    sched.advance(out2)
    assert req.num_pending_tokens == 2 and req.num_output_tokens == 2
    assert sched.schedule().is_empty  # max_tokens=2 is reached by the pending tokens
    sched.resolve(out, {"a": 9})
    sched.resolve(out2, {"a": 8})
    assert req.output_token_ids == [9, 8] and req.num_pending_tokens == 0
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graphs_and_chunks_match_sync(checkpoint, dtype):
    """On a GPU the host really runs ahead: decode graphs, piecewise prefill graphs,
    chunked prompts, seeded sampling and logprobs, with the tokens fed on the device."""
    lengths = [5, 17, 33, 9, 12, 40, 3, 64, 28, 7]
    prompts = _prompts(lengths, seed=6)
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        for m in (20, 1, 7, 15, 12, 25, 30, 9)
    ]
    params.append(SamplingParams(max_tokens=18, temperature=0.9, seed=3, ignore_eos=True))
    params.append(SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, logprobs=2))
    kwargs = dict(device="cuda", dtype=dtype, block_size=16, num_kv_blocks=64)
    _same_both_ways(checkpoint, prompts, params, max_num_batched_tokens=48, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 128], ids=["torch-attention", "flashinfer"])
def test_gpu_step_queues_the_next_step_without_waiting_for_the_device(tmp_path, head_dim):
    """With a long kernel queued behind the step in flight, ``step()`` reads that step
    back and launches the next one without waiting for the kernel: no blocking copy,
    attention plan or sampler sync is left on the launch path (greedy, top-p, logprobs,
    decode graphs; head_dim 128 runs FlashInfer, 16 the torch backend)."""
    checkpoint = checkpoints.write_qwen3(tmp_path, head_dim=head_dim)
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            device="cuda",
            dtype="bfloat16",
            cache=CacheConfig(block_size=16, num_kv_blocks=64),
            scheduler=SchedulerConfig(max_model_len=96, async_scheduling=True),
        )
    )
    prompts = _prompts([20, 9], seed=8)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    top_p = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    engine.add_request("a", prompts[0], greedy)
    engine.add_request("b", prompts[1], top_p)
    for _ in range(3):  # the prompts, then decode steps
        engine.step()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time behind the step in flight
    start = time.perf_counter()
    outputs = engine.step()
    elapsed = time.perf_counter() - start
    assert engine.runner.attn_backend.name == ("flashinfer" if head_dim == 128 else "torch")
    busy = not stream.query()
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    assert elapsed < 0.2, f"step() waited {elapsed:.3f} s for the device (total {total:.3f} s)"
    assert busy, f"the long kernel finished within the step ({total:.3f} s): nothing was measured"
    assert {o.request_id for o in outputs} == {"a", "b"}  # the step before was read back
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
