"""Prefill and decode engines hand a prompt's KV over the CPU transport.

The decode worker's KV must be byte-identical to what the prefill worker
computed (with different block sizes on the two sides), the tokens must equal
a single mixed engine's, and every block must come back on both sides.
"""

from __future__ import annotations

import time

import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.kv.transfer.ticket import TransferTicket, token_slots
from tests import checkpoints

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _config(path, role: str, block_size: int, **scheduler) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        device="cpu",
        role=role,
        cache=CacheConfig(block_size=block_size, num_kv_blocks=96),
        scheduler=SchedulerConfig(max_model_len=128, **scheduler),
        kv_transfer=KVTransferConfig(transport="cpu", timeout_s=10.0),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def pair(checkpoint, request):
    """A prefill and a decode engine, both with async scheduling or both without."""
    overlap = request.param
    prefill = LLMEngine(
        _config(
            checkpoint,
            "prefill",
            block_size=16,
            max_num_batched_tokens=24,
            async_scheduling=overlap,
        )
    )
    decode = LLMEngine(_config(checkpoint, "decode", block_size=4, async_scheduling=overlap))
    yield prefill, decode
    prefill.close()
    decode.close()


def test_the_transfer_settings_reach_the_transport(checkpoint, monkeypatch):
    """The config's NCCL settings, its control-plane key and the worker's id go to the
    transport factory; the CPU transport writes the id into its tickets."""
    import splitserve.workers.engine.llm_engine as engine_module

    made = {}
    real = engine_module.make_kv_transport

    def spy(*args, **kwargs):
        made.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "make_kv_transport", spy)
    config = _config(checkpoint, "decode", block_size=4)
    config.kv_transfer.lanes, config.kv_transfer.layers_per_message = 3, 4
    config.kv_transfer.max_message_mb, config.kv_transfer.max_ctas = 64, 16
    engine = LLMEngine(config, owner="decode-7")
    try:
        nccl = {"layers_per_message": 4, "first_message_layers": 1, "lanes": 3}
        nccl["max_message_bytes"], nccl["max_ctas"] = 64 << 20, 16
        assert made == {**nccl, "owner": "decode-7", "auth_key": None}
        ticket = engine.kv_transport.make_ticket("r", [1], 0, 4, 2)
        assert ticket.owner == "decode-7"
    finally:
        engine.close()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (length + 3 * i,), generator=g).tolist() for i in range(n)]


class Handoff:
    """Drives one prefill and one decode engine the way two workers would."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine):
        self.prefill, self.decode = prefill, decode
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}
        self.sent_kv: dict[str, list[torch.Tensor]] = {}  # prefill KV at hand-off time
        self.tickets: dict[str, TransferTicket] = {}
        self.first_ahead: dict[str, int] = {}  # the prefill's first token, before the KV
        self.first_times: dict[str, list] = {}  # each side's first token's times
        self._snapshot_at_done()

    def submit(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        self.decode.add_remote_request(rid, prompt, params)
        self.tokens[rid] = []
        self._prompts = getattr(self, "_prompts", {})
        self._prompts[rid] = (prompt, params)

    def run(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.finished) < len(self.tokens) and time.monotonic() < deadline:
            self.step()
        assert len(self.finished) == len(self.tokens), "requests did not finish in time"
        # Every request that goes on past its first token had it from the prefill first.
        going_on = {rid: toks[0] for rid, toks in self.tokens.items() if len(toks) > 1}
        assert {rid: self.first_ahead.get(rid) for rid in going_on} == going_on
        assert all(tok == self.tokens[rid][0] for rid, tok in self.first_ahead.items())

    def step(self) -> None:
        for out in self.decode.step():
            if out.kv_ticket is not None:
                ticket = TransferTicket.unpack(out.kv_ticket)
                self.tickets[out.request_id] = ticket
                prompt, params = self._prompts[out.request_id]
                self.prefill.add_request(out.request_id, prompt, params, kv_ticket=out.kv_ticket)
            if out.new_token_ids and not self.tokens[out.request_id]:
                self.first_times.setdefault(out.request_id, []).append(out.first_token_times)
            self.tokens[out.request_id] += out.new_token_ids
            if out.finished:
                self.finished[out.request_id] = out
        for out in self.prefill.step():
            if not out.finished:  # the first token, returned before the KV is sent
                assert out.request_id not in self.first_ahead and not out.error
                (self.first_ahead[out.request_id],) = out.new_token_ids
                self.first_times.setdefault(out.request_id, []).append(out.first_token_times)
                continue
            assert out.outputs[0].finish_reason == "transferred", out.error
            assert out.new_token_ids == []  # its first token went out already
        time.sleep(0.001)

    def _snapshot_at_done(self) -> None:
        """Keep each request's prefill KV as it is when its "done" frame goes (every layer
        stored, the MTP layer's too; its blocks may be reused once it is acked)."""
        worker = self.prefill.handoff.worker
        finish_send = worker.finish_send

        def finish(request, *args):
            n = request.num_prompt_tokens
            self.sent_kv[request.request_id] = _slots_content(self.prefill, request.block_ids, 0, n)
            finish_send(request, *args)

        worker.finish_send = finish


