"""MTP across the prefill/decode hand-off (CPU transport): the prefill worker sends the MTP
layer's prompt KV and its drafts with the KV, so the decode worker's first step already
verifies drafts; a decode worker that drafts behind a prefill worker that cannot is
refused with an error that says so."""

from __future__ import annotations

import pytest
import torch

from splitserve.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine
from tests.mtp_checkpoints import write_glm4_moe_drafter
from tests.test_disaggregation import Handoff, _slots_content
from tests.test_spec_decode import prompts, replay_acceptance

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def agreeing_glm(tmp_path_factory):
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-agree"))


def _engine(path, role: str, k: int, block_size: int = 4) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            device="cpu",
            role=role,
            cache=CacheConfig(block_size=block_size, num_kv_blocks=96),
            scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=16),
            kv_transfer=KVTransferConfig(transport="cpu", timeout_s=10.0),
            speculative_config=SpeculativeConfig("mtp", k) if k else None,
        )
    )


def _mixed_tokens(path, batch) -> dict[str, list[int]]:
    eng = _engine(path, "mixed", 0)
    for i, p in enumerate(batch):
        eng.add_request(f"r{i}", p, GREEDY)
    tokens = {f"r{i}": [] for i in range(len(batch))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


@pytest.mark.parametrize("prefill_k", [2, 3])
def test_decode_worker_verifies_the_prefill_workers_drafts_from_its_first_step(
    agreeing_glm, prefill_k
):
    """Prompts prefilled in chunks of 16 tokens: tokens equal a mixed engine's without
    MTP; the MTP layer's prompt KV arrives byte-identical; every decode step, the first
    included, verifies K drafts (the drafter always agrees, so the counts follow from the
    output length alone)."""
    k = 2
    prefill = _engine(agreeing_glm, "prefill", prefill_k, block_size=16)
    decode = _engine(agreeing_glm, "decode", k)
    free = decode.block_manager.num_free_blocks
    requests = {}
    add = decode.add_remote_request
    decode.add_remote_request = lambda rid, p, sp: requests.setdefault(rid, add(rid, p, sp))
    batch = prompts()[1:4]
    run = Handoff(prefill, decode)
    for i, p in enumerate(batch):
        run.submit(f"r{i}", p)
    run.run()
    assert run.tokens == _mixed_tokens(agreeing_glm, batch)
    mtp_layer = decode.hf_config.num_hidden_layers
    assert decode.handoff.scheduler.num_layers == mtp_layer + 1
    for i, p in enumerate(batch):
        rid = f"r{i}"
        ticket = run.tickets[rid]
        assert ticket.num_layers == mtp_layer + 1
        got = _slots_content(decode, ticket.block_ids, 0, len(p))
        for a, b in zip(run.sent_kv[rid][-2:], got[-2:]):  # the MTP layer's K and V
            assert a.any() and torch.equal(a, b)
        want = replay_acceptance(run.tokens[rid], k, GREEDY.max_tokens, wrong=set())
        assert (requests[rid].num_draft_tokens, requests[rid].num_accepted_tokens) == want
    assert decode.block_manager.num_free_blocks == free
    prefill.close()
    decode.close()


def test_prefill_worker_with_mtp_serves_a_decode_worker_without(agreeing_glm):
    prefill = _engine(agreeing_glm, "prefill", 2, block_size=16)
    decode = _engine(agreeing_glm, "decode", 0)
    batch = prompts()[1:3]
    run = Handoff(prefill, decode)
    for i, p in enumerate(batch):
        run.submit(f"r{i}", p)
    run.run()
    assert run.tokens == _mixed_tokens(agreeing_glm, batch)
    assert decode.spec_stats.num_draft_tokens == 0
    prefill.close()
    decode.close()


def test_decode_worker_with_mtp_behind_a_prefill_worker_without_is_refused(agreeing_glm):
    prefill = _engine(agreeing_glm, "prefill", 0, block_size=16)
    decode = _engine(agreeing_glm, "decode", 2)
    prompt = prompts()[1]
    decode.add_remote_request("r", prompt, GREEDY)
    (out,) = decode.step()
    with pytest.raises(InvalidRequestError, match="drafts with MTP.*no speculative_config"):
        prefill.add_request("r", prompt, GREEDY, kv_ticket=out.kv_ticket)
    decode.abort_request("r")
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_usable_blocks
    prefill.close()
    decode.close()


def test_decode_worker_drafts_for_its_local_requests(agreeing_glm):
    """A decode worker's short local prompt runs the whole MTP loop on that worker."""
    decode = _engine(agreeing_glm, "decode", 2)
    prompt = prompts()[1]
    decode.add_request("local", prompt, GREEDY)
    tokens = []
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == _mixed_tokens(agreeing_glm, [prompt])["r0"]
    assert decode.spec_stats.acceptance_rate == 1.0
    decode.close()


def test_a_prefill_worker_sends_the_first_token_before_it_drafts(agreeing_glm):
    """The drafter's passes (the MTP layer over the prompt, the chained drafts) run after
    the step that samples the first token has returned it, at the start of the next
    step; then the "done" frame carries the drafts. Tokens and KV as before."""
    prefill = _engine(agreeing_glm, "prefill", 2, block_size=16)
    decode = _engine(agreeing_glm, "decode", 2)
    order: list[str] = []
    proposer = prefill.runner.speculator.proposer
    propose = proposer.propose
    proposer.propose = lambda *args: (order.append("drafts"), propose(*args))[1]
    worker = prefill.handoff.worker
    finish_send = worker.finish_send
    worker.finish_send = lambda *args: (order.append("done"), finish_send(*args))[1]
    step = prefill.step

    def stepped():
        outputs = step()
        order.extend("first token" for o in outputs if o.new_token_ids)
        return outputs

    prefill.step = stepped
    batch = prompts()[1:2]  # 9 tokens: one prefill step
    run = Handoff(prefill, decode)
    run.submit("r0", batch[0])
    run.run()
    assert order == ["first token", "drafts", "done"]
    assert run.tokens == _mixed_tokens(agreeing_glm, batch)
    assert decode.spec_stats.num_draft_tokens > 0  # the drafts arrived and were verified
    prefill.close()
    decode.close()


def test_deferred_drafts_send_the_same_kv_and_drafts_as_drafting_at_once(agreeing_glm):
    """Prompts over several prefill chunks: the MTP layer's KV of every chunk (a chunk's
    step samples nothing, yet its drafter pass writes that layer) and the drafts arrive
    as when the prefill worker drafts inside the step."""
    long = prompts()[2] + prompts()[3]  # 37 tokens: two steps of a chunk each, then 5
    batch = [long, prompts()[1]]
    sent, tokens = [], []
    for defer in (True, False):
        prefill = _engine(agreeing_glm, "prefill", 2, block_size=16)
        decode = _engine(agreeing_glm, "decode", 2)
        prefill.defers_drafts = defer
        drafts = {}
        worker = prefill.handoff.worker
        finish_send = worker.finish_send

        def finish(request, token, logprobs, request_drafts, _send=finish_send, _d=drafts):
            _d[request.request_id] = list(request_drafts)
            _send(request, token, logprobs, request_drafts)

        worker.finish_send = finish
        run = Handoff(prefill, decode)
        for i, p in enumerate(batch):
            run.submit(f"r{i}", p)
        run.run()
        sent.append((run.sent_kv, drafts))
        tokens.append(run.tokens)
        prefill.close()
        decode.close()
    (kv_deferred, drafts_deferred), (kv_at_once, drafts_at_once) = sent
    assert drafts_deferred == drafts_at_once and all(len(d) == 2 for d in drafts_at_once.values())
    for rid in kv_at_once:
        for a, b in zip(kv_deferred[rid], kv_at_once[rid]):  # every layer, the MTP layer's too
            assert torch.equal(a, b), rid
    assert tokens[0] == tokens[1]
