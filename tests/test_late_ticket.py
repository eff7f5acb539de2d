"""Late tickets: a prefill worker computes a prompt sent with ``ticket_follows`` before its
decode worker has reserved blocks, and sends the KV once the ticket comes
(``LLMEngine.give_ticket``, ``workers/kv/handoff.py``).

CPU, real engines over the CPU transport (real TCP), tiny checkpoints written by
transformers: the decode worker's greedy tokens must equal transformers', its KV the
prefill worker's byte for byte, and every block must come back on both sides, whether
the request ends, is aborted or its ticket is refused.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.request import RequestStatus
from splitserve.workers.engine import messages
from splitserve.workers.engine.engine_client import EngineClient
from splitserve.workers.engine.engine_connection import EngineConnection
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.engine.messages import Delta, GenerateCall, LateTicket, TicketIssued
from splitserve.workers.kv.transfer.base import CONNECTING
from splitserve.workers.kv.transfer.ticket import TransferTicket
from tests import checkpoints, test_disaggregation
from tests.test_disaggregation import Handoff, _config, _slots_content
from tests.test_engine import NEW_TOKENS, _hf_greedy, _prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 17, 33, 41]  # the prefill budget is 24 tokens: the last two are chunked


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts(512, LENGTHS, seed=2)


@pytest.fixture(scope="module")
def expected(checkpoint, prompts) -> dict[str, list[int]]:
    """transformers' greedy tokens, by request id."""
    return {f"r{i}": toks for i, toks in enumerate(_hf_greedy(checkpoint, prompts))}


pair = test_disaggregation.pair  # the same engines, async scheduling off and on


class Late:
    """A prefill engine given prompts with ``ticket_follows`` and a decode engine asked for
    blocks later; the test says when each ticket is reserved and given."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, params: SamplingParams = GREEDY):
        self.prefill, self.decode, self.params = prefill, decode, params
        self.prompts: dict[str, list[int]] = {}
        self.tickets: dict[str, bytes] = {}
        self.first_ahead: dict[str, int] = {}  # the prefill's first token, before the KV
        self.ends: dict[str, object] = {}  # the prefill's last output
        self.tokens: dict[str, list[int]] = {}  # the decode side's
        self.finished: dict[str, object] = {}  # the decode side's last output
        self.sent_kv: dict[str, list[torch.Tensor]] = {}  # prefill KV when "done" is made
        self.layer_by_layer: set[str] = set()  # transfers a step opened (not late)
        self._spy()

    def add(self, rid: str, prompt: list[int]) -> None:
        self.prefill.add_request(rid, prompt, self.params, ticket_follows=True)
        self.prompts[rid] = prompt

    def reserve(self, rid: str, prompt: list[int] | None = None) -> bytes:
        """The decode worker reserves blocks (for ``prompt``, else the request's own)."""
        self.decode.add_remote_request(rid, prompt or self.prompts[rid], self.params)
        self.tokens[rid] = []
        (out,) = [o for o in self.decode.issue_tickets() if o.request_id == rid]
        self.tickets[rid] = out.kv_ticket
        return out.kv_ticket

    def give(self, rid: str) -> list:
        return self.prefill.give_ticket(rid, self.tickets[rid])

    def step_prefill(self) -> None:
        for out in self.prefill.step():
            if not out.finished:  # the first token, ahead of the KV
                assert out.request_id not in self.first_ahead and not out.error
                (self.first_ahead[out.request_id],) = out.new_token_ids
            else:
                self.ends[out.request_id] = out
        time.sleep(0.001)

    def step_decode(self) -> None:
        for out in self.decode.step():
            self.tokens[out.request_id] += out.new_token_ids
            if out.finished:
                self.finished[out.request_id] = out

    def step_prefill_until(self, done, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the prefill engine did not get there in time"
            self.step_prefill()

    def run(self, timeout: float = 60.0) -> None:
        """Both engines until every reserved request has ended on both sides."""
        deadline = time.monotonic() + timeout
        while self.prefill.has_unfinished_requests() or len(self.finished) < len(self.tokens):
            assert time.monotonic() < deadline, "requests did not finish in time"
            self.step_prefill()
            self.step_decode()

    def _spy(self) -> None:
        worker = self.prefill.handoff.worker
        start_sends, finish_send = worker.start_sends, worker.finish_send

        def started(batch):
            sends = start_sends(batch)
            self.layer_by_layer.update(sends.request_ids)
            return sends

        def finish(request, *args):  # every layer stored, the MTP layer's too
            n = request.num_prompt_tokens
            kv = _slots_content(self.prefill, request.block_ids, 0, n)
            self.sent_kv[request.request_id] = kv
            finish_send(request, *args)

        worker.start_sends, worker.finish_send = started, finish


def _free(prefill: LLMEngine, decode: LLMEngine) -> tuple[int, int]:
    return prefill.block_manager.num_free_blocks, decode.block_manager.num_free_blocks


def _assert_kv_arrived(run: Late) -> None:
    """The decode worker's blocks hold the prefill worker's KV, byte for byte."""
    for rid, packed in run.tickets.items():
        if rid not in run.finished or run.finished[rid].error:
            continue
        ticket = TransferTicket.unpack(packed)
        got = _slots_content(run.decode, ticket.block_ids, 0, len(run.prompts[rid]))
        for a, b in zip(run.sent_kv[rid], got):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), rid


def test_first_tokens_come_before_any_ticket_and_the_late_kv_decodes_as_transformers(
    pair, prompts, expected
):
    prefill, decode = pair
    free = _free(prefill, decode)
    run = Late(prefill, decode)
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p)
    run.step_prefill_until(lambda: len(run.first_ahead) == len(prompts))
    # Every prompt is computed and its first token out; no decode worker was asked yet.
    assert not decode.has_unfinished_requests()
    for rid in run.prompts:
        request = prefill.scheduler.get_request(rid)
        assert request.status == RequestStatus.SENDING_KV and request.ticket_follows
    for _ in range(3):  # waiting for a ticket, the prefill engine does nothing
        run.step_prefill()
        assert not prefill.has_runnable_requests()
    for rid in run.prompts:
        run.reserve(rid)
        assert run.give(rid) == []
        if rid == "r0" and prefill.scheduler.get_request(rid).ticket_follows:
            # not sent: the decode worker's first connection is being made, and the loop
            # has nothing to do until it is up (it waits, it does not spin)
            assert not prefill.has_runnable_requests()
    run.run()
    assert run.tokens == expected
    assert {rid: toks[0] for rid, toks in run.tokens.items()} == run.first_ahead
    assert all(out.outputs[0].finish_reason == "length" for out in run.finished.values())
    assert all(out.outputs[0].finish_reason == "transferred" for out in run.ends.values())
    assert not run.layer_by_layer  # each went the late way: all its layers at once
    _assert_kv_arrived(run)
    assert _free(prefill, decode) == free
    assert prefill.kv_transport.num_in_flight == 0 and decode.kv_transport.num_in_flight == 0


