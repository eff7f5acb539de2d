"""KV transport: bytes arrive unchanged in the receiver's own blocks, failures are reported."""

from __future__ import annotations

import os
import time

import pytest
import torch

from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.kv.transfer.cpu_transport import CpuKVTransport
from splitserve.workers.kv.transfer.ticket import (
    TransferDone,
    TransferTicket,
    token_slots,
)

NUM_LAYERS, HEADS, DIM = 3, 2, 8


def _cache(block_size: int, num_blocks: int = 32, dtype=torch.float32, heads=HEADS) -> KVCache:
    cache = KVCache(KVLayout(NUM_LAYERS, heads, DIM, block_size, dtype), num_blocks, "cpu")
    gen = torch.Generator().manual_seed(block_size)
    for t in cache.k + cache.v:
        t[1:] = torch.randn(t[1:].shape, generator=gen).to(dtype)  # page 0 stays zero
    return cache


def _tokens(cache: KVCache, layer: int, block_ids: list[int], start: int, end: int):
    slots = token_slots(block_ids, cache.block_size, start, end)
    k, v = cache.layer(layer)
    return k.view(-1, HEADS, DIM)[slots], v.view(-1, HEADS, DIM)[slots]


def _wait(transport, n: int = 1, timeout: float = 10.0):
    events, deadline = [], time.monotonic() + timeout
    while len(events) < n and time.monotonic() < deadline:
        events += transport.poll()
        time.sleep(0.005)
    return events


@pytest.fixture
def pair():
    sender = CpuKVTransport(_cache(block_size=16, dtype=torch.bfloat16), timeout_s=5.0)
    receiver = CpuKVTransport(_cache(block_size=4, dtype=torch.bfloat16), timeout_s=5.0)
    yield sender, receiver
    sender.close()
    receiver.close()


def _hand_off(sender, receiver, rid, src_blocks, dst_blocks, start, num_tokens, first=7):
    ticket = receiver.make_ticket(rid, dst_blocks, start, num_tokens, NUM_LAYERS)
    receiver.expect(ticket)
    ticket = TransferTicket.unpack(ticket.pack())  # it travels as msgpack
    sender.start_send(ticket, src_blocks)
    for layer in range(NUM_LAYERS):
        sender.send_layer(rid, layer)
    sender.finish_send(rid, TransferDone(rid, first, -0.5, [(first, -0.5), (3, -1.5)]))
    return ticket


def test_kv_arrives_byte_identical_across_block_sizes(pair):
    sender, receiver = pair
    src_blocks, dst_blocks = [5, 2, 9], [3, 11, 4, 20, 7, 8, 30, 1, 6, 12]  # 40 tokens
    before = [t.clone() for t in receiver.kv_cache.k + receiver.kv_cache.v]
    _hand_off(sender, receiver, "r1", src_blocks, dst_blocks, start=4, num_tokens=37)
    (recv_event,) = _wait(receiver)
    assert recv_event.ok and recv_event.side == "recv"
    assert recv_event.done.first_token == 7
    assert recv_event.done.top_logprobs == [(7, -0.5), (3, -1.5)]
    (send_event,) = _wait(sender)
    assert send_event.ok and send_event.side == "send"
    for layer in range(NUM_LAYERS):
        sent = _tokens(sender.kv_cache, layer, src_blocks, 4, 37)
        got = _tokens(receiver.kv_cache, layer, dst_blocks, 4, 37)
        for a, b in zip(sent, got):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # Tokens before start_token (the receiver's prefix hit) and every other slot are untouched.
    written = set(token_slots(dst_blocks, 4, 4, 37).tolist())
    for old, new in zip(before, receiver.kv_cache.k + receiver.kv_cache.v):
        flat_old, flat_new = old.view(-1, HEADS, DIM), new.view(-1, HEADS, DIM)
        untouched = [s for s in range(flat_old.shape[0]) if s not in written]
        assert torch.equal(flat_old[untouched], flat_new[untouched])
    assert sender.num_in_flight == 0 and receiver.num_in_flight == 0


def test_events_wake_the_owner_without_polling(pair):
    import threading

    sender, receiver = pair
    woke = threading.Event()
    receiver.notify = woke.set
    _hand_off(sender, receiver, "n1", [1], [1, 2], 0, 6)
    assert woke.wait(5.0)  # set by the transport thread, before anyone polled
    (event,) = receiver.poll()
    assert event.ok and event.done.first_token == 7


