"""The MTP drafter's graph runner on CPU: what a replay writes into its static buffers (the
padding rows re-filled every time, at the null page), and that the one graph owner drops its
graphs, buffers and attention state together with everything else. The replays themselves
run in ``tests/test_spec_decode_gpu.py``."""

from __future__ import annotations

import torch

from splitserve.scheduler.block_manager import NULL_BLOCK
from splitserve.workers.attention.torch_backend import TorchAttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.model.loader import load_hf_config, load_model
from splitserve.workers.runner.cuda_graphs.draft_runner import (
    PAD_SEQ_LEN,
    DraftGraph,
    DraftGraphRunner,
)
from splitserve.workers.runner.cuda_graphs.owner import GraphOwner
from splitserve.workers.runner.forward_batch import Phase
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch
from splitserve.workers.runner.model_runner import decode_rows
from splitserve.workers.runner.step_plan import plan_step

HIDDEN = 8


def runner() -> DraftGraphRunner:
    cache = KVCache(KVLayout(2, 1, 4, block_size=4, dtype=torch.float32), 16, "cpu")
    r = DraftGraphRunner(None, TorchAttentionBackend(), cache, [2, 4], 4, torch.device("cpu"))
    r.allocate(HIDDEN, torch.float32)
    return r


def test_fill_rewrites_the_real_rows_and_every_padded_row():
    r = runner()
    for buffer in r._buffers.values():  # a previous replay's rows: live requests' slots
        buffer.fill_(7)
    ids, hidden = torch.tensor([5, 6]), torch.ones(2, HIDDEN)
    r.fill(4, ids, hidden, [3, 9], [7, 13], [4, 10], [[1], [2, 3, 4]])
    b = r._buffers
    assert b["input_ids"][:4].tolist() == [5, 6, 0, 0]
    assert b["positions"][:4].tolist() == [3, 9, 0, 0]
    assert b["slot_mapping"][:4].tolist() == [7, 13, -1, -1]
    assert b["seq_lens"][:4].tolist() == [4, 10, PAD_SEQ_LEN, PAD_SEQ_LEN]
    assert b["block_tables"][:4].tolist() == [
        [1, NULL_BLOCK, NULL_BLOCK, NULL_BLOCK],  # a short table: no stale block after it
        [2, 3, 4, NULL_BLOCK],
        [NULL_BLOCK] * 4,
        [NULL_BLOCK] * 4,
    ]
    assert torch.equal(b["previous_hidden"][:2], hidden)
    assert not b["previous_hidden"][2:4].any()


def test_padded_batch_points_padding_at_the_null_page():
    r = runner()
    static = r._static_batch(4)
    fb = r.padded_batch(static, [4, 10], [[1], [2, 3, 4]])
    assert fb.seq_lens == [4, 10, PAD_SEQ_LEN, PAD_SEQ_LEN]
    assert fb.block_ids == [[1], [2, 3, 4], [NULL_BLOCK], [NULL_BLOCK]]
    assert static.block_ids == [[NULL_BLOCK]] * 4  # the captured batch is left as it was


def test_the_owner_clears_draft_graphs_buffers_and_attention_state():
    r = runner()
    owner = GraphOwner(torch.device("cpu"), TorchAttentionBackend())
    owner.register(r)
    r.attn_backend._graph_index = torch.zeros(1)  # what a capture leaves in the backend
    r._graphs[2] = object()  # a captured size
    assert r.num_graphs == 1 and r.can_draft(2) and not r.can_draft(5)
    owner.clear()
    assert r.num_graphs == 0 and not r.can_draft(2)
    assert r._buffers == {}
    assert r.attn_backend._graph_index is None


def test_a_target_step_never_replays_a_draft_graph():
    r = runner()
    owner = GraphOwner(torch.device("cpu"), TorchAttentionBackend())
    owner.register(r)
    step = StepRequest([5], 3, [1], sample=True)
    fb = build_forward_batch([step], r.kv_cache, r.attn_backend, "cpu")
    assert owner.runner_for(fb) is None


# ---- replays, with the graph emulated on CPU (the captured step run on the static batch)


class _EmulatedGraph:
    """Stands in for a captured graph: a replay runs the captured step on the static
    buffers and writes the graph's output tensors, as a CUDA graph replay does."""

    def __init__(self, runner: DraftGraphRunner, fb, hidden: torch.Tensor, draft: torch.Tensor):
        self.runner, self.fb, self.hidden, self.draft = runner, fb, hidden, draft

    def replay(self) -> None:
        hidden, draft = self.runner._draft_step(self.fb)
        self.hidden.copy_(hidden)
        self.draft.copy_(draft)


def emulate_capture(runner: DraftGraphRunner) -> None:
    hidden_size = runner.model.config.hidden_size
    if not runner._buffers:
        runner.allocate(hidden_size, torch.float32)
    for size in runner.sizes:
        fb = runner._static_batch(size)
        runner.attn_backend.prepare_capture(size, fb)
        fb.plan = plan_step(fb)
        hidden = torch.zeros(size, hidden_size)
        draft = torch.zeros(size, dtype=torch.long)
        graph = _EmulatedGraph(runner, fb, hidden, draft)
        runner._graphs[size] = DraftGraph(graph, fb, hidden, draft)