def _connect(engine: LLMEngine, packed: bytes) -> None:
    """The prefill worker's transport connected to the ticket's decode worker (as after
    an earlier request there)."""
    ticket, deadline = TransferTicket.unpack(packed), time.monotonic() + 10
    while (state := engine.kv_transport.connect(ticket)) is not None:
        assert state == CONNECTING and time.monotonic() < deadline, state
        time.sleep(0.01)


def test_a_ticket_given_before_the_first_step_sends_layer_by_layer(pair, prompts, expected):
    prefill, decode = pair
    free = _free(prefill, decode)
    run = Late(prefill, decode)
    for i, p in enumerate(prompts):
        run.add(f"r{i}", p)
        run.reserve(f"r{i}")
    _connect(prefill, run.tickets["r0"])
    for rid in run.prompts:
        assert run.give(rid) == []
        request = prefill.scheduler.get_request(rid)
        assert request.kv_ticket is not None and not request.ticket_follows  # attached
    run.run()
    assert run.tokens == expected
    assert run.layer_by_layer == set(run.prompts)
    _assert_kv_arrived(run)
    assert _free(prefill, decode) == free


def test_a_ticket_that_comes_mid_prefill_waits_for_the_first_token(pair, prompts, expected):
    """Given after the first of two prompt chunks: the prompt goes on computing, and its
    KV goes out in the step after the one that reads its first token back (that step's
    outputs, the first token among them, go out first)."""
    prefill, decode = pair
    free = _free(prefill, decode)
    run = Late(prefill, decode)
    run.add("r3", prompts[3])  # 41 tokens: chunks of 24 and 17
    run.step_prefill()
    request = prefill.scheduler.get_request("r3")
    assert 0 < request.num_computed_tokens < len(prompts[3])
    _connect(prefill, run.reserve("r3"))
    assert run.give("r3") == []
    assert request.kv_ticket is None and request.ticket_follows  # kept beside the request
    run.step_prefill_until(lambda: "r3" in run.first_ahead)
    assert request.kv_ticket is None and prefill.has_runnable_requests()  # not sent yet
    run.step_prefill()
    assert request.kv_ticket is not None and not request.ticket_follows  # sent in the next
    run.run()
    assert run.tokens["r3"] == expected["r3"]
    assert not run.layer_by_layer
    _assert_kv_arrived(run)
    assert _free(prefill, decode) == free