def test_many_transfers_to_one_peer_stay_ordered(pair):
    sender, receiver = pair
    for i in range(8):
        _hand_off(sender, receiver, f"r{i}", [1 + i], [1 + 4 * i, 2 + 4 * i], 0, 6, first=i)
    events = _wait(receiver, 8)
    assert sorted(e.done.first_token for e in events) == list(range(8))
    assert all(e.ok for e in events + _wait(sender, 8))


def test_the_tracer_sees_each_step_of_a_hand_off_in_order(pair):
    import threading

    from splitserve.workers.kv.transfer.tracing import EVENTS

    sender, receiver = pair
    seen: dict[str, list] = {"send": [], "recv": []}
    lock = threading.Lock()

    def tracer(side: str):
        def trace(event, request_id, at, **fields):
            with lock:
                seen[side].append((event, request_id, at, fields))

        return trace

    sender.tracer, receiver.tracer = tracer("send"), tracer("recv")
    _hand_off(sender, receiver, "t1", [1], [1, 2], 0, 6)
    assert [e.ok for e in _wait(receiver) + _wait(sender)] == [True, True]
    layers = range(NUM_LAYERS)
    assert [(e, f) for e, _, _, f in seen["send"]] == [
        ("send_started", {}),
        *[("layer_ready", {"layer": i}) for i in layers],
        ("finish_send", {"layers": NUM_LAYERS}),
        ("acked", {"ok": True}),
    ]
    assert [(e, f) for e, _, _, f in seen["recv"]] == [
        *[("layer_received", {"layer": i}) for i in layers],
        ("done_received", {"layers": NUM_LAYERS}),
        ("arrived", {}),
    ]
    steps = seen["send"] + seen["recv"]
    assert {rid for _, rid, _, _ in steps} == {"t1"} and {e for e, *_ in steps} <= set(EVENTS)
    for side in seen.values():  # each side's clock runs forward
        assert [at for *_, at, _ in side] == sorted(at for *_, at, _ in side)
    at = {(e, f.get("layer")): t for e, _, t, f in steps}
    assert all(at["layer_ready", i] < at["layer_received", i] for i in layers)
    assert at["finish_send", None] < at["done_received", None] < at["arrived", None]
    assert at["arrived", None] < at["acked", None]


def test_receiver_cancel_nacks_the_sender(pair):
    sender, receiver = pair
    ticket = receiver.make_ticket("r1", [1, 2], 0, 8, NUM_LAYERS)
    receiver.expect(ticket)
    sender.start_send(ticket, [3])
    sender.send_layer("r1", 0)
    receiver.cancel("r1")
    for layer in range(1, NUM_LAYERS):
        sender.send_layer("r1", layer)
    sender.finish_send("r1", TransferDone("r1", 1))
    (event,) = _wait(sender)
    assert not event.ok and "no longer expects" in event.error
    assert receiver.poll() == []  # a cancel on this side reports nothing


def test_sender_cancel_fails_the_receiver(pair):
    sender, receiver = pair
    ticket = receiver.make_ticket("r1", [1, 2], 0, 8, NUM_LAYERS)
    receiver.expect(ticket)
    sender.start_send(ticket, [3])
    sender.send_layer("r1", 0)
    sender.cancel("r1")
    (event,) = _wait(receiver)
    assert not event.ok and "cancelled" in event.error
    assert sender.poll() == []


def test_missing_layers_fail_the_transfer(pair):
    sender, receiver = pair
    ticket = receiver.make_ticket("r1", [1, 2], 0, 8, NUM_LAYERS)
    receiver.expect(ticket)
    sender.start_send(ticket, [3])
    sender.send_layer("r1", 0)
    sender.finish_send("r1", TransferDone("r1", 1))
    (event,) = _wait(receiver)
    assert not event.ok and f"received 1 of {NUM_LAYERS} KV layers" in event.error
    (event,) = _wait(sender)
    assert not event.ok


def test_timeout_when_the_sender_never_comes():
    receiver = CpuKVTransport(_cache(4), timeout_s=0.2, start_timeout_s=0.4)
    try:
        receiver.expect(receiver.make_ticket("r1", [1, 2], 0, 8, NUM_LAYERS))
        assert _wait(receiver, timeout=0.3) == []  # past timeout_s: still waiting to start
        (event,) = _wait(receiver, timeout=3.0)
        assert not event.ok and "no KV transfer started within" in event.error
        assert receiver.num_in_flight == 0
    finally:
        receiver.close()


