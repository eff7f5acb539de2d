"""The NCCL receiver's data path: on a transfer's announce, every receive and scatter of
its plan is queued at once; the layers then flow with no CPU work here.

One transfer on the receiver (the sender's side is ``nccl_send.py``; per side, a
ring of two staging buffers, ``copier.py``; CUDA events order them)::

    "announce" {plan}   -- TCP -->   for each message i:
                                       recv i    (lane i % lanes; waits scatter i-2)
                                       scatter i (copy stream; waits recv i)
    "done" {layers}     -- TCP -->   wait for the last scatter, then "ack"

Scatter i runs during receive i+1. The receiver's ring belongs to the pair and
is kept from one transfer to the next, its first receives waiting for the
receives and scatters of the transfer before. The scatters are bound to the
transfer's slots and staging at set-up. Streams are per pair, not per transport:
a receive waiting for its sender must not hold up another pair's.

A transfer that nobody expects (or whose plan does not fit its ticket) is
received into the pair's ring all the same, so the pair stays in step, and
dropped. A receiver that drops a transfer clears its ``live`` flag, which the
fused scatter kernel reads when it starts: scatters not yet run write nothing,
and it waits only for a scatter that may be running. With torch copies it waits
for the scatters (so for the sender's bytes); a receive still pending at the
transfer's deadline aborts the pair (``nccl_pairs.py``).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from cupy.cuda import nccl

from splitserve.kernels.kv_gather_cuda import KVCopyLaunch
from splitserve.workers.kv.transfer.control import unknown_frame
from splitserve.workers.kv.transfer.copier import RING, Copier, TorchCopy, ring_size
from splitserve.workers.kv.transfer.event_pool import EventPool, record, wait
from splitserve.workers.kv.transfer.framing import Connection
from splitserve.workers.kv.transfer.nccl_pair import Pair, check_plan, wait_event
from splitserve.workers.kv.transfer.nccl_pairs import NcclPairs
from splitserve.workers.kv.transfer.transfers import Incoming, Transfers

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Recv:
    """The receives and scatters queued for one transfer (``_Landing.recv``)."""

    pair: Pair
    spare: list[torch.cuda.Event]  # from the pool: two per message, taken as queued
    live: torch.Tensor | None = None  # int32 flag the scatter kernel reads; None: torch copies
    copy: KVCopyLaunch | TorchCopy | None = None  # the scatters from the staging ring
    received: list[torch.cuda.Event] = field(default_factory=list)  # per message
    scattered: list[torch.cuda.Event] = field(default_factory=list)  # per message

    def record_next(self, done: list[torch.cuda.Event], stream: int) -> None:
        """Append to ``done`` a spare event marking what ``stream`` has queued now."""
        event = self.spare.pop()
        record(event, stream)
        done.append(event)


@dataclass(eq=False)
class _Landing:
    """What the receiver keeps for one expected transfer (``Incoming.data``)."""

    blocks_free: torch.cuda.Event  # the compute stream at expect: the blocks' last use
    live: torch.Tensor  # int32 1 from live_set on; 0 once the transfer is dropped
    live_set: torch.cuda.Event
    recv: _Recv | None = None  # from its announce on


class NcclRecvPath:
    """The receiver's half of the NCCL data path (``data_path.RecvPath``)."""

    def __init__(
        self,
        transfers: Transfers,
        pairs: NcclPairs,
        copier: Copier,
        events: EventPool,
        flag_stream: torch.cuda.Stream,
    ):
        self.transfers = transfers
        self.pairs = pairs
        self.copier = copier
        self.events = events
        self.flag_stream = flag_stream  # live flags: never waits on others
        self.device = copier.device

    def expect(self, inc: Incoming) -> None:
        """Mark the compute stream: the scatters wait for what is queued there now.

        The ticket's blocks may have been freed by a request whose last step is still
        queued (async scheduling); that step's writes must land before the KV. The
        transfer's live flag is made here too, not when its announce comes.
        """
        blocks_free = _record(torch.cuda.current_stream(self.device))
        live, live_set = self._live_flag()  # read only by fused scatters
        inc.data = _Landing(blocks_free, live, live_set)
        inc.release = functools.partial(self._release, inc)

    def on_frame(self, conn: Connection, header: dict[str, Any], payload: bytearray) -> None:
        kind = header["kind"]
        if kind == "announce":
            self._on_announce(conn, header)
        elif kind == "hello":
            self.pairs.on_hello(conn, header)
        elif kind == "layer":
            with self.transfers.lock:  # the transfer fails with the connection
                self.transfers.receiving(header["request_id"], conn)
            raise ConnectionError("the nccl KV transport takes no layer frames (a cpu sender?)")
        else:
            raise unknown_frame(kind)

    def settle(self, inc: Incoming, layers: int) -> str | None:
        """Wait for the last scatter, outside the lock; the receiver then finds it done."""
        recv = inc.data.recv
        if recv is None:
            return None
        inc.layers_received = layers  # the sender's count; no per-layer frames
        rid = inc.ticket.request_id
        if recv.scattered and not wait_event(recv.scattered[-1], recv.pair, inc.deadline):
            error = f"the KV of {rid} was not received by the transfer's deadline"
            self.pairs.abort(recv.pair, error)
            return error
        if self.transfers.tracer is not None:
            self.transfers.tracer("last_scatter_done", rid, time.perf_counter())
        return None

    def disconnected(self, conn: Connection) -> None:
        self.pairs.disconnected(conn)

    # ---- queueing a transfer's receives and scatters --------------------------

    def _on_announce(self, conn: Connection, header: dict[str, Any]) -> None:
        rid, tracer = header["request_id"], self.transfers.tracer
        if tracer is not None:
            tracer("announce_received", rid, time.perf_counter())
        pair = self.pairs.serving()
        if pair is None:
            raise ConnectionError("a KV announce frame arrived before the hello frame")
        plan = [(int(first), int(n)) for first, n in header["messages"]]
        layer_bytes = header["layer_bytes"]
        with self.transfers.lock:  # a cancel cannot release the blocks while their scatters queue
            try:
                self._post_receives(pair, conn, rid, plan, layer_bytes)
            except Exception as e:
                if not isinstance(e, (nccl.NcclError, ConnectionError)):
                    logger.exception("queueing the KV receives of %s failed", rid)
                self.pairs.abort(pair, f"NCCL recv failed: {type(e).__name__}: {e}")
                raise ConnectionError(f"NCCL recv failed: {e}") from e
            if tracer is not None:
                tracer("receives_posted", rid, time.perf_counter())

    def _post_receives(self, pair: Pair, conn: Connection, rid: str, plan, layer_bytes: int):
        """Queue every receive of a transfer and, for an expected one, its scatters.

        The first receives go before any other set-up (the plan's check, the scatters'
        binding): the sender may be waiting for them. Receive i reuses the buffer of
        message i - 2, after that message's scatter; scatter i is queued after receive
        i + 1, so receives stay ahead of the wire. A transfer nobody expects, or whose
        plan does not fit its ticket, is received into the ring all the same (the pair
        stays in step) and dropped.
        """
        if not plan:
            self._accept(conn, rid, plan, layer_bytes)
            return
        nbytes, count = ring_size(plan, layer_bytes)
        recv = _Recv(pair, self.events.take(2 * len(plan)))
        with pair.lock:
            pair.check_open()
            staging = self._recv_ring(pair, count * nbytes)
            ring = [staging.data_ptr() + j * nbytes for j in range(count)]
            for i in range(count):
                self._queue_recv(pair, rid, recv, ring, plan, i, layer_bytes)
            inc = self._accept(conn, rid, plan, layer_bytes)
            if inc is None:
                for i in range(count, len(plan)):
                    self._queue_recv(pair, rid, None, ring, plan, i, layer_bytes)
                self.events.give(recv.received + recv.spare)
                self._release_ring(pair)
                return
            recv.live = inc.data.live if self.copier.fused_copy else None
            inc.data.recv = recv
            self._prepare_scatters(pair, recv, inc, staging)
            for i in range(1, len(plan) + 1):
                if count <= i < len(plan):
                    self._queue_recv(pair, rid, recv, ring, plan, i, layer_bytes)
                slot = (i - 1) % count
                self._queue_scatter(pair, recv, plan[i - 1], slot * nbytes, inc)
            self._release_ring(pair)

    def _accept(self, conn: Connection, rid: str, plan, layer_bytes: int) -> Incoming | None:
        """The expected transfer ``rid``, now receiving; None when nobody expects it or
        its plan does not fit its ticket (it fails then). Caller holds the lock."""
        inc = self.transfers.incoming.get(rid)
        if inc is None:
            return None
        error = check_plan(inc.ticket, plan, layer_bytes)
        if error is not None:
            self.transfers.fail(rid, "recv", error)
            return None
        return self.transfers.receiving(rid, conn)  # RECEIVING, its deadline re-armed

    def _recv_ring(self, pair: Pair, nbytes: int) -> torch.Tensor:
        """The pair's receive staging ring, of at least ``nbytes``; caller holds its lock.

        The ring is kept from one transfer to the next: allocating it when an announce
        comes would delay the hand-off's start. It grows when a plan needs more. The
        receives queued next wait for all queued on it before (``_release_ring``).
        """
        if pair.ring_free is None:
            pair.ring_free = self.events.take(1)[0]  # the pair's own from now on
        if pair.ring is None or pair.ring.numel() < nbytes:
            with torch.cuda.stream(pair.copy_stream):
                pair.ring = self.copier.bytes(nbytes)  # the old one, if any, freed after its uses
            for lane in pair.lanes:
                pair.ring.record_stream(lane.stream)
        with pair.on_device():
            for lane in pair.lanes:
                wait(lane.handle, pair.ring_free)
        return pair.ring

    def _release_ring(self, pair: Pair) -> None:
        """Make the next transfer's receives wait for all that is queued on the pair's ring
        now: the scatters out of it (copy stream) and the receives into it (every lane;
        a dropped transfer's have no scatter). On different lanes, two receives into one
        ring buffer would otherwise run at once."""
        events = self.events.take(len(pair.lanes))
        with pair.on_device():
            for lane, event in zip(pair.lanes, events):
                record(event, lane.handle)
                wait(pair.copy_handle, event)
            record(pair.ring_free, pair.copy_handle)
        self.events.give(events)  # each wait is queued: they may be recorded again

    def _prepare_scatters(
        self, pair: Pair, recv: _Recv, inc: Incoming, staging: torch.Tensor
    ) -> None:
        """Order the copy stream after the blocks' last use and the live flag's write,
        and bind the scatters to the staging ring; before any scatter is queued."""
        with pair.on_device():
            wait(pair.copy_handle, inc.data.blocks_free)
            if recv.live is not None:
                wait(pair.copy_handle, inc.data.live_set)  # it holds 1
        if recv.live is not None:
            recv.live.record_stream(pair.copy_stream)
        inc.dst_slots.record_stream(pair.copy_stream)
        recv.copy = self.copier.bind(
            inc.dst_slots, staging, pair.copy_stream, inc.ticket, recv.live
        )

    def _queue_recv(
        self, pair: Pair, rid: str, recv: _Recv | None, ring, plan, i: int, layer_bytes: int
    ) -> None:
        """Receive message ``i`` into its ring buffer, once message i - 2's scatter is done."""
        lane, tracer = pair.lane(i).handle, self.transfers.tracer
        with pair.on_device():
            if recv is not None and i >= RING:
                wait(lane, recv.scattered[i - RING])
            if tracer is not None:
                stream = pair.lane(i).stream
                tracer("recv_launch", rid, time.perf_counter(), message=i, stream=stream)
            pair.recv(i, ring[i % len(ring)], plan[i][1] * layer_bytes)
            if tracer is not None:
                tracer("recv_queued", rid, time.perf_counter(), message=i, stream=stream)
            if recv is not None:
                recv.record_next(recv.received, lane)

    def _queue_scatter(
        self, pair: Pair, recv: _Recv, message: tuple[int, int], offset: int, inc: Incoming
    ) -> None:
        """Scatter ``message`` from byte ``offset`` of the staging ring, after its receive."""
        (first, layers), tracer = message, self.transfers.tracer
        with pair.on_device():
            wait(pair.copy_handle, recv.received[len(recv.scattered)])
            if tracer is not None:
                rid, stream = inc.ticket.request_id, pair.copy_stream
                fields = {"first": first, "layers": layers, "stream": stream}
                tracer("scatter_launch", rid, time.perf_counter(), **fields)
            recv.copy.scatter(first, layers, offset)
            if tracer is not None:
                tracer("scatter_queued", rid, time.perf_counter(), **fields)
            recv.record_next(recv.scattered, pair.copy_handle)

    def _live_flag(self) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A new int32 1 on the device, and the event after which it holds 1."""
        with torch.cuda.stream(self.flag_stream):
            live = torch.ones(1, dtype=torch.int32, device=self.device)
        return live, _record(self.flag_stream)

    # ---- the end of a transfer ------------------------------------------------

    def _release(self, inc: Incoming) -> None:
        """No scatter may write into the blocks after this returns (caller holds the lock)."""
        recv = inc.data.recv
        if recv is None:
            return
        if recv.scattered and not recv.scattered[-1].query():
            self._stop_scatters(inc, recv)
        self._give_events(recv)

    def _give_events(self, recv: _Recv) -> None:
        """Back to the pool once every receive and scatter is done (the last scatter
        waited for them all); otherwise they are left to the garbage collector."""
        if recv.scattered and recv.scattered[-1].query():
            self.events.give(recv.received + recv.scattered + recv.spare)
        recv.received, recv.scattered, recv.spare = [], [], []

    def _stop_scatters(self, inc: Incoming, recv: _Recv) -> None:
        """Make sure no scatter of ``recv`` writes from now on: through its live flag, or
        (torch copies) by waiting for them."""
        rid, pair, timeout_s = inc.ticket.request_id, recv.pair, self.transfers.timeout_s
        if recv.live is None:  # torch copies: wait for the sender's bytes, as far as it goes
            if not wait_event(recv.scattered[-1], pair, max(inc.deadline, time.monotonic() + 1)):
                self.pairs.abort(pair, f"a KV receive of {rid} was still pending")
                _wait_or_log(recv.scattered[-1], timeout_s, rid)
            return
        with torch.cuda.stream(self.flag_stream):
            recv.live.zero_()
        _record(self.flag_stream).synchronize()
        # Scatters that start from now on write nothing. One may have started before:
        # only one whose receive is done, so wait for the last of those (GPU work only).
        done = [i for i, event in enumerate(recv.received) if event.query()]
        if done:
            _wait_or_log(recv.scattered[done[-1]], timeout_s, rid)
        if len(done) < len(recv.received) and time.monotonic() > inc.deadline:
            self.pairs.abort(pair, f"a KV receive of {rid} was still pending at its deadline")


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait_or_log(event: torch.cuda.Event, timeout_s: float, rid: str) -> None:
    if not wait_event(event, None, time.monotonic() + timeout_s):
        logger.error("KV scatter of %s still pending after %.0f s", rid, timeout_s)
