"""NCCL KV transport between two Ray actors on two GPUs: bytes arrive unchanged, failures end.

Each actor owns a bf16 KV cache on its own GPU and an ``NcclKVTransport``; the
sender's rendezvous calls the receiver actor, which joins the communicator.
Run on a machine with two GPUs: ``python -m pytest -q -m gpu tests/test_kv_transfer_nccl.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("cupy")
ray = pytest.importorskip("ray")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 GPUs", allow_module_level=True)

from splitserve.workers.kv.cache import KVCache  # noqa: E402
from splitserve.workers.kv.layout import KVLayout  # noqa: E402
from splitserve.workers.kv.transfer.registry import make_kv_transport  # noqa: E402
from splitserve.workers.kv.transfer.ticket import (  # noqa: E402
    TransferDone,
    TransferTicket,
    token_slots,
)

pytestmark = pytest.mark.gpu

NUM_LAYERS, HEADS, DIM = 4, 4, 64
DEFAULT_LAYERS_PER_MESSAGE = 8
STALL_CYCLES = 4_000_000_000  # about 2 s of GPU clock


AUTH_KEY = "nccl-test-key"  # both actors' control plane (each process draws its own else)


class Side:
    """One worker: a KV cache on ``cuda:{device}`` and its NCCL transport."""

    def __init__(self, device: int, block_size: int, seed: int, num_blocks: int = 300):
        # Ray runs methods on several threads: name the device everywhere, never rely
        # on a thread's current one.
        self.device = torch.device("cuda", device)
        spec = KVLayout(NUM_LAYERS, HEADS, DIM, block_size, torch.bfloat16)
        self.cache = KVCache(spec, num_blocks, self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for t in self.cache.k + self.cache.v:  # page 0 stays zero
            t[1:] = torch.randn(t[1:].shape, generator=gen, device=t.device).to(t.dtype)
        self.peer = None
        self.transport = make_kv_transport(
            "nccl", self.cache, timeout_s=10.0, owner=f"gpu{device}",
            rendezvous=self._rendezvous, auth_key=AUTH_KEY,
        )  # fmt: skip

    def _rendezvous(self, ticket: TransferTicket, pair_key: str, unique_id: bytes) -> None:
        ray.get(self.peer.join.remote(pair_key, unique_id))

    def set_peer(self, peer) -> None:
        self.peer = peer

    def join(self, pair_key: str, unique_id: bytes) -> None:
        self.transport.join(pair_key, unique_id)

    def set_layers_per_message(self, n: int, first: int = 1) -> None:
        self.transport.options.layers_per_message = n
        self.transport.options.first_message_layers = first

    def set_max_message_bytes(self, nbytes: int | None) -> None:
        self.transport.options.max_message_bytes = nbytes

    def set_lanes(self, lanes: int) -> None:
        """The communicators of the pairs this side makes from now on."""
        self.transport.options.lanes = lanes

    def lane_counts(self) -> list[int]:
        """Lanes of each pair, sending ones first."""
        pairs = self.transport.pairs.sending_pairs() + self.transport.pairs.receiving_pairs()
        return [len(p.lanes) for p in pairs]

    def hold_newest_pair(self, cycles: int, lane: int | None = None) -> None:
        """Keep a lane (``None``: the copy stream) of the newest receiving pair busy."""
        pair = self.transport.pairs.receiving_pairs()[-1]
        stream = pair.copy_stream if lane is None else pair.lanes[lane].stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)

    def send_pair_keys(self) -> list[str]:
        return [pair.key for pair in self.transport.pairs.sending_pairs()]

    def receive_rings(self) -> dict[str, tuple[int, int]]:
        """(address, bytes) of each receiving pair's staging ring, by pair key."""
        pairs = self.transport.pairs.receiving_pairs()
        return {p.key: (p.ring.data_ptr(), p.ring.numel()) for p in pairs if p.ring is not None}

    def hold_copy_streams(self, cycles: int) -> None:
        """Keep each receiving pair's copy stream busy: the scatters queued next wait."""
        for pair in self.transport.pairs.receiving_pairs():
            with torch.cuda.device(self.device), torch.cuda.stream(pair.copy_stream):
                torch.cuda._sleep(cycles)

    def free_cuda_events(self) -> int:
        return self.transport.cuda_events.free

    def set_fused_copy(self, fused: bool) -> bool:
        if self.transport.copier.kernel is None:
            return False  # the kernels did not compile
        self.transport.copier.fused_copy = fused
        return True

    def expect(self, rid: str, block_ids: list[int], start: int, num_tokens: int) -> bytes:
        ticket = self.transport.make_ticket(rid, block_ids, start, num_tokens, NUM_LAYERS)
        self.transport.expect(ticket)
        return ticket.pack()

    def ticket(self, rid: str, block_ids: list[int], start: int, num_tokens: int) -> bytes:
        """A ticket this side does not expect."""
        return self.transport.make_ticket(rid, block_ids, start, num_tokens, NUM_LAYERS).pack()

    def send(
        self, ticket: bytes, src_blocks, layers=None, first=7, start=True, finish=True, stall=0
    ):
        t = TransferTicket.unpack(ticket)
        if start:
            self.transport.start_send(t, src_blocks)
        if stall:  # keep the compute stream busy, so the sends wait behind it
            with torch.cuda.device(self.device):
                torch.cuda._sleep(stall)
        for layer in range(NUM_LAYERS) if layers is None else layers:
            self.transport.send_layer(t.request_id, layer)
        if finish:
            self.transport.finish_send(t.request_id, TransferDone(t.request_id, first))

    def send_reporting_a_gather(self, ticket: bytes, src_blocks) -> bool:
        """Send with a two-layer first message, layer 0 reported behind a stalled compute
        stream; return whether the copy stream then held work (layer 0's gather, waiting
        for the stall) before layer 1 was reported."""
        t = TransferTicket.unpack(ticket)
        self.transport.options.first_message_layers = 2
        try:
            self.transport.start_send(t, src_blocks)
            (pair,) = self.transport.pairs.sending_pairs()
            with torch.cuda.device(self.device):
                torch.cuda._sleep(STALL_CYCLES // 8)
            self.transport.send_layer(t.request_id, 0)
            queued = not pair.copy_stream.query()
            for layer in range(1, NUM_LAYERS):
                self.transport.send_layer(t.request_id, layer)
            self.transport.finish_send(t.request_id, TransferDone(t.request_id, 7))
        finally:
            self.transport.options.first_message_layers = 1
        return queued

    def send_as_computed(self, ticket: bytes, src_blocks: list[int], seed: int) -> None:
        """Send each layer right after the compute stream rewrites it, behind a stall: the
        host reports every layer long before the GPU has written it."""
        t = TransferTicket.unpack(ticket)
        self.transport.start_send(t, src_blocks)
        blocks = torch.tensor(src_blocks, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.cuda.device(self.device):
            torch.cuda._sleep(STALL_CYCLES // 16)
            for layer in range(NUM_LAYERS):
                for cache in (self.cache.k[layer], self.cache.v[layer]):
                    shape = (len(src_blocks), *cache.shape[1:])
                    new = torch.randn(shape, generator=gen, device=self.device)
                    cache[blocks] = new.to(cache.dtype)
                self.transport.send_layer(t.request_id, layer)
        self.transport.finish_send(t.request_id, TransferDone(t.request_id, 7))

    def send_together(self, tickets: list[bytes], src_blocks: list[list[int]], layers: int):
        """Start several transfers, then send their layers interleaved, as one step does."""
        tickets = [TransferTicket.unpack(t) for t in tickets]
        for t, blocks in zip(tickets, src_blocks):
            self.transport.start_send(t, blocks)
        for layer in range(layers):
            for t in tickets:
                self.transport.send_layer(t.request_id, layer)
        for i, t in enumerate(tickets):
            self.transport.finish_send(t.request_id, TransferDone(t.request_id, i))

    def cancel(self, rid: str) -> None:
        self.transport.cancel(rid)

    def events(self, n: int = 1, timeout: float = 20.0) -> list[tuple]:
        events, deadline = [], time.monotonic() + timeout
        while len(events) < n and time.monotonic() < deadline:
            events += self.transport.poll()
            time.sleep(0.005)
        events += self.transport.poll()  # and nothing more must be pending
        first = [e.done.first_token if e.done else None for e in events]
        return [(e.request_id, e.side, e.ok, e.error, f) for e, f in zip(events, first)]

    def tokens(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """``[layers, 2, tokens, heads, dim]`` as int16 on the CPU."""
        slots = token_slots(block_ids, self.cache.block_size, start, end).to(self.device)
        kv = [
            torch.stack((_flat(k)[slots], _flat(v)[slots]))
            for k, v in zip(self.cache.k, self.cache.v)
        ]
        return torch.stack(kv).view(torch.int16).cpu()

    def clear(self, block_ids: list[int], start: int, end: int) -> None:
        slots = token_slots(block_ids, self.cache.block_size, start, end).to(self.device)
        for k, v in zip(self.cache.k, self.cache.v):
            _flat(k)[slots] = 0
            _flat(v)[slots] = 0

    def snapshot(self) -> torch.Tensor:
        """The whole cache as ``[layers, 2, slots, heads, dim]`` int16 on the CPU."""
        kv = [torch.stack((_flat(k), _flat(v))) for k, v in zip(self.cache.k, self.cache.v)]
        return torch.stack(kv).view(torch.int16).cpu()

    def in_flight(self) -> int:
        return self.transport.num_in_flight

    def gpu_drains(self, timeout: float = 10.0) -> bool:
        """No NCCL kernel is stuck: the device synchronises within ``timeout``."""
        thread = threading.Thread(target=torch.cuda.synchronize, args=(self.device,), daemon=True)
        thread.start()
        thread.join(timeout)
        return not thread.is_alive()


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, *cache.shape[2:])


RemoteSide = ray.remote(num_gpus=0, max_concurrency=4)(Side)


def _side(device: int, block_size: int, seed: int, num_blocks: int = 300):
    return RemoteSide.remote(device, block_size, seed, num_blocks)


def _connect(sender, receiver) -> None:
    ray.get(sender.set_peer.remote(receiver))


@pytest.fixture(scope="module")
def sides():
    # Actors ask for no Ray GPU and pick their device themselves: keep all GPUs visible.
    os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "0"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ray.init(num_cpus=8, include_dashboard=False, ignore_reinit_error=True)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    a, b = _side(0, block_size=16, seed=1), _side(1, block_size=32, seed=2)
    _connect(a, b)
    _connect(b, a)
    yield a, b
    ray.shutdown()


def _hand_off(sender, receiver, rid, src, dst, start, num_tokens, first=7, **kw):
    ticket = ray.get(receiver.expect.remote(rid, dst, start, num_tokens))
    ray.get(sender.send.remote(ticket, src, first=first, **kw))


def _assert_arrived(sender, receiver, src, dst, start, num_tokens):
    sent = ray.get(sender.tokens.remote(src, start, num_tokens))
    got = ray.get(receiver.tokens.remote(dst, start, num_tokens))
    assert torch.equal(sent, got)


@pytest.mark.parametrize("copy", ["fused", "torch"])
@pytest.mark.parametrize("layers_per_message", [1, 3, 8])
@pytest.mark.parametrize("direction", ["16->32", "32->16"])
def test_kv_arrives_byte_identical_across_block_sizes(sides, direction, layers_per_message, copy):
    sender, receiver = sides if direction == "16->32" else sides[::-1]
    for side in sides:  # the fused gather / scatter kernels compile on both GPUs
        assert ray.get(side.set_fused_copy.remote(copy == "fused"))
    big = direction == "32->16"  # the sender's blocks hold 32 tokens
    src = [5, 2, 9] if big else [5, 2, 9, 30, 17, 11]  # 96 tokens
    dst = [7, 40, 3, 12, 28, 1] if big else [7, 40, 3]
    ray.get(sender.set_layers_per_message.remote(layers_per_message))
    ray.get(receiver.clear.remote(dst, 20, 90))  # earlier cases sent the same bytes here
    before = ray.get(receiver.snapshot.remote())
    rid = f"ident-{direction}-{layers_per_message}-{copy}"
    _hand_off(sender, receiver, rid, src, dst, start=20, num_tokens=90)
    ((_, side, ok, error, first),) = ray.get(receiver.events.remote())
    assert ok and side == "recv" and first == 7, error
    ((_, side, ok, error, _),) = ray.get(sender.events.remote())
    assert ok and side == "send", error
    _assert_arrived(sender, receiver, src, dst, 20, 90)
    # Slots before start_token (a prefix hit) and every other slot are untouched.
    block = 16 if big else 32
    written = token_slots(dst, block, 20, 90)
    keep = torch.ones(before.shape[2], dtype=torch.bool)
    keep[written] = False
    after = ray.get(receiver.snapshot.remote())
    assert torch.equal(before[:, :, keep], after[:, :, keep])
    assert not torch.equal(before[:, :, written], after[:, :, written])
    assert ray.get(sender.in_flight.remote()) == 0 and ray.get(receiver.in_flight.remote()) == 0
    ray.get(sender.set_layers_per_message.remote(DEFAULT_LAYERS_PER_MESSAGE))
    for side in sides:
        ray.get(side.set_fused_copy.remote(True))


@pytest.mark.parametrize("lanes", [1, 3])
def test_a_pair_of_any_lane_count_delivers_the_kv_in_order(sides, lanes):
    """One message a layer, so consecutive messages (and a message and the one that
    reuses its staging buffer) go on different lanes, across transfer boundaries."""
    _, receiver = sides
    sender = _side(0, block_size=16, seed=7)
    ray.get(sender.set_lanes.remote(lanes))
    ray.get(sender.set_layers_per_message.remote(1))
    _connect(sender, receiver)
    for i in range(3):
        _hand_off(sender, receiver, f"lanes{lanes}-{i}", [1 + i, 4 + i], [50 + i], 0, 32, first=i)
    assert all(e[2] for e in ray.get(receiver.events.remote(3)))
    assert all(e[2] for e in ray.get(sender.events.remote(3)))
    # A dropped transfer's receives (no scatter waits for them) share the ring with the
    # next transfer's, on other lanes: the next one's bytes must still arrive intact.
    ticket = ray.get(receiver.expect.remote(f"lanes{lanes}-dropped", [60], 0, 32))
    ray.get(receiver.cancel.remote(f"lanes{lanes}-dropped"))
    ray.get(sender.send.remote(ticket, [10, 11]))
    assert not ray.get(sender.events.remote())[0][2]
    _hand_off(sender, receiver, f"lanes{lanes}-after", [12, 13], [61], 0, 32)
    assert [e[2] for e in ray.get(receiver.events.remote())] == [True]
    assert [e[2] for e in ray.get(sender.events.remote())] == [True]
    _assert_arrived(sender, receiver, [12, 13], [61], 0, 32)
    assert ray.get(sender.lane_counts.remote()) == [lanes]
    assert lanes in ray.get(receiver.lane_counts.remote())  # joined from the sender's ids
    for i in range(3):
        _assert_arrived(sender, receiver, [1 + i, 4 + i], [50 + i], 0, 32)
    ray.kill(sender)


def test_a_dropped_transfer_on_another_lane_cannot_write_into_the_next_ones_ring(sides):
    """Three lanes, one-layer messages: a dropped transfer's message 2 (lane 2) and the next
    transfer's message 0 (lane 0) use the same ring buffer. The receiver's lane 2 is held
    before the dropped transfer, its copy stream after it: unless the ring waits for every
    lane, the dropped bytes land between the next message 0's receive and its scatter."""
    _, receiver = sides
    sender = _side(0, block_size=16, seed=8)
    ray.get(sender.set_lanes.remote(3))
    ray.get(sender.set_layers_per_message.remote(1))
    _connect(sender, receiver)
    _hand_off(sender, receiver, "held-first", [1, 2], [70], 0, 32)  # the pair and its ring
    ray.get([receiver.events.remote(), sender.events.remote()])
    ticket = ray.get(receiver.expect.remote("held-dropped", [71], 0, 32))
    ray.get(receiver.cancel.remote("held-dropped"))
    ray.get(receiver.hold_newest_pair.remote(STALL_CYCLES // 4, lane=2))
    ray.get(sender.send.remote(ticket, [3, 4]))
    # The sender hears of the drop from the receiver's answer to its "done" frame, which
    # comes after the receiver queued the dropped receives and released the ring.
    assert [e[:3] for e in ray.get(sender.events.remote())] == [("held-dropped", "send", False)]
    ray.get(receiver.hold_newest_pair.remote(STALL_CYCLES // 2))  # the copy stream
    _hand_off(sender, receiver, "held-next", [5, 6], [72], 0, 32)
    assert [e[:3] for e in ray.get(sender.events.remote())] == [("held-next", "send", True)]
    assert [e[:3] for e in ray.get(receiver.events.remote())] == [("held-next", "recv", True)]
    _assert_arrived(sender, receiver, [5, 6], [72], 0, 32)
    ray.kill(sender)


def test_the_byte_cap_splits_messages_and_bounds_the_receive_ring(sides):
    """A cap of one layer's bytes: the 4-layer plan [1, 2, 1] goes as four one-layer
    messages, and the receiver's ring holds two layers, not two of the two-layer one."""
    _, receiver = sides
    sender = _side(0, block_size=16, seed=9)
    layer_bytes = 2 * 32 * HEADS * DIM * 2  # K and V of 32 tokens, bf16
    ray.get(sender.set_layers_per_message.remote(8))
    ray.get(sender.set_max_message_bytes.remote(layer_bytes))
    _connect(sender, receiver)
    _hand_off(sender, receiver, "capped", [1, 2], [80], 0, 32)
    assert [e[:3] for e in ray.get(receiver.events.remote())] == [("capped", "recv", True)]
    assert [e[:3] for e in ray.get(sender.events.remote())] == [("capped", "send", True)]
    _assert_arrived(sender, receiver, [1, 2], [80], 0, 32)
    (key,) = ray.get(sender.send_pair_keys.remote())
    assert ray.get(receiver.receive_rings.remote())[key][1] == 2 * layer_bytes
    ray.kill(sender)


def test_many_transfers_in_a_row_stay_ordered(sides):
    sender, receiver = sides
    ray.get(sender.set_layers_per_message.remote(2))
    free = None
    for i in range(12):  # 32 tokens each, from distinct blocks into distinct blocks
        _hand_off(sender, receiver, f"many{i}", [1 + 2 * i, 2 + 2 * i], [30 + i], 0, 32, first=i)
        if i == 0:  # after the pair's first transfer, which takes its ring's own event
            ray.get([receiver.events.remote(), sender.events.remote()])
            free = ray.get([side.free_cuda_events.remote() for side in sides])
    events = ray.get(receiver.events.remote(11))
    assert sorted(e[4] for e in events) == list(range(1, 12)) and all(e[2] for e in events)
    assert all(e[2] for e in ray.get(sender.events.remote(11)))
    # Each transfer's CUDA events went back to the pools: none made, none lost.
    assert ray.get([side.free_cuda_events.remote() for side in sides]) == free
    for i in range(12):
        _assert_arrived(sender, receiver, [1 + 2 * i, 2 + 2 * i], [30 + i], 0, 32)
    ray.get(sender.set_layers_per_message.remote(DEFAULT_LAYERS_PER_MESSAGE))


@pytest.mark.parametrize("copy", ["fused", "torch"])
def test_the_receive_ring_is_kept_and_refilled_only_after_its_scatters(sides, copy):
    """Two transfers announced together, each one message (so no receive of a transfer
    waits for its own scatters), while the receiver's copy stream is held: the second
    one's receive must wait for the first one's scatter out of the same ring buffer."""
    sender, receiver = sides
    if not ray.get(receiver.set_fused_copy.remote(copy == "fused")):
        pytest.skip("the fused copy kernels did not compile")
    ray.get(sender.set_layers_per_message.remote(NUM_LAYERS, NUM_LAYERS))
    _hand_off(sender, receiver, f"ring-{copy}", [3, 4], [5], 0, 30)
    ray.get([receiver.events.remote(), sender.events.remote()])
    (key,) = ray.get(sender.send_pair_keys.remote())
    ring = ray.get(receiver.receive_rings.remote())[key]
    ray.get(receiver.hold_copy_streams.remote(STALL_CYCLES // 4))
    specs = [([6, 7], [8]), ([9, 10], [11])]  # (sender blocks, receiver blocks)
    tickets = [
        ray.get(receiver.expect.remote(f"ring-{copy}-{i}", dst, 0, 30))
        for i, (_, dst) in enumerate(specs)
    ]
    ray.get(sender.send_together.remote(tickets, [src for src, _ in specs], NUM_LAYERS))
    assert all(e[2] for e in ray.get(receiver.events.remote(2)))
    assert all(e[2] for e in ray.get(sender.events.remote(2)))
    for src, dst in specs:
        _assert_arrived(sender, receiver, src, dst, 0, 30)
    assert ray.get(receiver.receive_rings.remote())[key] == ring  # the same buffer throughout
    ray.get(sender.set_layers_per_message.remote(DEFAULT_LAYERS_PER_MESSAGE))
    ray.get(receiver.set_fused_copy.remote(True))


@pytest.mark.parametrize("layers_per_message", [1, 2])
def test_transfers_started_together_share_the_pair_in_announce_order(sides, layers_per_message):
    sender, receiver = sides
    ray.get(sender.set_layers_per_message.remote(layers_per_message))
    # Different lengths, so mismatched NCCL messages would not line up in size either.
    specs = [
        ([40 + 3 * i, 41 + 3 * i], [60 + 4 * i, 61 + 4 * i, 62 + 4 * i], 20 + 10 * i)
        for i in range(3)
    ]
    tickets = [
        ray.get(receiver.expect.remote(f"together{layers_per_message}-{i}", dst, 0, n))
        for i, (dst, _, n) in enumerate(specs)
    ]
    ray.get(sender.send_together.remote(tickets, [src for _, src, _ in specs], NUM_LAYERS))
    events = ray.get(receiver.events.remote(3))
    assert sorted(e[4] for e in events) == [0, 1, 2] and all(e[2] for e in events), events
    assert all(e[2] for e in ray.get(sender.events.remote(3)))
    for dst, src, n in specs:
        _assert_arrived(sender, receiver, src, dst, 0, n)
    ray.get(sender.set_layers_per_message.remote(DEFAULT_LAYERS_PER_MESSAGE))


def test_a_layer_is_gathered_when_reported_not_when_its_message_is_complete(sides):
    """A prefill's layers are copied out as it computes them, so only the last one's
    gather is left when the prompt ends."""
    sender, receiver = sides
    src, dst = [11, 12], [13]
    ticket = ray.get(receiver.expect.remote("early", dst, 0, 32))
    assert ray.get(sender.send_reporting_a_gather.remote(ticket, src))
    ((_, _, ok, error, _),) = ray.get(receiver.events.remote())
    assert ok, error
    assert all(e[2] for e in ray.get(sender.events.remote()))
    _assert_arrived(sender, receiver, src, dst, 0, 32)


@pytest.mark.parametrize("copy", ["fused", "torch"])
def test_each_gather_waits_for_its_layers_compute(sides, copy):
    """A layer reported while the compute stream is still writing it arrives as written,
    not as it was (the gather waits for the compute stream, not for the host)."""
    sender, receiver = sides
    try:
        for side in sides:
            assert ray.get(side.set_fused_copy.remote(copy == "fused"))
        src, dst = [21, 22], [23]
        before = ray.get(sender.tokens.remote(src, 0, 32))
        ticket = ray.get(receiver.expect.remote(f"computed-{copy}", dst, 0, 32))
        seed = {"fused": 1, "torch": 2}[copy]  # values neither run wrote before
        ray.get(sender.send_as_computed.remote(ticket, src, seed))
        ((_, _, ok, error, _),) = ray.get(receiver.events.remote())
        assert ok, error
        assert all(e[2] for e in ray.get(sender.events.remote()))
        assert not torch.equal(before, ray.get(sender.tokens.remote(src, 0, 32)))
        _assert_arrived(sender, receiver, src, dst, 0, 32)
    finally:
        for side in sides:
            ray.get(side.set_fused_copy.remote(True))


@pytest.mark.parametrize("sent", [2, 3])  # plan (0, 1), (1, 2), (3, 1): 2 ends mid-message
def test_missing_layers_fail_the_transfer_and_the_pair_stays_in_step(sides, sent):
    sender, receiver = sides
    ticket = ray.get(receiver.expect.remote(f"ml{sent}", [1, 2], 0, 50))
    ray.get(sender.send.remote(ticket, [3, 4, 5, 6], layers=list(range(sent))))  # then "done"
    ((_, _, ok, error, _),) = ray.get(receiver.events.remote())
    assert not ok and f"received {sent} of {NUM_LAYERS} KV layers" in error, error
    ((_, _, ok, _, _),) = ray.get(sender.events.remote())
    assert not ok
    _hand_off(sender, receiver, f"ml{sent}-next", [7, 8], [9], 0, 32)
    assert [e[2] for e in ray.get(receiver.events.remote())] == [True]
    assert [e[2] for e in ray.get(sender.events.remote())] == [True]
    _assert_arrived(sender, receiver, [7, 8], [9], 0, 32)


def test_a_transfer_cancelled_before_its_announce_is_received_and_dropped(sides):
    sender, receiver = sides
    ticket = ray.get(receiver.expect.remote("early", [1, 2], 0, 50))
    ray.get(receiver.cancel.remote("early"))
    before = ray.get(receiver.snapshot.remote())
    ray.get(sender.send.remote(ticket, [3, 4, 5, 6]))
    ((_, _, ok, error, _),) = ray.get(sender.events.remote())
    assert not ok and "no longer expects" in error
    assert torch.equal(before, ray.get(receiver.snapshot.remote()))  # nothing scattered
    _hand_off(sender, receiver, "early-next", [7, 8], [9], 0, 32)
    assert [e[2] for e in ray.get(receiver.events.remote())] == [True]
    assert [e[2] for e in ray.get(sender.events.remote())] == [True]
    _assert_arrived(sender, receiver, [7, 8], [9], 0, 32)


def test_a_plan_that_does_not_fit_the_ticket_fails_and_the_pair_stays_in_step(sides):
    """The sender's ticket says 20 tokens, the receiver expects 30: its announce plans
    the wrong bytes a layer. The receiver fails the transfer, still receives the bytes
    (its first receives are queued before the check), and scatters none of them."""
    sender, receiver = sides
    _hand_off(sender, receiver, "misfit-before", [7, 8], [9], 0, 32)  # the pair is made
    ray.get([receiver.events.remote(), sender.events.remote()])
    ray.get(receiver.expect.remote("misfit", [1], 0, 30))
    wrong = ray.get(receiver.ticket.remote("misfit", [1], 0, 20))
    free = ray.get(receiver.free_cuda_events.remote())
    before = ray.get(receiver.snapshot.remote())
    ray.get(sender.send.remote(wrong, [3, 4]))
    ((_, side, ok, error, _),) = ray.get(receiver.events.remote())
    assert side == "recv" and not ok and "bytes a layer" in error, error
    ((_, _, ok, error, _),) = ray.get(sender.events.remote())
    assert not ok and "no longer expects" in error, error
    assert torch.equal(before, ray.get(receiver.snapshot.remote()))  # nothing scattered
    assert ray.get(receiver.free_cuda_events.remote()) == free  # its events went back
    _hand_off(sender, receiver, "misfit-next", [7, 8], [9], 0, 32)
    assert [e[2] for e in ray.get(receiver.events.remote())] == [True]
    assert [e[2] for e in ray.get(sender.events.remote())] == [True]
    _assert_arrived(sender, receiver, [7, 8], [9], 0, 32)


def test_receiver_cancel_nacks_the_sender_and_the_pair_stays_in_step(sides):
    sender, receiver = sides
    ticket = ray.get(receiver.expect.remote("rc", [1, 2], 0, 50))
    ray.get(sender.send.remote(ticket, [3, 4, 5, 6], layers=[0], finish=False))
    time.sleep(0.2)
    ray.get(receiver.cancel.remote("rc"))
    before = ray.get(receiver.snapshot.remote())
    ray.get(sender.send.remote(ticket, [3, 4, 5, 6], layers=range(1, NUM_LAYERS), start=False))
    ((_, _, ok, error, _),) = ray.get(sender.events.remote())
    assert not ok and "no longer expects" in error
    # The receives queued at the announce took the later layers; their scatters wrote nothing.
    assert torch.equal(before, ray.get(receiver.snapshot.remote()))
    assert ray.get(receiver.events.remote(timeout=0.5)) == []  # a cancel here reports nothing
    # The layers that went on after the cancel were received into the pair's ring and
    # dropped: the next transfer on the same communicator still lines up.
    _hand_off(sender, receiver, "rc-next", [7, 8], [9], 0, 32)
    assert [e[2] for e in ray.get(receiver.events.remote())] == [True]
    assert [e[2] for e in ray.get(sender.events.remote())] == [True]
    _assert_arrived(sender, receiver, [7, 8], [9], 0, 32)


def test_sender_cancel_fails_the_receiver_and_the_pair_stays_in_step(sides):
    sender, receiver = sides
    ticket = ray.get(receiver.expect.remote("sc", [1, 2], 0, 50))
    ray.get(sender.send.remote(ticket, [3, 4, 5, 6], layers=[0, 1], finish=False))
    ray.get(sender.cancel.remote("sc"))
    ((_, _, ok, error, _),) = ray.get(receiver.events.remote())
    assert not ok and "cancelled" in error
    assert ray.get(sender.events.remote(timeout=0.5)) == []
    _hand_off(sender, receiver, "sc-next", [7, 8], [9], 0, 32)
    assert [e[2] for e in ray.get(receiver.events.remote())] == [True]
    assert [e[2] for e in ray.get(sender.events.remote())] == [True]
    _assert_arrived(sender, receiver, [7, 8], [9], 0, 32)


def test_dead_receiver_fails_the_sender_without_a_stuck_send(sides):
    sender = _side(0, block_size=16, seed=6, num_blocks=2100)
    doomed = _side(1, block_size=32, seed=3, num_blocks=1100)
    _connect(sender, doomed)
    # 32768 tokens, 33.6 MB a layer: more than NCCL buffers without a live receiver.
    ticket = ray.get(doomed.expect.remote("dr", list(range(1, 1025)), 0, 32768))
    # The sends wait behind a busy compute stream while the receiver dies.
    ray.get(sender.send.remote(ticket, list(range(1, 2049)), finish=False, stall=STALL_CYCLES))
    ray.kill(doomed)
    ((rid, _, ok, error, _),) = ray.get(sender.events.remote())
    assert rid == "dr" and not ok and ("went away" in error or "failed" in error), error
    assert ray.get(sender.gpu_drains.remote(30.0))  # the communicator was aborted
    # A new receiver gets a new communicator.
    fresh = _side(1, block_size=32, seed=4)
    _connect(sender, fresh)
    _hand_off(sender, fresh, "dr-next", [7, 8], [9], 0, 32)
    assert [e[2] for e in ray.get(fresh.events.remote())] == [True]
    assert [e[2] for e in ray.get(sender.events.remote())] == [True]
    _assert_arrived(sender, fresh, [7, 8], [9], 0, 32)
    ray.kill(fresh)
    ray.kill(sender)


def test_dead_sender_fails_the_receiver_without_a_stuck_recv(sides):
    sender, receiver = sides
    doomed = _side(0, block_size=16, seed=5)
    _connect(doomed, receiver)
    ticket = ray.get(receiver.expect.remote("ds", [1, 2], 0, 50))
    # The headers go out at once, the sends wait behind a busy compute stream: the
    # receiver has posted receives that no send will ever match.
    ray.get(doomed.send.remote(ticket, [3, 4, 5, 6], finish=False, stall=STALL_CYCLES))
    time.sleep(0.3)
    ray.kill(doomed)
    ((rid, _, ok, error, _),) = ray.get(receiver.events.remote())
    assert rid == "ds" and not ok and "went away" in error, error
    assert ray.get(receiver.gpu_drains.remote(30.0))
    assert ray.get(receiver.in_flight.remote()) == 0
    # The receiver's other communicator is unaffected.
    _hand_off(sender, receiver, "ds-next", [7, 8], [9], 0, 32)
    assert [e[2] for e in ray.get(receiver.events.remote())] == [True]
    assert [e[2] for e in ray.get(sender.events.remote())] == [True]
    _assert_arrived(sender, receiver, [7, 8], [9], 0, 32)


CAP_SCRIPT = """
import os, torch
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.kv.transfer.registry import make_kv_transport
cache = KVCache(KVLayout(2, 2, 64, 16, torch.bfloat16), 8, torch.device("cuda", 0))
transport = make_kv_transport("nccl", cache, owner="cap", max_ctas=8)
print(os.environ.get("NCCL_MAX_CTAS"))
transport.close()
"""


@pytest.mark.parametrize("env, expected", [(None, "8"), ("4", "4")])
def test_the_transport_caps_nccls_thread_blocks_before_any_communicator(env, expected):
    """``max_ctas`` sets NCCL_MAX_CTAS in the worker's process when it is built (NCCL reads
    it once, at the first communicator); a value the user set stays."""
    environ = {k: v for k, v in os.environ.items() if k != "NCCL_MAX_CTAS"}
    if env is not None:
        environ["NCCL_MAX_CTAS"] = env
    done = subprocess.run(
        [sys.executable, "-c", CAP_SCRIPT], env=environ, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == expected