def _slots_content(engine: LLMEngine, block_ids, start: int, end: int) -> list[torch.Tensor]:
    slots = token_slots(block_ids, engine.kv_cache.block_size, start, end)
    spec = engine.kv_cache.layout
    return [
        t.view(-1, spec.num_kv_heads, spec.head_dim)[slots]
        for layer in range(engine.handoff.scheduler.num_layers)
        for t in engine.kv_cache.layer(layer)
    ]


def test_disaggregated_tokens_and_kv_match_a_mixed_engine(pair, checkpoint):
    prefill, decode = pair
    free = (prefill.block_manager.num_free_blocks, decode.block_manager.num_free_blocks)
    prompts = _prompts(4, length=21, seed=3)  # 21..30 tokens: two prefill chunks each
    run = Handoff(prefill, decode)
    for i, p in enumerate(prompts):
        run.submit(f"r{i}", p)
    run.run()

    mixed = LLMEngine(_config(checkpoint, "mixed", block_size=8))
    for i, p in enumerate(prompts):
        mixed.add_request(f"r{i}", p, GREEDY)
    expected: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while mixed.has_unfinished_requests():
        for out in mixed.step():
            expected[out.request_id] += out.new_token_ids
    assert run.tokens == expected
    assert all(out.outputs[0].finish_reason == "length" for out in run.finished.values())
    # The decode side's first output says where the prefill worker's time went, as the
    # prefill worker's own first output did (whichever reaches a front first).
    for rid, (ahead, arrived) in run.first_times.items():
        assert arrived == ahead and ahead.prefill_s > 0 and ahead.queued_s >= 0, rid

    for i, p in enumerate(prompts):
        rid = f"r{i}"
        ticket = run.tickets[rid]
        assert ticket.block_size == 4 and ticket.start_token == 0 and ticket.num_tokens == len(p)
        sent = run.sent_kv[rid]
        got = _slots_content(decode, ticket.block_ids, 0, len(p))
        for a, b in zip(sent, got):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # byte-identical
    # Every block is back (cached prefixes count as free) and no transfer is left.
    assert prefill.block_manager.num_free_blocks == free[0]
    assert decode.block_manager.num_free_blocks == free[1]
    assert prefill.kv_transport.num_in_flight == 0 and decode.kv_transport.num_in_flight == 0


def test_first_token_is_returned_before_the_decode_forward(pair):
    prefill, decode = pair
    (prompt,) = _prompts(1, length=21, seed=4)
    decode.add_remote_request("f", prompt, GREEDY)
    (out,) = decode.step()
    prefill.add_request("f", prompt, GREEDY, kv_ticket=out.kv_ticket)
    while prefill.step() == [] and prefill.has_unfinished_requests():
        pass
    deadline, outs = time.monotonic() + 10, []
    while not outs and time.monotonic() < deadline:
        outs = decode.step()
    (first,) = outs
    assert len(first.new_token_ids) == 1
    # The step handed the first token out without computing its KV yet.
    assert decode.scheduler.get_request("f").num_computed_tokens == len(prompt)
    decode.abort_request("f")


