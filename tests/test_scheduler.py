"""Scheduler driven without a model: a fake step samples token ids itself."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from splitserve.config import SchedulerConfig
from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.block_manager import NULL_BLOCK, BlockManager
from splitserve.scheduler.request import Request, RequestStatus
from splitserve.scheduler.scheduler import Scheduler, SchedulerOutput, will_sample

BS = 4
TOKEN = 7
_fresh_tokens = itertools.count(1000)


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 32,
    max_num_seqs: int = 8,
    chunked: bool = True,
    prefix_caching: bool = True,
    max_model_len: int = 1024,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )
    return Scheduler(config, BlockManager(num_blocks, BS, prefix_caching), max_model_len)


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int = 8) -> Request:
    """``prompt`` as a length gives tokens no other request shares."""
    if isinstance(prompt, int):
        prompt = [next(_fresh_tokens) for _ in range(prompt)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'run the model', sample TOKEN, finish at max_tokens."""
    out = sched.schedule()
    assert out.total_num_tokens <= sched.config.max_num_batched_tokens
    assert all(n > 0 for n in out.num_scheduled_tokens)
    samples = [will_sample(r, n) for r, n in zip(out.requests, out.num_scheduled_tokens)]
    assert sched.config.enable_chunked_prefill or all(samples)  # whole prompts only
    sampled = {r.request_id: TOKEN for r, s in zip(out.requests, samples) if s}
    sched.update_from_output(out, sampled)
    for req in out.requests:
        if not req.is_finished and len(req.output_token_ids) >= req.sampling_params.max_tokens:
            sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(step(sched))
        check_invariants(sched)
    return outs


def check_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    holders = Counter(b for r in sched.requests.values() for b in r.block_ids)
    assert NULL_BLOCK not in holders
    assert bm.blocks[NULL_BLOCK].ref_count == 0 and NULL_BLOCK not in bm.free_block_ids
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id]
    free = {b.block_id for b in bm.blocks if b.ref_count == 0} - {NULL_BLOCK}
    assert set(bm.free_block_ids) == free and bm.num_free_blocks == len(free)
    for block_hash, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].block_hash == block_hash
    assert len(sched.running) <= sched.config.max_num_seqs
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        assert len(req.block_ids) * BS >= req.num_computed_tokens
        assert len(set(req.block_ids)) == len(req.block_ids)
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.block_ids == [] and req.num_computed_tokens == 0


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1
    assert all(b.ref_count == 0 for b in bm.blocks)


# ---- basic flow -------------------------------------------------------------


def test_will_sample_only_at_the_end_of_the_sequence():
    req = make_request("a", 10)
    assert not will_sample(req, 9)
    assert will_sample(req, 10)
    req.num_computed_tokens = 6
    assert will_sample(req, 4)


def test_single_request_prefills_then_decodes():
    sched = make_scheduler()
    req = make_request("a", 10, max_tokens=3)
    sched.add_request(req)
    outs = run_to_completion(sched)
    assert [o.num_scheduled_tokens for o in outs] == [[10], [1], [1]]
    assert req.output_token_ids == [TOKEN] * 3
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert_all_free(sched)
    out = sched.schedule()
    assert out.is_empty and out.total_num_tokens == 0