@pytest.mark.parametrize("when", ["computing", "waiting", "ticket_in"])
def test_an_abort_before_the_kv_went_out_frees_both_sides(pair, prompts, when):
    """``computing``: mid-prefill, no ticket; ``waiting``: the first token is out and the
    decode worker has reserved, the ticket not given yet (the ingress aborts both);
    ``ticket_in``: the ticket came mid-prefill, and the decode worker hears of the
    cancel from the prefill worker."""
    prefill, decode = pair
    free = _free(prefill, decode)
    run = Late(prefill, decode)
    run.add("x", prompts[3])
    run.step_prefill()  # its first chunk
    if when != "computing":
        run.reserve("x")
    if when == "waiting":
        run.step_prefill_until(lambda: "x" in run.first_ahead)
    if when == "ticket_in":
        run.give("x")
    assert prefill.abort_request("x")
    assert prefill.handoff.worker.drop_late("x") is None  # nothing of it is left
    if when == "waiting":
        decode.abort_request("x")
    deadline = time.monotonic() + 10
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        assert time.monotonic() < deadline, "the abort did not reach both sides"
        run.step_prefill()
        run.step_decode()
    assert "x" not in run.ends  # an aborted request's stream was closed by its caller
    if when == "ticket_in":
        assert "cancelled" in run.finished["x"].error
    assert _free(prefill, decode) == free
    assert prefill.kv_transport.num_in_flight == 0 and decode.kv_transport.num_in_flight == 0


def test_a_ticket_that_never_comes_fails_the_request_and_frees_its_blocks(pair, prompts):
    """An ingress that neither sends the ticket nor aborts (the connection left open): past
    ``kv_transfer.timeout_s`` after its first token the request fails and its blocks
    return; a request whose ticket came goes on."""
    prefill, decode = pair
    free = _free(prefill, decode)
    prefill.handoff.worker.ticket_timeout_s = 0.3
    run = Late(prefill, decode)
    run.add("lost", prompts[0])
    run.add("r1", prompts[1])
    run.step_prefill_until(lambda: len(run.first_ahead) == 2)
    run.reserve("r1")
    run.give("r1")
    run.step_prefill_until(lambda: "lost" in run.ends, timeout=5.0)
    out = run.ends["lost"]
    assert out.outputs[0].finish_reason == "error"
    assert "no KV ticket came within 0.3 s (kv_transfer.timeout_s)" in out.error
    run.run()
    assert run.ends["r1"].outputs[0].finish_reason == "transferred"
    assert _free(prefill, decode) == free


def test_an_invalid_late_ticket_fails_that_request_alone(pair, prompts, expected):
    prefill, decode = pair
    free = _free(prefill, decode)
    run = Late(prefill, decode)
    run.add("r0", prompts[0])
    run.add("bad", prompts[1])
    run.add("junk", prompts[2])
    run.step_prefill_until(lambda: len(run.first_ahead) == 3)
    run.reserve("bad", prompts[1][:-2])  # the decode worker reserved for 15 tokens
    (out,) = run.give("bad")
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert "invalid KV ticket: the ticket covers 15 tokens, the prompt has 17" in out.error
    (out,) = prefill.give_ticket("junk", b"\x00not a ticket")
    assert out.finished and out.error.startswith("invalid KV ticket")
    decode.abort_request("bad")  # the ingress does this when the prefill fails
    del run.tokens["bad"]
    assert prefill.give_ticket("bad", run.tickets["bad"]) == []  # ended: nothing more
    run.reserve("r0")
    run.give("r0")
    run.run()
    assert run.tokens == {"r0": expected["r0"]}
    assert run.ends["r0"].outputs[0].finish_reason == "transferred"
    assert _free(prefill, decode) == free


def test_ticket_follows_is_for_prefill_workers_only(pair, checkpoint):
    prefill, decode = pair
    mixed = LLMEngine(_config(checkpoint, "mixed", block_size=16))
    try:
        for engine in (decode, mixed):
            with pytest.raises(InvalidRequestError, match="ticket_follows is for a prefill"):
                engine.add_request("x", [1, 2, 3], GREEDY, ticket_follows=True)
            assert not engine.has_unfinished_requests()
            assert engine.give_ticket("x", b"") == []
    finally:
        mixed.close()
    decode.add_remote_request("t", [1, 2, 3], GREEDY)
    (out,) = decode.issue_tickets()
    with pytest.raises(InvalidRequestError, match="not both"):
        prefill.add_request("t", [1, 2, 3], GREEDY, kv_ticket=out.kv_ticket, ticket_follows=True)
    assert prefill.give_ticket("t", out.kv_ticket) == []  # unknown here
    assert not prefill.has_unfinished_requests()
    decode.abort_request("t")


