"""MTP speculative decoding in an expert-parallel group (CPU: two ranks over gloo).

The MTP layer is a MoE layer whose experts are sharded like the others, so every
drafter pass is a group collective: every rank runs the same passes each step (a
rank with no work, or no request to draft for, a dummy one). Lossless: EP2 with
MTP K = 1 and K = 2 gives the greedy tokens of EP1 without MTP, through prompt
chunks next to decodes, a rank idle while the other decodes or verifies, drafts
accepted (a drafter that always agrees) and rejected (one whose own attention and
routed experts move its drafts: they equal EP1's only if its MoE dispatches right);
every KV block comes back on both ranks and the group's stats count both ranks'
drafts.

On two GPUs (``gpu``): decode graphs and draft graphs on, EP2 with MTP replays what
the eager group computes.
"""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.config import (
    CacheConfig,
    CudaGraphConfig,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.core_process import collect_stats
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.parallel.dispatch import DispatchMode
from splitserve.workers.parallel.lockstep import StepHeader, agree, agree_drafts
from tests.mtp_checkpoints import write_glm4_moe_drafter

# Placed 0, 1, 0, 1 (least loaded, ties to rank 0): rank 1's requests run longest, so
# rank 0 is idle at the end while rank 1 still verifies.
PROMPT_LENS = [9, 23, 2, 14]
MAX_TOKENS = [6, 16, 4, 14]
MTP_SCALE = 0.05  # the drafter's attention and routed experts: about 40% of drafts accepted


@pytest.fixture(scope="module")
def agreeing_glm(tmp_path_factory):
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-ep-agree"))


@pytest.fixture(scope="module")
def moe_drafter_glm(tmp_path_factory):
    """A target whose context moves its predictions, and a drafter whose attention and
    routed experts add to what it reads: its drafts depend on its MoE's dispatch."""
    path = write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-ep-moe"), context_scale=0.05)
    file = path / "model-mtp.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(5)
    for name, value in tensors.items():
        if name.endswith("o_proj.weight") or (".experts." in name and "down_proj" in name):
            tensors[name] = torch.randn(value.shape, generator=g) * MTP_SCALE
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


# ---- the drafter's passes, from the headers every rank has ------------------------------

SIZES = [1, 2, 4, 8, 16]
PRE, DEC = DispatchMode.PREFILL, DispatchMode.DECODE


def _verify(requests: int, k: int) -> StepHeader:
    return StepHeader(requests * (1 + k), True, True, requests)


@pytest.mark.parametrize(
    ("role", "headers", "draft_sizes", "first_graph", "chain"),
    [
        # Verifies on both ranks: the target's size for the first pass, the chain one row
        # a drafting request, the larger rank's.
        ("decode", [_verify(3, 2), _verify(1, 2)], SIZES, 16, (DEC, 4, 4)),
        ("decode", [_verify(3, 2), StepHeader.idle()], SIZES, 16, (DEC, 4, 4)),
        ("decode", [_verify(3, 2), _verify(1, 2)], [], None, (DEC, 3, None)),  # no draft graphs
        # A prompt chunk that samples nothing: no rank drafts, no chain.
        ("prefill", [StepHeader(12, False, False), StepHeader.idle()], [], None, None),
        # A prompt's last chunk on one rank, verifies on the other: PREFILL, eager.
        ("mixed", [StepHeader(9, False, False, 1), _verify(2, 1)], SIZES, None, (PRE, 2, None)),
    ],
)
def test_every_rank_agrees_on_the_drafters_passes(role, headers, draft_sizes, first_graph, chain):
    for order in (headers, headers[::-1]):
        step = agree(role, order, SIZES)
        drafts = agree_drafts(step, draft_sizes)
        assert drafts.first.mode == step.mode and drafts.first.capacity == step.capacity
        assert drafts.first.graph_size == first_graph
        got = drafts.chain
        assert (got and (got.mode, got.capacity, got.graph_size)) == chain
        if got is not None:
            assert sorted(got.num_tokens) == sorted(h.draft_rows for h in headers)


# ---- end to end ---------------------------------------------------------------------------


def _engine(
    path, ep: int, k: int, device: str = "cpu", graphs: bool = False, role: str = "mixed"
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            role=role,
            device=device,
            dtype="float32",
            attention_backend="torch",
            cache=CacheConfig(block_size=4 if device == "cpu" else 16, num_kv_blocks=128),
            # A 16-token budget chunks the longer prompts: prompt chunks beside decodes.
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=16),
            cuda_graph=CudaGraphConfig(enabled=graphs),
            parallel=ParallelConfig(ep),
            speculative_config=SpeculativeConfig("mtp", k) if k else None,
            kv_transfer=KVTransferConfig(transport="cpu", timeout_s=30.0),
        )
    )