def test_add_request_rejects_what_could_never_run():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks = 16 tokens
    with pytest.raises(ValueError, match="16"):
        sched.add_request(make_request("big", 12, max_tokens=8))
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 4))
    unchunked = make_scheduler(budget=16, chunked=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        unchunked.add_request(make_request("long", 20))


# ---- chunked prefill ----------------------------------------------------------


def test_chunked_prefill_mixes_decodes_with_a_chunk_within_budget():
    sched = make_scheduler(budget=16)
    a, b = make_request("a", 10, max_tokens=20), make_request("b", 40, max_tokens=2)
    sched.add_request(a)
    assert step(sched).num_scheduled_tokens == [10]
    sched.add_request(b)
    outs = [step(sched) for _ in range(3)]
    assert [o.requests for o in outs] == [[a, b]] * 3
    assert [o.num_scheduled_tokens for o in outs] == [[1, 15], [1, 15], [1, 10]]
    assert all(o.total_num_tokens <= 16 for o in outs)
    assert len(b.output_token_ids) == 1  # sampled only after its last chunk
    assert b.num_computed_tokens == 40


def test_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(budget=8)
    req = make_request("a", 20, max_tokens=1)
    sched.add_request(req)
    outs = run_to_completion(sched)
    assert [o.num_scheduled_tokens for o in outs] == [[8], [8], [4]]
    assert req.output_token_ids == [TOKEN]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=16, chunked=False)
    a, b = make_request("a", 10, max_tokens=4), make_request("b", 10, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    assert step(sched).num_scheduled_tokens == [10]  # b would need a chunk: it waits
    out = step(sched)
    assert out.requests == [a, b] and out.num_scheduled_tokens == [1, 10]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2, budget=64)
    reqs = [make_request(f"r{i}", 5, max_tokens=3) for i in range(5)]
    for req in reqs:
        sched.add_request(req)
    outs = run_to_completion(sched)
    assert max(len(o.requests) for o in outs) == 2
    assert all(r.output_token_ids == [TOKEN] * 3 for r in reqs)
    assert_all_free(sched)


# ---- prefix caching -------------------------------------------------------------


def test_second_request_reuses_the_cached_prefix():
    sched = make_scheduler()
    prompt = list(range(1, 13))  # exactly 3 blocks
    a = make_request("a", prompt, max_tokens=4)
    sched.add_request(a)
    step(sched)
    b = make_request("b", prompt, max_tokens=4)
    c = make_request("c", [*prompt, 50], max_tokens=4)
    sched.add_request(b)
    sched.add_request(c)
    out = step(sched)
    assert out.requests == [a, b, c]
    assert b.num_cached_tokens == 8  # capped: the last prompt token is computed
    assert c.num_cached_tokens == 12
    assert out.num_scheduled_tokens == [1, 4, 1]
    assert b.block_ids[:2] == a.block_ids[:2] and c.block_ids[:3] == a.block_ids[:3]
    bm = sched.block_manager
    assert [bm.blocks[x].ref_count for x in a.block_ids[:3]] == [3, 3, 2]
    run_to_completion(sched)
    assert_all_free(sched)
    assert len(bm.hash_to_block_id) > 0  # cached blocks outlive their requests