def test_late_tickets_with_mtp_send_the_same_kv_and_drafts_as_tickets_up_front(tmp_path):
    """MTP K = 2 on both sides: with the tickets given late, the decode worker's tokens,
    its drafts' acceptance and the MTP layer's prompt KV are those of tickets given with
    the prompt."""
    from tests.mtp_checkpoints import write_glm4_moe_drafter
    from tests.test_spec_decode import prompts as mtp_prompts
    from tests.test_spec_decode_handoff import GREEDY as MTP_GREEDY
    from tests.test_spec_decode_handoff import _engine

    path = write_glm4_moe_drafter(tmp_path / "glm")
    batch = [mtp_prompts()[2] + mtp_prompts()[3], mtp_prompts()[1]]  # 37 (3 chunks), 9
    results = []
    for late in (False, True):
        prefill = _engine(path, "prefill", 2, block_size=16)
        decode = _engine(path, "decode", 2)
        free = _free(prefill, decode)
        if late:
            run = Late(prefill, decode, MTP_GREEDY)
            for i, p in enumerate(batch):
                run.add(f"r{i}", p)
            run.step_prefill_until(lambda r=run: len(r.first_ahead) == len(batch))
            for rid in run.prompts:
                run.reserve(rid)
                run.give(rid)
            run.run()
            assert not run.layer_by_layer
        else:
            run = Handoff(prefill, decode)
            for i, p in enumerate(batch):
                run.submit(f"r{i}", p, MTP_GREEDY)
            run.run()
        tickets = {rid: TransferTicket.unpack(t) if late else t for rid, t in run.tickets.items()}
        mtp_kv = {  # the MTP layer's K and V, as the decode worker has them
            rid: _slots_content(decode, t.block_ids, 0, len(batch[int(rid[1:])]))[-2:]
            for rid, t in tickets.items()
        }
        assert all(t.num_layers == decode.hf_config.num_hidden_layers + 1 for t in tickets.values())
        spec = (decode.spec_stats.num_draft_tokens, decode.spec_stats.num_accepted_tokens)
        results.append((run.tokens, spec, mtp_kv))
        assert _free(prefill, decode) == free
        prefill.close()
        decode.close()
    (tokens, spec, kv), (late_tokens, late_spec, late_kv) = results
    assert late_tokens == tokens and late_spec == spec and spec[0] > 0
    for rid in kv:
        for a, b in zip(kv[rid], late_kv[rid]):
            assert a.any() and torch.equal(a, b), rid


def test_late_ticket_and_ticket_follows_cross_the_codec():
    call = GenerateCall("a", [1, 2], GREEDY, ticket_follows=True)
    assert messages.decode(messages.encode(call)) == call
    late = LateTicket("a", b"\x00ticket")
    assert messages.decode(messages.encode(late)) == late


def test_engine_processes_hand_off_a_prompt_whose_ticket_follows(checkpoint, prompts, expected):
    """Real engine processes: the prefill engine computes the prompt and streams its first
    token before the decode engine is even called; the ticket then reaches it in a
    ``LateTicket``, and the decode engine's tokens are transformers'."""
    secret = "s3cret"

    def client(role: str, block_size: int) -> EngineClient:
        config = _config(checkpoint, role, block_size, max_num_batched_tokens=24)
        config.kv_transfer.auth_key = "late-ticket-test"  # one application's two workers
        return EngineClient(config, secret=secret)

    prefill, decode = client("prefill", 16), client("decode", 4)

    async def run():
        pf = await EngineConnection.open(prefill.address, secret, "prefill")
        df = await EngineConnection.open(decode.address, secret, "decode")
        prompt = prompts[3]
        prefill_stream = pf.generate(GenerateCall("r3", prompt, GREEDY, ticket_follows=True))
        (first,) = await asyncio.wait_for(anext(prefill_stream), 30)
        decode_stream = df.generate(GenerateCall("r3", prompt, GREEDY, remote=True))
        tokens, ends = [], []
        async for events in decode_stream:
            for event in events:
                if isinstance(event, TicketIssued):
                    pf.send_ticket("r3", event.ticket)
                elif isinstance(event, Delta):
                    tokens += event.token_ids
        async for events in prefill_stream:
            ends += events
        pf.close(), df.close()
        return first, tokens, ends

    try:
        first, tokens, ends = asyncio.run(asyncio.wait_for(run(), 60))
        assert isinstance(first, Delta) and first.token_ids == expected["r3"][:1]
        assert tokens == expected["r3"]
        assert [e.finish_reason for e in ends] == ["transferred"]
        for engine in (prefill, decode):
            deadline = time.monotonic() + 5
            while engine.stats.num_free_blocks != engine.stats.num_blocks:
                assert time.monotonic() < deadline, engine.stats
                time.sleep(0.05)
    finally:
        prefill.shutdown()
        decode.shutdown()