def test_the_receivers_deadline_starts_with_the_sender():
    """A prefill queued past ``timeout_s`` still hands off: the decode side's deadline
    runs from the sender's first frame; once started, a transfer has ``timeout_s``."""
    sender = CpuKVTransport(_cache(16), timeout_s=0.5)
    receiver = CpuKVTransport(_cache(4), timeout_s=0.5, start_timeout_s=30.0)
    try:
        ticket = receiver.make_ticket("queued", [1, 2], 0, 8, NUM_LAYERS)
        receiver.expect(ticket)
        time.sleep(0.8)  # the prefill waited in its queue
        assert receiver.poll() == []
        sender.start_send(ticket, [3])
        for layer in range(NUM_LAYERS):
            sender.send_layer("queued", layer)
        sender.finish_send("queued", TransferDone("queued", 7, None, []))
        events = _wait(receiver) + _wait(sender)
        assert [(e.side, e.ok) for e in events] == [("recv", True), ("send", True)]
        started = receiver.make_ticket("stuck", [3, 4], 0, 8, NUM_LAYERS)
        receiver.expect(started)
        sender.start_send(started, [5])
        sender.send_layer("stuck", 0)  # started, then the sender goes quiet
        (event,) = _wait(receiver, timeout=3.0)
        assert not event.ok and "timed out after" in event.error
    finally:
        sender.close()
        receiver.close()


def test_dead_receiver_fails_the_sender():
    sender = CpuKVTransport(_cache(16), timeout_s=5.0)
    receiver = CpuKVTransport(_cache(4), timeout_s=5.0)
    try:
        ticket = receiver.make_ticket("r1", [1, 2], 0, 8, NUM_LAYERS)
        receiver.expect(ticket)
        sender.start_send(ticket, [3])
        sender.send_layer("r1", 0)
        time.sleep(0.1)
        receiver.close()
        (event,) = _wait(sender)
        assert not event.ok and "went away" in event.error
        assert sender.num_in_flight == 0
    finally:
        sender.close()


def test_layout_mismatch_is_a_clear_error(pair):
    sender, _ = pair
    other = CpuKVTransport(_cache(4, dtype=torch.float32, heads=4))
    try:
        ticket = other.make_ticket("r1", [1, 2], 0, 8, NUM_LAYERS)
        with pytest.raises(ValueError, match="num_kv_heads: sender 2, receiver 4.*dtype"):
            sender.start_send(ticket, [3])
    finally:
        other.close()


def test_ticket_round_trips_through_msgpack():
    t = TransferTicket(
        "r", "10.0.0.1:5000", [1, 2], 3, 20, 36, KVLayout(37, 8, 128, 16, torch.bfloat16)
    )
    assert t.block_size == 16
    assert TransferTicket.unpack(t.pack()) == t


@pytest.mark.parametrize("first", [1, 2, 4])
@pytest.mark.parametrize("cap", [1, 2, 3, 8, 36, 64])
@pytest.mark.parametrize("num_layers", [0, 1, 4, 36, 61])
def test_nccl_message_plan_covers_every_layer_once_in_order(cap, num_layers, first):
    from splitserve.workers.kv.transfer.nccl_pair import message_plan

    plan = message_plan(cap, num_layers, first)
    layers = [start + j for start, n in plan for j in range(n)]
    assert layers == list(range(num_layers))
    assert all(1 <= n <= cap for _, n in plan)
    if num_layers >= 2 * first and first < cap:  # the first gather and the last scatter
        assert plan[0][1] == first and plan[-1][1] == first
    elif num_layers >= cap:  # no ramp: full messages, the rest last
        assert plan[0][1] == cap


def test_nccl_message_plan_grows_then_shrinks():
    from splitserve.workers.kv.transfer.nccl_pair import message_plan

    assert [n for _, n in message_plan(8, 36)] == [1, 2, 4, 8, 8, 6, 4, 2, 1]
    assert [n for _, n in message_plan(1, 3)] == [1, 1, 1]
    assert [n for _, n in message_plan(8, 36, first=2)] == [2, 4, 8, 8, 8, 4, 2]
    assert [n for _, n in message_plan(8, 36, first=8)] == [8, 8, 8, 8, 4]
    with pytest.raises(ValueError, match="at least 1"):
        message_plan(0, 36)
    with pytest.raises(ValueError, match="at least 1"):
        message_plan(8, 36, first=0)