# ---- preemption -----------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_by_recompute_keeps_outputs(prefix_caching):
    # 6 usable blocks; each request grows to 6 + 10 - 1 = 15 tokens = 4 blocks.
    sched = make_scheduler(num_blocks=7, prefix_caching=prefix_caching)
    reqs = [make_request(f"r{i}", [i + 1] * 6, max_tokens=10) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    victim = None
    while victim is None:
        out = step(sched)
        check_invariants(sched)
        victim = out.preempted[0] if out.preempted else None
    assert victim is reqs[-1] and sched.waiting[0] is victim
    assert victim.status == RequestStatus.PREEMPTED and victim.num_preemptions == 1
    assert victim.num_computed_tokens == 0 and victim.block_ids == []
    kept = list(victim.output_token_ids)
    assert kept  # it had decoded before being preempted

    while victim not in (out := step(sched)).requests:
        assert victim.output_token_ids == kept
    # Re-admitted: it recomputes prompt + kept outputs (minus any prefix hit) and samples.
    n = out.num_scheduled_tokens[out.requests.index(victim)]
    hit = victim.num_computed_tokens - n
    assert victim.num_computed_tokens == 6 + len(kept)
    assert hit == 0 if not prefix_caching else hit % BS == 0
    assert victim.output_token_ids == [*kept, TOKEN]
    assert victim.num_cached_tokens == 0  # stats count the first admission only

    run_to_completion(sched)
    assert all(r.output_token_ids == [TOKEN] * 10 for r in reqs)
    assert_all_free(sched)


# ---- abort ------------------------------------------------------------------------


def test_abort_waiting_and_unknown():
    sched = make_scheduler()
    req = make_request("a", 10)
    sched.add_request(req)
    assert sched.abort_request("a")
    assert req.status == RequestStatus.FINISHED_ABORTED and req.finish_reason == "abort"
    assert not sched.abort_request("a") and not sched.abort_request("nope")
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0


def test_abort_mid_chunk_and_between_schedule_and_update():
    sched = make_scheduler(budget=8)
    req = make_request("a", 30)
    sched.add_request(req)
    step(sched)
    assert 0 < req.num_computed_tokens < 30 and req.block_ids
    out = sched.schedule()
    assert sched.abort_request("a")
    sched.update_from_output(out, {})  # the aborted request is skipped
    assert req.num_computed_tokens == 8 and req.block_ids == []
    assert sched.num_running == 0
    assert_all_free(sched)


def test_abort_running_decode_with_shared_blocks():
    sched = make_scheduler()
    a, b = make_request("a", [5] * 9, max_tokens=20), make_request("b", [5] * 9, max_tokens=20)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    step(sched)
    step(sched)
    assert b.num_cached_tokens == 8 and len(a.output_token_ids) == 3
    assert sched.abort_request("a")
    check_invariants(sched)
    assert sched.running == [b]
    assert sched.abort_request(b.request_id)
    assert_all_free(sched)


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=7)
    reqs = [make_request(f"r{i}", [i + 1] * 6, max_tokens=10) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    while not (out := step(sched)).preempted:
        pass
    victim = out.preempted[0]
    assert sched.abort_request(victim.request_id)
    assert victim not in sched.waiting and victim.status == RequestStatus.FINISHED_ABORTED
    run_to_completion(sched)
    assert_all_free(sched)


# ---- the leak test ------------------------------------------------------------------

PREFIXES = [[1] * 8, [2, 3] * 6, list(range(20, 31))]


def random_prompt(rng: random.Random) -> list[int]:
    prompt = list(rng.choice(PREFIXES)) if rng.random() < 0.7 else []
    prompt += [rng.randrange(40, 60) for _ in range(rng.randrange(1, 14))]
    return prompt


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_no_block_leaks_under_random_load(seed, chunked):
    rng = random.Random(seed)
    max_model_len = 40
    budget = 12 if chunked else max_model_len  # small enough to chunk most prompts
    sched = make_scheduler(
        num_blocks=20, budget=budget, max_num_seqs=6, chunked=chunked, max_model_len=max_model_len
    )
    stop_after: dict[str, int] = {}
    seen: list[Request] = []
    for i in range(400):
        if i < 300 and rng.random() < 0.4:
            req = make_request(f"r{i}", random_prompt(rng), max_tokens=rng.randrange(1, 20))
            stop_after[req.request_id] = rng.randrange(1, 25)  # an EOS after this many
            sched.add_request(req)
            seen.append(req)
        if rng.random() < 0.05 and sched.requests:
            sched.abort_request(rng.choice(sorted(sched.requests)))
        out = step(sched)
        for req in out.requests:
            if req.is_finished:
                continue
            if len(req.output_token_ids) >= stop_after[req.request_id]:
                sched.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            elif req.num_tokens >= max_model_len:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        check_invariants(sched)
    run_to_completion(sched)

    assert_all_free(sched)
    assert all(r.is_finished for r in seen)
    assert sum(r.num_preemptions for r in seen) > 0  # the KV cache was tight
    assert any(r.num_cached_tokens > 0 for r in seen)  # prefixes were shared


def test_token_ids_between_equals_a_slice_of_all_tokens():
    from splitserve.sampling_params import SamplingParams
    from splitserve.scheduler.request import Request

    req = Request("r", [1, 2, 3, 4], SamplingParams())
    req.output_token_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 9):
            assert req.token_ids_between(start, end) == req.all_token_ids[start:end]
