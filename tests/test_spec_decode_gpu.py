"""MTP speculative decoding with CUDA graphs on a GPU.

- Greedy tokens with graphs (decode graphs, piecewise verify steps, the drafter's chained
  steps replayed from its graphs) equal eager, and equal decoding without MTP.
- A draft replay at a padded size, after a previous replay left live requests' rows in the
  padding, writes no KV outside the real rows' slots (every layer, the MTP layer's too),
  leaves the null page zero, and gives what the eager chained step gives.
- ``clear_parameters`` drops the drafter's graphs and buffers with every other graph;
  new weights capture them again and the tokens follow.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.config import (
    CacheConfig,
    CudaGraphConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch
from tests.mtp_checkpoints import write_glm4_moe_drafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPT_LENS = [5, 17, 33, 9, 60]
MAX_TOKENS = [24, 10, 17, 5, 24]  # requests finish at different steps: the batch shrinks


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """A drafter that is right now and then: verify steps accept and reject."""
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-drafter"), context_scale=0.15)


def _engine(path, k: int, graphs: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            device="cuda",
            dtype="float32",
            attention_backend="torch",  # head_dim 32: FlashInfer does not build it
            cache=CacheConfig(block_size=16, num_kv_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256),
            cuda_graph=CudaGraphConfig(enabled=graphs),  # decode sizes to 8 * (1 + K) tokens
            speculative_config=SpeculativeConfig("mtp", k) if k else None,
        )
    )


def _run(eng: LLMEngine) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS)):
        prompt = torch.randint(1, 512, (n,), generator=g).tolist()
        sp = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        eng.add_request(f"r{i}", prompt, sp)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def _count_replays(eng: LLMEngine) -> list[int]:
    runner = eng.runner.draft_graphs
    calls = [0]
    draft = runner.draft

    def counted(*args, **kwargs):
        calls[0] += 1
        return draft(*args, **kwargs)

    runner.draft = counted
    return calls


def _count_verify_replays(eng: LLMEngine) -> list[int]:
    """Decode-graph replays with several rows of one request (a verify step)."""
    graphs = eng.runner.decode_graphs
    calls = [0]
    replay = graphs.replay_steps

    def counted(steps, *args, **kwargs):
        calls[0] += len({id(s.block_ids) for s in steps}) < len(steps)
        return replay(steps, *args, **kwargs)

    graphs.replay_steps = counted
    return calls


@pytest.mark.parametrize("k", [1, 2, 3])
def test_graphs_with_mtp_equal_eager(drafter, k):
    expected = _run(_engine(drafter, 0, graphs=False))
    eager = _engine(drafter, k, graphs=False)
    assert _run(eager) == expected
    graphed = _engine(drafter, k, graphs=True)
    assert graphed.runner.draft_graphs in graphed.runner.graphs.runners
    replays = _count_replays(graphed)
    verify_replays = _count_verify_replays(graphed)
    assert _run(graphed) == expected
    assert graphed.spec_stats.num_accepted_tokens > 0
    assert replays[0] > 0  # the first pass over graph-replayed rows (and K > 1's chain)
    assert verify_replays[0] > 0  # verify steps ran as decode rows in the decode graphs
    blocks = graphed.block_manager
    assert blocks.num_free_blocks == blocks.num_usable_blocks
    assert graphed.kv_cache.null_page_is_zero()


def test_padded_draft_replay_leaves_live_kv_untouched(drafter):
    eng = _engine(drafter, 3, graphs=True)
    eng.runner.capture_graphs()
    runner, cache, model = eng.runner.draft_graphs, eng.kv_cache, eng.runner.model
    size = 4
    live_blocks, draft_blocks = [5, 6], [[10], [11, 12], [13]]  # 3 real rows: one padded
    g = torch.Generator(device="cuda").manual_seed(0)
    for k_layer, v_layer in zip(cache.k, cache.v):
        for b in (*live_blocks, *sum(draft_blocks, [])):
            k_layer[b].normal_(generator=g)
            v_layer[b].normal_(generator=g)
    # A previous replay left the live request's rows in the buffers, padding included.
    live_slot = live_blocks[1] * cache.block_size + 3
    b = runner._buffers
    b["input_ids"][:size].fill_(7)
    b["positions"][:size].fill_(cache.block_size + 3)
    b["slot_mapping"][:size].fill_(live_slot)
    b["seq_lens"][:size].fill_(cache.block_size + 4)
    b["block_tables"][:size, :2] = torch.tensor(live_blocks, dtype=torch.int32)
    b["previous_hidden"][:size].normal_(generator=g)
    before = [t[live_blocks].clone() for t in (*cache.k, *cache.v)]

    positions = [5, 20, 2]
    bs = cache.block_size
    slots = [blocks[p // bs] * bs + p % bs for p, blocks in zip(positions, draft_blocks)]
    ids = torch.tensor([11, 22, 33], device="cuda")
    previous = torch.randn(3, model.config.hidden_size, device="cuda", generator=g)
    hidden, drafts = runner.draft(ids, previous, positions, slots, draft_blocks)
    hidden, drafts = hidden.clone(), drafts.clone()
    after = [t[live_blocks] for t in (*cache.k, *cache.v)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert cache.null_page_is_zero()

    steps = [StepRequest([0], p, blocks, sample=True) for p, blocks in zip(positions, draft_blocks)]
    fb = build_forward_batch(steps, cache, eng.runner.attn_backend, "cuda")
    fb.input_ids.copy_(ids)
    with torch.inference_mode():
        eager = model.mtp_forward(fb.input_ids, fb.positions, previous, fb)
        eager_drafts = model.mtp_compute_logits(eager).argmax(dim=-1)
    assert torch.allclose(hidden, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(drafts, eager_drafts)


def test_clear_parameters_drops_the_draft_graphs(drafter):
    eng = _engine(drafter, 2, graphs=True)
    expected = _run(eng)
    runner = eng.runner.draft_graphs
    assert runner.num_graphs == len(runner.sizes) > 0
    eng.clear_parameters()
    assert runner.num_graphs == 0, "a draft graph outlived clear_parameters()"
    assert runner._buffers == {}
    assert not eng.runner.graphs.captured
    eng.update_parameters(drafter)  # the same weights, at new addresses
    assert runner.num_graphs == len(runner.sizes)
    replays = _count_replays(eng)
    assert _run(eng) == expected
    assert replays[0] > 0
