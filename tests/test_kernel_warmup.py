"""The engine-start warm-up of the prefill path (``workers/runner/kernel_warmup.py``).

On GPUs it runs before every engine says ready (FlashInfer builds its prefill module
on first use); here its forwards run on CPU and the tests check what it leaves: no
block taken or hashed, and a request computed afterwards in the blocks it wrote gives
transformers' tokens.
"""

from __future__ import annotations

import pytest

from splitserve import LLM
from splitserve.workers.runner.kernel_warmup import PREFILL_WARMUP_TOKENS, warm_eager_forwards
from tests import checkpoints
from tests.test_engine import GREEDY, _hf_greedy, _prompts


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    checkpoints.write_qwen3(path)
    prompts = _prompts(checkpoints.VOCAB_SIZE, [37, 20], seed=5)
    return path, prompts, _hf_greedy(path, prompts)


def _forwards(runner) -> list[tuple[int, int, int]]:
    """Record each forward's (requests, tokens, first position) on ``runner``."""
    seen: list[tuple[int, int, int]] = []
    forward = runner.forward

    def recorded(fb, use_graphs=True, group=None):
        seen.append((len(fb.query_lens), fb.input_ids.numel(), int(fb.positions[0])))
        return forward(fb, use_graphs, group)

    runner.forward = recorded
    return seen


def test_warm_up_runs_prompts_a_chunk_and_a_wide_decode_then_serves_exact_tokens(qwen3):
    path, prompts, expected = qwen3
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64)
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    seen = _forwards(engine.runner)
    shapes = warm_eager_forwards(engine.runner, max_tokens=512, max_seqs=48)
    del engine.runner.forward  # the recorder
    # 63 blocks of 16 beyond the null page hold 1008 tokens: 512 fits, so it runs.
    assert PREFILL_WARMUP_TOKENS == (16, 256)
    assert shapes == [(1, 16), (1, 256), (1, 512), (1, 16), (48, 48)]
    assert seen == [(1, 16, 0), (1, 256, 0), (1, 512, 0), (1, 16, 16), (48, 48, 16)]
    assert engine.block_manager.num_free_blocks == free
    assert engine.num_cached_prefix_tokens(prompts[0]) == 0
    # The warm-up wrote blocks 1.. which these requests now take: they write before reading.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert engine.block_manager.num_free_blocks == free


def test_warm_up_keeps_to_what_the_cache_holds(qwen3):
    path, _, _ = qwen3
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=9)  # 8 blocks of 16: 128 tokens
    seen = _forwards(llm.engine.runner)
    assert warm_eager_forwards(llm.engine.runner, 4096, max_seqs=4) == [(1, 16), (1, 16), (4, 4)]
    assert [s[1:] for s in seen] == [(16, 0), (16, 16), (4, 16)]


def test_warm_up_runs_the_mtp_drafter_at_every_width_then_drafts_exactly(tmp_path):
    from tests.mtp_checkpoints import write_glm4_moe_drafter
    from tests.test_spec_decode import engine as spec_engine
    from tests.test_spec_decode import generate, prompts

    path = write_glm4_moe_drafter(tmp_path / "glm")  # the drafter always agrees
    mtp = spec_engine(path, k=2)
    free = mtp.block_manager.num_free_blocks
    proposer = mtp.runner.speculator.proposer
    drafted: list[list[int]] = []
    propose = proposer.propose

    def recorded(step, hidden, next_ids, draft_rows, graphs=None, group=None):
        drafts = propose(step, hidden, next_ids, draft_rows, graphs, group)
        drafted.append(list(draft_rows))
        assert len(next_ids) == len(hidden) and all(len(d) == 2 for d in drafts)
        return drafts

    proposer.propose = recorded
    shapes = warm_eager_forwards(mtp.runner, max_tokens=32, max_seqs=3)
    del proposer.propose
    # Prompts of 16 and 32 tokens, a chunk over 16, then decode steps of 1, 2, 3 requests:
    # the drafter after each, from the last row of each request.
    assert shapes == [(1, 16), (1, 32), (1, 16), (1, 1), (2, 2), (3, 3)]
    assert drafted == [[15], [31], [15], [0], [0, 1], [0, 1, 2]]
    assert mtp.block_manager.num_free_blocks == free
    # What the warm-up's passes wrote (blocks 1.., the MTP layer's too) changes nothing.
    assert generate(mtp, prompts()) == generate(spec_engine(path), prompts())
    assert mtp.block_manager.num_free_blocks == free