def test_a_padded_replay_matches_the_eager_step_and_leaves_live_kv_alone():
    config, _ = load_hf_config("glm4-moe-tiny")
    model = load_model(config, None, torch.float32, "cpu")
    layout = model.kv_layout.with_storage(4, torch.float32)
    cache = KVCache(layout, 32, "cpu")
    r = DraftGraphRunner(model, TorchAttentionBackend(), cache, [2, 4], 8, torch.device("cpu"))
    emulate_capture(r)
    g = torch.Generator().manual_seed(0)
    live, drafting = [5, 6], [[10], [11, 12], [13]]
    for k_layer, v_layer in zip(cache.k, cache.v):
        k_layer[1:].normal_(generator=g)
        v_layer[1:].normal_(generator=g)
    live_slot = live[1] * 4 + 2  # a previous replay's row of a live request, left in padding
    r._buffers["slot_mapping"].fill_(live_slot)
    r._buffers["block_tables"][:, :2] = torch.tensor(live, dtype=torch.int32)
    r._buffers["seq_lens"].fill_(7)
    before = [t[live].clone() for t in (*cache.k, *cache.v)]
    positions, ids = [3, 6, 1], torch.tensor([11, 22, 33])
    slots = [b[p // 4] * 4 + p % 4 for p, b in zip(positions, drafting)]
    previous = torch.randn(3, config.hidden_size, generator=g)
    hidden, drafts = r.draft(ids, previous, positions, slots, drafting)
    assert all(torch.equal(x, y) for x, y in zip(before, (t[live] for t in (*cache.k, *cache.v))))
    assert cache.null_page_is_zero()
    steps = [StepRequest([0], p, b, sample=True) for p, b in zip(positions, drafting)]
    fb = build_forward_batch(steps, cache, TorchAttentionBackend(), "cpu")
    fb.input_ids.copy_(ids)
    with torch.inference_mode():
        eager = model.mtp_forward(fb.input_ids, fb.positions, previous, fb)
    assert torch.allclose(hidden, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(drafts, model.mtp_compute_logits(eager).argmax(dim=-1))


def test_the_engine_drafts_through_the_graphs_when_the_step_allows(tmp_path):
    """The runner hands its graph decision to the drafter: with (emulated) draft graphs
    the chained drafts are replayed, padded to the buckets, and the tokens and acceptance
    are those of the eager drafter."""
    from tests.mtp_checkpoints import write_glm4_moe_drafter
    from tests.test_spec_decode import engine, generate, prompts

    path = write_glm4_moe_drafter(tmp_path / "glm", context_scale=0.15)
    batch = prompts()
    eager = engine(path, 3)
    expected = generate(eager, batch)
    graphed = engine(path, 3)
    r = DraftGraphRunner(
        graphed.runner.model,
        TorchAttentionBackend(),
        graphed.kv_cache,
        [1, 2, 4, 8],
        16,
        torch.device("cpu"),
    )
    emulate_capture(r)
    graphed.runner.draft_graphs = r
    sizes = []
    draft = r.draft
    r.draft = lambda ids, *args: sizes.append(len(ids)) or draft(ids, *args)
    assert generate(graphed, batch) == expected
    assert graphed.spec_stats.num_draft_tokens == eager.spec_stats.num_draft_tokens
    assert graphed.spec_stats.num_accepted_tokens == eager.spec_stats.num_accepted_tokens
    assert sizes and any(n not in r.sizes for n in sizes)  # padded replays among them


def test_a_verify_step_as_decode_rows_computes_what_the_verify_step_does():
    """The decode graphs run a verify step as one decode row a token (row j of a request
    attends j more keys): the same hidden states and KV as the verify step's causal
    attention."""
    config, _ = load_hf_config("glm4-moe-tiny")
    model = load_model(config, None, torch.float32, "cpu")
    layout = model.kv_layout.with_storage(4, torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (6, 11)]
    tables = [[1, 2, 3], [4, 5, 6, 7]]
    verify = [
        StepRequest([p[-1], 9, 8, 7], len(p) - 1, t, sample=True, num_drafts=3)
        for p, t in zip(prompts, tables)
    ]
    rows = decode_rows(verify)
    assert [(r.new_token_ids, r.num_computed) for r in rows[:4]] == [
        ([prompts[0][-1]], 5),
        ([9], 6),
        ([8], 7),
        ([7], 8),
    ]
    assert decode_rows([StepRequest([1, 2], 0, [1], sample=True)]) is None  # a prefill
    hidden, caches = [], []
    for steps in (verify, rows):
        cache = KVCache(layout, 16, "cpu")
        prefill = [StepRequest(p[:-1], 0, t, sample=False) for p, t in zip(prompts, tables)]
        backend = TorchAttentionBackend()
        with torch.inference_mode():
            fb = build_forward_batch(prefill, cache, backend, "cpu")
            model(fb.input_ids, fb.positions, fb)
            fb = build_forward_batch(steps, cache, backend, "cpu")
            hidden.append(model(fb.input_ids, fb.positions, fb))
        caches.append(cache)
        assert fb.phase == (Phase.VERIFY if steps is verify else Phase.DECODE)
    assert torch.allclose(hidden[0], hidden[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