@pytest.mark.parametrize("tokens", [512, 4096, 8192, 32768, 131072])
def test_nccl_messages_stay_under_the_byte_cap_for_long_prompts(tokens):
    """Qwen3-8B's KV (36 layers, 8 KV heads, head dim 128, bf16): up to 4k tokens the
    plan is the layer cap's; beyond, messages shrink to 128 MiB, and to one layer once a
    layer is larger."""
    from splitserve.workers.kv.transfer.nccl_pair import message_plan, transfer_plan

    layer_bytes, cap_bytes = 2 * tokens * 8 * 128 * 2, 128 << 20
    plan = transfer_plan(36, layer_bytes, 8, 1, cap_bytes)
    assert [start + j for start, n in plan for j in range(n)] == list(range(36))
    largest = max(n for _, n in plan)
    assert largest * layer_bytes <= max(cap_bytes, layer_bytes)
    if tokens <= 4096:
        assert plan == message_plan(8, 36)
    else:
        assert largest == max(1, cap_bytes // layer_bytes) < 8
    assert transfer_plan(36, layer_bytes, 8, 1, None) == message_plan(8, 36)


def test_nccl_messages_alternate_between_the_pair_lanes():
    from splitserve.workers.kv.transfer.nccl_pair import Lane, Pair

    lanes = [Lane(None, None), Lane(None, None)]
    pair = Pair("p->d#1", lanes, 1, None)
    assert [pair.lane(i) for i in range(5)] == [lanes[0], lanes[1], lanes[0], lanes[1], lanes[0]]
    alone = Pair("p->d#2", lanes[:1], 1, None)
    assert all(alone.lane(i) is lanes[0] for i in range(3))


def test_nccl_unique_ids_split_per_lane():
    from splitserve.workers.kv.transfer.nccl_pair import ID_BYTES, split_ids

    ids = bytes(range(ID_BYTES)) + bytes(ID_BYTES)
    assert split_ids(ids) == [bytes(range(ID_BYTES)), bytes(ID_BYTES)]
    for bad in (b"", ids[:-1]):
        with pytest.raises(ValueError, match=f"{ID_BYTES} bytes each"):
            split_ids(bad)


def test_nccl_kernels_are_capped_at_the_transports_thread_blocks_unless_the_env_says(
    monkeypatch,
):
    from splitserve.workers.kv.transfer.nccl_pair import NcclOptions, cap_ctas

    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    assert cap_ctas(None) is None and "NCCL_MAX_CTAS" not in os.environ
    assert cap_ctas(16) == 16 and os.environ["NCCL_MAX_CTAS"] == "16"
    assert cap_ctas(8) == 16  # NCCL read the first one: the process keeps it
    monkeypatch.setenv("NCCL_MAX_CTAS", "4")  # the user's own
    assert cap_ctas(16) == 4 and os.environ["NCCL_MAX_CTAS"] == "4"
    assert NcclOptions().max_ctas is None  # NCCL's own unless the config says
    with pytest.raises(ValueError, match="max_ctas must be at least 1 or None, got 0"):
        NcclOptions(max_ctas=0).check()


def test_an_unknown_frame_kind_ends_the_connection(pair):
    sender, receiver = pair
    ticket = receiver.make_ticket("r1", [1, 2], 0, 8, NUM_LAYERS)
    receiver.expect(ticket)
    sender.start_send(ticket, [3])
    sender.send_layer("r1", 0)  # ties the transfer to the connection
    sender.transfers.outgoing["r1"].peer.post({"kind": "bogus", "request_id": "r1"})
    (event,) = _wait(receiver)
    assert not event.ok and "went away" in event.error and "bogus" in event.error


class _Event:
    """Stands in for a CUDA event: completes after ``polls`` queries."""

    def __init__(self, polls: int):
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def test_nccl_wait_event_returns_on_completion_and_gives_up_at_deadline_or_abort():
    from splitserve.workers.kv.transfer.nccl_pair import Pair, wait_event

    pair = Pair("k", [], 1, None)
    event = _Event(polls=50)
    assert wait_event(event, pair, time.monotonic() + 5)
    assert event.polls == -1  # queried until it completed, not beyond
    never = _Event(polls=10**9)
    begin = time.monotonic()
    assert not wait_event(never, pair, begin + 0.05)
    assert 0.05 <= time.monotonic() - begin < 1.0
    pair.aborted = True
    assert not wait_event(never, pair, time.monotonic() + 5)


def test_nccl_pair_check_open_raises_once_aborted():
    from splitserve.workers.kv.transfer.nccl_pair import Pair

    pair = Pair("p->d#1", [], 1, None)
    pair.check_open()
    pair.aborted = True
    with pytest.raises(ConnectionError, match="p->d#1 was aborted"):
        pair.check_open()