@functools.cache
def _without_mtp(path) -> dict[str, list[int]]:
    """EP1 without MTP: the tokens every run must give."""
    return {rid: run[0] for rid, run in _generate(_engine(path, 1, 0)).items()}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(eng: LLMEngine) -> dict[str, tuple[list[int], int, int]]:
    """Per request: (token ids, drafts verified, drafts accepted)."""
    for i, (prompt, n) in enumerate(zip(_prompts(), MAX_TOKENS)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        eng.add_request(f"r{i}", prompt, params)
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            c = out.outputs[0]
            got[out.request_id] = (c.token_ids, out.num_draft_tokens, out.num_accepted_tokens)
    return got


def _watch(eng: LLMEngine) -> list:
    """(rank 0's header, the group's step) at every step of the group."""
    lockstep, seen = eng.runner.lockstep, []
    exchange = lockstep.exchange

    def recorded(header, sizes):
        seen.append((header, exchange(header, sizes)))
        return seen[-1][1]

    lockstep.exchange = recorded
    return seen


@pytest.mark.parametrize(("checkpoint", "k"), [("agreeing_glm", 1), ("moe_drafter_glm", 2)])
def test_ep2_with_mtp_gives_the_tokens_of_ep1_without_it(checkpoint, k, request):
    """With a drafter whose MoE matters, also EP1 with MTP's drafts: per request the same
    drafts verified and accepted."""
    path = request.getfixturevalue(checkpoint)
    want = _without_mtp(path)
    ep1 = _generate(_engine(path, 1, k)) if checkpoint == "moe_drafter_glm" else None
    eng = _engine(path, 2, k)
    try:
        seen = _watch(eng)
        got = _generate(eng)
        stats = collect_stats(eng, 0, wait_for_experts=True)
        usable = eng.block_manager.num_usable_blocks
    finally:
        eng.close()
    assert {rid: run[0] for rid, run in got.items()} == want
    if ep1 is not None:  # drafts that depend on the MTP layer's MoE: as on one rank
        assert got == ep1
    # Every KV block back on both ranks (draft lookahead slots included).
    assert stats.num_running == stats.num_waiting == 0
    assert stats.rank_free_blocks == [usable, usable]
    # The group's stats are both ranks' drafts, and every request verified drafts.
    drafts, accepted = sum(r[1] for r in got.values()), sum(r[2] for r in got.values())
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (drafts, accepted)
    assert all(r[1] > 0 for r in got.values())
    if checkpoint == "agreeing_glm":
        assert accepted == drafts > 0
    else:
        assert 0 < accepted < drafts  # accepted and rejected drafts
    # Rank 0 idle while rank 1 verified; rank 0 verifying while rank 1 prefilled.
    idle = [s for h, s in seen if h.num_tokens == 0 and s.runs]
    assert idle and any(s.draft_rows[1] for s in idle)
    assert any(h.decode_only and h.num_tokens and s.mode == DispatchMode.PREFILL for h, s in seen)
    assert any(h.num_tokens > h.draft_rows > 0 for h, _ in seen)  # verify steps drafted


def test_ep2_with_mtp_warms_up_in_lockstep_then_gives_the_tokens_of_ep1(
    moe_drafter_glm, monkeypatch
):
    """The start-up warm-up (on a GPU by default; here forced on CPU): every rank runs
    the target's and the drafter's eager passes as group steps, at every batch width,
    in the same order. Afterwards: EP1's tokens, every block free on both ranks."""
    monkeypatch.setenv("SPLITSERVE_WARMUP", "1")  # the other rank's process inherits it
    want = _without_mtp(moe_drafter_glm)
    eng = _engine(moe_drafter_glm, 2, 2)
    try:
        forwards = dict(((kind, how), n) for kind, how, n in eng.runner.forward_rows())
        got = _generate(eng)
        stats = collect_stats(eng, 0, wait_for_experts=True)
        usable = eng.block_manager.num_usable_blocks
    finally:
        eng.close()
    assert forwards[("draft", "eager")] > 8  # the drafter ran at start (8 widths and more)
    assert {rid: run[0] for rid, run in got.items()} == want
    assert stats.rank_free_blocks == [usable, usable]


def test_ep2_prefill_worker_hands_mtp_state_to_an_ep2_decode_worker(moe_drafter_glm):
    """PD with EP and MTP K = 2 on both sides: the prefill group drafts in PREFILL mode
    (its chained passes too) and sends the MTP layer's KV and its drafts rank to rank;
    the decode group verifies them in DECODE mode. Tokens: EP1 without MTP's; every
    block back on every rank of both groups."""
    from tests.test_disaggregation import Handoff

    path = moe_drafter_glm
    want = _without_mtp(path)
    prefill = _engine(path, 2, 2, role="prefill")
    decode = _engine(path, 2, 2, role="decode")
    try:
        run = Handoff(prefill, decode)
        for i, (prompt, n) in enumerate(zip(_prompts(), MAX_TOKENS)):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            run.submit(f"r{i}", prompt, params)
        run.run(timeout=120.0)
        while prefill.has_unfinished_requests():  # the last acks
            prefill.step()
        groups = [collect_stats(e, 0, wait_for_experts=True) for e in (prefill, decode)]
        modes = [e.runner.lockstep.mode_counts for e in (prefill, decode)]
        usable = [e.block_manager.num_usable_blocks for e in (prefill, decode)]
    finally:
        prefill.close()
        decode.close()
    assert run.tokens == want
    assert len({t.address for t in run.tickets.values()}) == 2  # both decode ranks received
    for stats, n in zip(groups, usable):
        assert stats.rank_free_blocks == [n, n]
    assert set(modes[0]) <= {DispatchMode.PREFILL, None}
    assert set(modes[1]) <= {DispatchMode.DECODE, None}
    verified = [out.num_draft_tokens for out in run.finished.values()]
    accepted = sum(out.num_accepted_tokens for out in run.finished.values())
    assert all(verified) and 0 < accepted < sum(verified) == groups[1].spec_num_draft_tokens


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ep2_mtp_graphs_replay_as_eager(moe_drafter_glm):
    """Decode graphs and draft graphs on (first pass and chained passes replayed in DECODE
    mode, an idle rank replaying padding): the tokens and drafts of the eager group."""
    eager = _engine(moe_drafter_glm, 2, 2, device="cuda")
    try:
        want = _generate(eager)
    finally:
        eager.close()
    eng = _engine(moe_drafter_glm, 2, 2, device="cuda", graphs=True)
    runner, calls = eng.runner, []
    for graphs in (runner.decode_graphs, runner.draft_graphs):
        for name in ("replay_steps", "draft", "replay_padding"):
            method = getattr(graphs, name, None)
            if method is not None:
                setattr(graphs, name, lambda *a, _m=method, _n=name: calls.append(_n) or _m(*a))
    try:
        got = _generate(eng)
        modes = runner.lockstep.mode_counts
    finally:
        eng.close()
    assert got == want
    assert modes[DispatchMode.DECODE] and {"replay_steps", "draft", "replay_padding"} <= set(calls)
