"""The scheduler's side of speculative decoding, without a model: drafts scheduled with the
known token, trimmed to the budget, the context length and max_tokens; lookahead slots
for the drafter; rejected positions rolled back and never hashed into the prefix cache."""

from __future__ import annotations

from splitserve.config import SchedulerConfig
from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.block_manager import BlockManager
from splitserve.scheduler.request import Request
from splitserve.scheduler.scheduler import Scheduler, will_sample

PROMPT = [11, 12, 13, 14, 15, 16, 17]


def setup(max_tokens: int = 16, max_model_len: int = 64):
    blocks = BlockManager(num_blocks=32, block_size=4)
    config = SchedulerConfig(max_num_batched_tokens=64)
    sched = Scheduler(config, blocks, max_model_len, num_lookahead_tokens=3)
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=max_tokens))
    sched.add_request(request)
    out = sched.schedule()
    assert out.num_scheduled_tokens == [7]
    assert len(request.block_ids) == 3  # 7 tokens and 3 lookahead slots
    sched.update_from_output(out, {"r": 100})
    return sched, blocks, request


def step(sched: Scheduler, drafts: list[int], emitted: list[int]) -> list[int]:
    request = sched.get_request("r")
    request.spec_token_ids = list(drafts)
    out = sched.schedule()
    assert will_sample(request, out.num_scheduled_tokens[0])
    sched.update_from_output(out, {"r": emitted})
    return out.num_scheduled_tokens


def hashed_blocks_hold_the_requests_tokens(blocks: BlockManager, request: Request) -> int:
    tokens = request.all_token_ids
    hashed = {b: blocks.blocks[b].token_ids for b in blocks.hash_to_block_id.values()}
    for i, block_id in enumerate(request.block_ids):
        if block_id in hashed:
            assert hashed[block_id] == tuple(tokens[4 * i : 4 * i + 4])
    return len(hashed)


def test_rejected_drafts_are_rolled_back_and_never_hashed():
    sched, blocks, request = setup()
    # Verify [100, 1, 2, 3] at positions 7..10; the target accepts 1, then says 50.
    assert step(sched, [1, 2, 3], [1, 50]) == [4]
    assert len(request.block_ids) == 4  # positions up to 10, and 3 lookahead slots
    assert request.output_token_ids == [100, 1, 50]
    assert request.num_computed_tokens == 9  # 2 and 3 (positions 9, 10) rolled back
    assert request.spec_token_ids == []
    assert hashed_blocks_hold_the_requests_tokens(blocks, request) == 2
    # The next step rewrites positions 9 .. 12; every draft accepted, then a bonus token.
    assert step(sched, [5, 6, 7], [5, 6, 7, 8]) == [4]
    assert request.output_token_ids == [100, 1, 50, 5, 6, 7, 8]
    assert request.num_computed_tokens == 13
    assert hashed_blocks_hold_the_requests_tokens(blocks, request) == 3  # [1, 50, 5, 6]
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (6, 4)


def test_drafts_are_trimmed_to_max_tokens_the_budget_and_the_context():
    sched, _, request = setup(max_tokens=3)  # one output token so far: room for 1 draft
    assert step(sched, [1, 2, 3], [1, 9]) == [2]
    sched, _, request = setup()
    sched.config.max_num_batched_tokens = 3
    assert step(sched, [1, 2, 3], [1, 2, 9]) == [3]
    sched, _, request = setup(max_model_len=10)  # 8 tokens known: 2 drafts fit
    assert step(sched, [1, 2, 3], [9]) == [3]
    assert request.num_computed_tokens == 8 and request.num_draft_tokens == 2


def test_preemption_drops_the_drafts():
    sched, blocks, request = setup()
    request.spec_token_ids = [1, 2]
    sched._preempt(sched.running.pop())
    assert request.spec_token_ids == [] and request.num_computed_tokens == 0
    out = sched.schedule()  # recomputed from its known tokens (a prefix hit), drafts gone
    assert request.num_computed_tokens + out.num_scheduled_tokens[0] == 8