def test_a_ticket_goes_out_before_the_decode_forward(pair):
    """While the decode worker decodes other requests, a remote request's ticket leaves
    in a step of its own: the prefill worker starts a decode step earlier."""
    _, decode = pair
    (busy, prompt) = _prompts(2, length=21, seed=6)
    decode.add_request("busy", busy, GREEDY)
    while not decode.step():  # its prompt, then its first token
        pass
    decode.add_remote_request("t", prompt, GREEDY)
    before = decode.scheduler.get_request("busy").num_computed_tokens
    outs = decode.step()
    assert [o.request_id for o in outs if o.kv_ticket] == ["t"]
    assert not any(o.new_token_ids for o in outs)
    # No forward ran in that step (with async scheduling one may be in flight from
    # the step before, and is read back later).
    assert decode.scheduler.get_request("busy").num_computed_tokens == before
    decode.abort_request("t")
    decode.abort_request("busy")
    while decode.has_unfinished_requests():
        decode.step()


def test_decode_prefix_hit_moves_only_the_suffix(pair):
    prefill, decode = pair
    (prompt,) = _prompts(1, length=26, seed=5)
    first = Handoff(prefill, decode)
    first.submit("a", prompt)
    first.run()
    second = Handoff(prefill, decode)
    second.submit("b", prompt)
    second.run()
    ticket = second.tickets["b"]
    assert ticket.start_token == 24  # six full 4-token blocks were cached on the decode side
    assert second.tokens["b"] == first.tokens["a"]
    assert decode.num_cached_prefix_tokens(prompt) == 24


def test_seeded_sampling_continues_across_the_hand_off(pair, checkpoint):
    prefill, decode = pair
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=1234, logprobs=2)
    (prompt,) = _prompts(1, length=11, seed=9)
    run = Handoff(prefill, decode)
    run.submit("s", prompt, params)
    run.run()
    mixed = LLMEngine(_config(checkpoint, "mixed", block_size=16))
    mixed.add_request("s", prompt, params)
    expected, logprobs = [], None
    while mixed.has_unfinished_requests():
        for out in mixed.step():
            expected += out.new_token_ids
            logprobs = out.outputs[0].logprobs
    assert run.tokens["s"] == expected
    got = run.finished["s"].outputs[0].logprobs
    assert [lp.token_id for lp in got] == [lp.token_id for lp in logprobs]
    assert got[0].logprob == pytest.approx(logprobs[0].logprob, abs=1e-5)
    assert [t for t, _ in got[0].top] == [t for t, _ in logprobs[0].top]


def test_abort_on_the_decode_side_frees_both(pair):
    prefill, decode = pair
    free = (prefill.block_manager.num_free_blocks, decode.block_manager.num_free_blocks)
    (prompt,) = _prompts(1, length=40, seed=11)
    run = Handoff(prefill, decode)
    run.submit("x", prompt)
    while "x" not in run.tickets:
        run.step()
    decode.abort_request("x")  # the client went away while the prefill is in flight
    deadline, ends = time.monotonic() + 10, []
    while prefill.has_unfinished_requests() and time.monotonic() < deadline:
        for out in prefill.step():  # the first token may come before the decode's cancel
            if out.finished:
                ends.append(out.error or "")
            else:
                assert len(out.new_token_ids) == 1
        time.sleep(0.001)
    assert len(ends) == 1 and "no longer expects" in ends[0]
    assert not prefill.has_unfinished_requests() and not decode.has_unfinished_requests()
    assert prefill.block_manager.num_free_blocks == free[0]
    assert decode.block_manager.num_free_blocks == free[1]


def test_abort_on_the_prefill_side_fails_the_decode_request(pair):
    prefill, decode = pair
    free = decode.block_manager.num_free_blocks
    (prompt,) = _prompts(1, length=40, seed=12)
    decode.add_remote_request("y", prompt, GREEDY)
    (out,) = decode.step()
    prefill.add_request("y", prompt, GREEDY, kv_ticket=out.kv_ticket)
    prefill.step()  # the first of two prompt chunks: nothing is sent before the last
    prefill.abort_request("y")
    deadline, outs = time.monotonic() + 10, []
    while decode.has_unfinished_requests() and time.monotonic() < deadline:
        outs += decode.step()
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
    assert "cancelled" in outs[-1].error
    assert decode.block_manager.num_free_blocks == free


def test_bad_tickets_and_roles_are_clear_errors(pair):
    prefill, decode = pair
    decode.add_remote_request("t", [1, 2, 3, 4, 5], GREEDY)
    (out,) = [o for o in decode.step() if o.kv_ticket]
    with pytest.raises(InvalidRequestError, match="covers 5 tokens, the prompt has 3"):
        prefill.add_request("t", [1, 2, 3], GREEDY, kv_ticket=out.kv_ticket)
    with pytest.raises(InvalidRequestError, match="only requests with a KV ticket"):
        prefill.add_request("u", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequestError, match="does not receive KV"):
        prefill.add_remote_request("v", [1, 2, 3], GREEDY)
    decode.abort_request("t")
    assert decode.kv_transport.num_in_flight == 0


def test_reservations_wait_for_free_blocks(checkpoint):
    decode = LLMEngine(_config(checkpoint, "decode", block_size=4, max_num_seqs=2))
    try:
        for i in range(3):
            decode.add_remote_request(f"w{i}", list(range(1, 9)), GREEDY)
        tickets = [o.request_id for o in decode.step() if o.kv_ticket]
        assert tickets == ["w0", "w1"]  # max_num_seqs=2 counts reserved requests
        decode.abort_request("w0")
        assert [o.request_id for o in decode.step() if o.kv_ticket] == ["w2"]
    finally:
        decode.close()


def test_a_hung_decode_worker_holds_up_only_the_requests_bound_to_it(pair, monkeypatch):
    """The prefill side connects to a decode worker off its loop: a receiver that takes
    the TCP connection and then says nothing (a stopped process) keeps only its own
    request waiting, which then fails alone; another request is handed off meanwhile."""
    import dataclasses
    import socket

    from splitserve.workers.kv.transfer import auth

    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT_S", 1.5)
    prefill, decode = pair
    hung = socket.create_server(("127.0.0.1", 0))  # accepts, never challenges
    free = prefill.block_manager.num_free_blocks
    try:
        prompt_a, prompt_b = _prompts(2, length=20, seed=21)
        decode.add_remote_request("a", prompt_a, GREEDY)
        decode.add_remote_request("b", prompt_b, GREEDY)
        tickets = {out.request_id: out.kv_ticket for out in decode.step()}
        ticket = TransferTicket.unpack(tickets["a"])
        lost = dataclasses.replace(ticket, address=f"127.0.0.1:{hung.getsockname()[1]}")
        prefill.add_request("a", prompt_a, GREEDY, kv_ticket=lost)
        prefill.add_request("b", prompt_b, GREEDY, kv_ticket=tickets["b"])
        outs, tokens, longest_step = {}, [], 0.0
        deadline = time.monotonic() + 20
        while (prefill.has_unfinished_requests() or decode.has_unfinished_requests()) and (
            time.monotonic() < deadline
        ):
            t0 = time.perf_counter()
            for out in prefill.step():
                outs[out.request_id] = out
            longest_step = max(longest_step, time.perf_counter() - t0)
            tokens += [
                t for out in decode.step() if out.request_id == "b" for t in out.new_token_ids
            ]
            if "a" in outs and decode.scheduler.get_request("a") is not None:
                decode.abort_request("a")  # the ingress does this when the prefill fails
            time.sleep(0.001)
        assert outs["a"].finished and "could not reach the decode worker" in outs["a"].error
        assert outs["b"].finished and outs["b"].error is None
        assert len(tokens) == GREEDY.max_tokens
        assert longest_step < 1.0, f"a step took {longest_step:.2f} s"
        assert prefill.block_manager.num_free_blocks == free
    finally:
        hung.close()
