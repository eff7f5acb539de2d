"""KV transport over NCCL: a pair of workers (prefill sender, decode receiver) is linked by
2-rank communicators, its lanes (``nccl_pair.Pair``; ``lanes``, two by default).

The control frames (hello, announce, done, ack, cancel) travel over the base
class's TCP connection; the KV bytes travel over NCCL, one message per group of
layers (``nccl_pair.message_plan``; a message holds at most ``max_message_bytes``,
128 MiB by default, unless one layer is larger), the messages alternating between
the lanes. A transfer sends no frame per layer: its "announce" frame, written at
``start_send`` (before the prefill computes), carries its message plan, and the
receiver queues every receive and scatter of the transfer at once. The layers
then flow with no CPU work on the receiver.

Making a pair (the first ``start_send`` from a sender to a receiver)::

    sender (rank 0)                              receiver (rank 1)
    _on_connect: a unique id per lane, pair key
      rendezvous(ticket, key, ids)  -- Ray call -->  join(key, ids): rank 1, in a thread
      rank 0 of each lane (blocks until rank 1 is in), then a warm-up send/recv on each
      "hello" {pair: key}           -- TCP ------->  _on_hello: this connection uses that pair

``rendezvous`` is the caller's: in serving it calls the decode worker that
``ticket.owner`` names, which calls ``join``; ``join`` returns at once.

One transfer (per side, a ring of two staging buffers; CUDA events order them; the
receiver's ring belongs to the pair and is kept from one transfer to the next, its
first receives waiting for the receives and scatters of the transfer before)::

    sender                                       receiver
    start_send: "announce" {plan}   -- TCP -->   _on_announce: for each message i,
                                                   recv i   (lane i % 2; waits scatter i-2)
                                                   scatter i (copy stream; waits recv i)
    send_layer(l), l in message i:
      gather l  (copy stream, into i's buffer;
                 waits the compute stream, and send i-2 for i's first layer)
      send i    (lane i % 2; once i's layers are gathered, waits those gathers)
    finish_send: "done" {layers}    -- TCP -->   _on_done: wait for the last scatter, "ack"

So each layer is gathered as soon as it is computed, message i+1's layers
during send i, and scatter i runs during recv i+1; the host never waits on the
hot path. Both sides bind their copy kernel to the transfer's slots and staging
at set-up, so a gather costs the host one kernel launch. Streams are per pair,
not per transport: a receive waiting for its sender must not hold up another
pair's. The compute stream never waits for the transport.

NCCL matches a pair's sends and receives by order, so both sides keep the
announce order: the sender queues a transfer's sends only after every send of
the transfers announced before it on the pair (``Pair.sending``), and every
announced message is sent. A transfer that ends early (cancelled, failed,
finished with layers missing) sends the rest of its plan from its staging
buffers as filler, and a receiver that does not expect a transfer receives it
into the pair's ring and drops it. A receiver that drops a transfer clears its ``live`` flag, which
the scatter kernel reads when it starts: scatters not yet run write nothing,
and it waits only for a scatter that may be running.

Failure: a communicator whose peer died cannot be reused (its pending kernels
never finish). The pair's are aborted (``comm.abort()`` ends them), dropped, and its TCP
connection closed, when the connection is lost, when an NCCL call fails, or
when a receive is still pending at its transfer's deadline. The other side sees
the connection close and aborts its end; the next ``start_send`` to that
receiver connects again and makes a new communicator. Only the rank-1 thread of
a rendezvous whose sender never came can linger (NCCL cannot abort a
communicator that is still being created); it holds no transfer.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve.kernels.kv_gather import gather_kv, scatter_kv
from splitserve.kernels.kv_gather_cuda import KVCopyLaunch, KVGatherKernel
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.base import Incoming, KVTransport, Outgoing, Peer, TransferState
from splitserve.workers.kv.transfer.event_pool import EventPool, record, wait
from splitserve.workers.kv.transfer.framing import Connection
from splitserve.workers.kv.transfer.nccl_pair import (
    Lane,
    Pair,
    communicator,
    message_plan,
    split_ids,
    transfer_plan,
    unique_id,
    wait_event,
)
from splitserve.workers.kv.transfer.ticket import TransferDone, TransferTicket

try:
    import cupy
    from cupy.cuda import nccl
except ImportError as e:  # pragma: no cover - machines without cupy
    raise ImportError(
        "the nccl KV transport needs cupy with NCCL (cupy-cuda12x or cupy-cuda13x)"
    ) from e

logger = logging.getLogger(__name__)

Rendezvous = Callable[[TransferTicket, str, bytes], Any]

_WARMUP_BYTES = 32 << 20  # the first send/recv of a pair connects its channels
_RING = 2  # staging buffers per transfer and side: message i reuses i - 2's
_SEND_EVENTS = 1 + 2 * _RING  # computed, staged per slot, sent per slot


@dataclass(eq=False)
class _Send:
    """The sender's progress through one transfer's plan (``Outgoing.extra["send"]``)."""

    pair: Pair
    plan: list[tuple[int, int]]  # (first layer, layers) per message
    layer_bytes: int
    compute: int  # the stream (handle) the layers are computed on: send_layer's current one
    # Reused events from the pool (each wait on one is queued before it is recorded
    # again): computed, then staged and sent per ring slot.
    events: list[torch.cuda.Event]
    ready: int = 0  # layers passed to send_layer
    gathered: int = 0  # layers whose gather is queued
    issued: int = 0  # messages whose send is queued
    dropped: bool = False  # the rest of the plan goes out as filler
    staging: torch.Tensor | None = None  # the ring: _RING slots, flat uint8, one allocation
    staging_at: int = 0  # its device address
    slot_bytes: int = 0  # one slot's size (the largest message)
    copy: KVCopyLaunch | None = None  # fused gathers into the ring (None: torch copies)

    @property
    def computed(self) -> torch.cuda.Event:
        """Recorded on the compute stream once a layer, for the copy stream to wait on."""
        return self.events[0]

    def staged(self, slot: int) -> torch.cuda.Event:
        """The gathers into ``slot`` that its send waits for."""
        return self.events[1 + slot]

    def sent(self, slot: int) -> torch.cuda.Event:
        """The last send from ``slot``, which the next gathers into it wait for."""
        return self.events[1 + _RING + slot]


@dataclass(eq=False)
class _Recv:
    """The receives and scatters queued for one transfer (``Incoming.extra["recv"]``)."""

    pair: Pair
    spare: list[torch.cuda.Event]  # from the pool: two per message, taken as queued
    live: torch.Tensor | None = None  # int32 flag the scatter kernel reads; None: torch copies
    copy: KVCopyLaunch | None = None  # fused scatters from the staging ring
    received: list[torch.cuda.Event] = field(default_factory=list)  # per message
    scattered: list[torch.cuda.Event] = field(default_factory=list)  # per message

    def record_next(self, done: list[torch.cuda.Event], stream: int) -> None:
        """Append to ``done`` a spare event marking what ``stream`` has queued now."""
        event = self.spare.pop()
        record(event, stream)
        done.append(event)


class NcclKVTransport(KVTransport):
    name = "nccl"
    # CUDA priority of the pairs' NCCL streams (lower is higher; 0 is the default's):
    # high, so NCCL's blocks start ahead of queued copy and compute kernels.
    nccl_stream_priority = -1

    def __init__(
        self,
        kv_cache: KVCache,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        owner: str = "",
        rendezvous: Rendezvous | None = None,
        layers_per_message: int = 8,
        fused_copy: bool = True,
        first_message_layers: int = 1,
        lanes: int = 2,
        max_message_bytes: int | None = 128 << 20,
    ):
        message_plan(layers_per_message, 1, first_message_layers)  # raises on a bad value
        if lanes < 1:
            raise ValueError(f"an NCCL pair needs at least one lane, got {lanes}")
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be at least 1, got {max_message_bytes}")
        self.rendezvous = rendezvous  # needed to send; a receive-only worker may leave it None
        # Sender side (receivers follow the announced plan): ``message_plan``'s cap and ramp.
        self.layers_per_message = layers_per_message
        self.first_message_layers = first_message_layers
        self.max_message_bytes = max_message_bytes  # lowers the cap for long prompts
        self.lanes = lanes  # communicators of each pair this side makes (the receiver joins them)
        self._send_pairs: dict[Peer, Pair] = {}
        self._recv_pairs: list[Pair] = []
        self._joined: dict[str, Pair | Exception] = {}  # by pair key, until its hello
        self._joined_cv = threading.Condition()
        # Each accepted connection has its own serve thread (base._serve_peer):
        # the pair of the connection a thread serves is thread-local.
        self._local = threading.local()
        super().__init__(kv_cache, host=host, timeout_s=timeout_s, owner=owner)
        self._kernel = KVGatherKernel.build(kv_cache.k, kv_cache.v)
        self._fused_copy = fused_copy and self._kernel is not None
        self._flag_stream = torch.cuda.Stream(self.device)  # live flags: never waits on others
        self._cuda_events = EventPool(self._flag_stream, ready=64)

    # ---- making pairs ---------------------------------------------------------

    def join(self, pair_key: str, unique_id: bytes) -> None:
        """Become rank 1 of the sender's pair ``pair_key``, in each communicator whose id
        ``unique_id`` holds (``nccl_pair.unique_id``); returns at once."""

        def run() -> None:
            try:
                pair: Pair | Exception = self._make_pair(pair_key, unique_id, rank=1)
            except Exception as e:
                logger.warning("joining NCCL communicator %s failed: %s", pair_key, e)
                pair = e
            with self._joined_cv:
                self._joined[pair_key] = pair
                self._joined_cv.notify_all()

        threading.Thread(target=run, name="kv-nccl-join", daemon=True).start()

    def _on_connect(self, peer: Peer, ticket: TransferTicket) -> None:
        me, them = self.owner or self.address, ticket.owner or ticket.address
        key = f"{me}->{them}#{uuid.uuid4().hex[:12]}"
        try:
            if self.rendezvous is None:
                raise ValueError(
                    "the nccl KV transport needs rendezvous=... to send: a callable "
                    "(ticket, pair_key, unique_id) that makes the receiver call join()"
                )
            uid = unique_id(self.lanes)
            self.rendezvous(ticket, key, uid)
            pair = self._connect_rank0(key, uid)
        except BaseException:
            peer.conn.close()
            raise
        pair.conn = peer.conn
        try:
            # Written here, not queued: the writer thread starts after this returns, and
            # the announce frames (also written directly) must come after the hello.
            peer.conn.send({"kind": "hello", "pair": key})
        except OSError as e:
            self._abort(pair, f"the hello frame could not be sent: {e}")  # closes the conn
            raise
        with self._lock:
            self._send_pairs[peer] = pair

    def _connect_rank0(self, key: str, uid: bytes) -> Pair:
        """Rank 0 blocks until rank 1 is in: do it in a thread, bounded by the timeout."""
        box: dict[str, Any] = {}
        gave_up = threading.Event()

        def run() -> None:
            try:
                box["pair"] = self._make_pair(key, uid, rank=0)
            except Exception as e:
                box["error"] = e
            if gave_up.is_set() and "pair" in box:
                self._abort(box["pair"], "made after its rendezvous timed out")

        thread = threading.Thread(target=run, name="kv-nccl-connect", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            gave_up.set()
            raise ConnectionError(
                f"NCCL communicator {key}: the receiver did not join within {self.timeout_s:.0f} s"
            )
        if "error" in box:
            error = box["error"]
            raise ConnectionError(f"NCCL communicator {key} failed: {error}") from error
        return box["pair"]

    def _make_pair(self, key: str, uid: bytes, rank: int) -> Pair:
        device = self.device
        lanes: list[Lane] = []
        try:
            for lane_id in split_ids(uid):  # both ranks make them in the same order
                with cupy.cuda.Device(device.index):
                    comm = communicator(lane_id, rank)
                stream = torch.cuda.Stream(device, priority=self.nccl_stream_priority)
                lanes.append(Lane(comm, stream))
        except BaseException:
            for lane in lanes:
                lane.comm.abort()
            raise
        pair = Pair(key, lanes, 1 - rank, torch.cuda.Stream(device))
        # NCCL connects a communicator's channels during its first send/recv, with
        # both ranks in the call: do that here, not under the first real transfer. The
        # bytes are whatever the buffer holds; it is freed once every lane is done.
        warm = self._bytes(_WARMUP_BYTES)
        for i in range(len(lanes)):
            (pair.send if rank == 0 else pair.recv)(i, warm.data_ptr(), _WARMUP_BYTES)
        for lane in lanes:
            lane.stream.synchronize()
        return pair

    def _on_hello(self, conn: Connection, header: dict[str, Any]) -> None:
        key = header["pair"]
        deadline = time.monotonic() + self.timeout_s
        with self._joined_cv:
            while key not in self._joined:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectionError(
                        f"NCCL communicator {key} was not joined within {self.timeout_s:.0f} s"
                    )
                self._joined_cv.wait(left)
            pair = self._joined.pop(key)
        if isinstance(pair, Exception):
            raise ConnectionError(f"joining NCCL communicator {key} failed: {pair}")
        pair.conn = conn
        with self._lock:
            self._recv_pairs.append(pair)
        self._local.pair = pair

    # ---- sender ---------------------------------------------------------------

    def expect(self, ticket: TransferTicket) -> None:
        """Also mark the compute stream: the scatters wait for what is queued there now.

        The ticket's blocks may have been freed by a request whose last step is still
        queued (async scheduling); that step's writes must land before the KV. The
        transfer's live flag is made here too, not when its announce comes.
        """
        super().expect(ticket)  # queues the copy of the slots, also waited for
        blocks_free = _record(torch.cuda.current_stream(self.device))
        live, live_set = self._live_flag()  # read only by fused scatters
        with self._lock:
            extra = self._incoming[ticket.request_id].extra
            extra["blocks_free"], extra["live"], extra["live_set"] = blocks_free, live, live_set

    def start_send(self, ticket: TransferTicket, src_block_ids: list[int]) -> None:
        """Open the transfer and announce its plan, so the receiver queues its receives now."""
        super().start_send(ticket, src_block_ids)
        rid = ticket.request_id
        with self._lock:
            out = self._outgoing[rid]
            pair = self._send_pairs.get(out.peer)
        try:
            if pair is None:
                raise ConnectionError(f"the NCCL communicator with {ticket.address} is gone")
            self._announce(out, pair)
        except BaseException:
            with self._lock:
                self._outgoing.pop(rid, None)
            raise

    def _announce(self, out: Outgoing, pair: Pair) -> None:
        t = out.ticket
        layer_bytes = self.transfer_bytes(t) // max(t.num_layers, 1)
        plan = transfer_plan(
            t.num_layers,
            layer_bytes,
            self.layers_per_message,
            self.first_message_layers,
            self.max_message_bytes,
        )
        compute = _current_stream(self.device)
        events = self._cuda_events.take(_SEND_EVENTS)
        send = out.extra["send"] = _Send(pair, plan, layer_bytes, compute, events)
        out.src_slots.record_stream(pair.copy_stream)
        if plan:
            self._stage(pair, out, send)  # now, not on the first layer's hot path
        header = {"kind": "announce", "request_id": t.request_id, "layer_bytes": layer_bytes}
        header["messages"] = [list(m) for m in plan]
        with pair.lock:  # the queue and the wire see the same order
            pair.check_open()
            pair.conn.send(header)
            pair.sending.append(out)

    def _stage(self, pair: Pair, out: Outgoing, send: _Send) -> None:
        """The transfer's staging ring (one allocation) and its bound gather launch."""
        nbytes = send.slot_bytes = max(layers for _, layers in send.plan) * send.layer_bytes
        count = min(_RING, len(send.plan))
        with torch.cuda.stream(pair.copy_stream):
            send.staging = self._bytes(count * nbytes)
        send.staging_at = send.staging.data_ptr()
        for lane in pair.lanes:
            send.staging.record_stream(lane.stream)
        if self.fused_copy:
            send.copy = self._kernel.bind(out.src_slots, send.staging, pair.copy_stream)

    def _send_layer_data(self, out: Outgoing, header: dict[str, Any]) -> None:
        send: _Send = out.extra["send"]
        if header["layer"] != send.ready:
            raise ValueError(
                f"send_layer({out.ticket.request_id!r}, {header['layer']}): the nccl KV "
                f"transport sends layers in order, the next is {send.ready}"
            )
        send.ready += 1
        send.compute = _current_stream(self.device)
        self._pump(send.pair)

    def finish_send(self, request_id: str, done: TransferDone) -> None:
        with self._lock:
            out = self._outgoing.get(request_id)
        if out is not None and out.state == TransferState.SENDING:
            send: _Send = out.extra["send"]
            if send.ready < out.ticket.num_layers:  # the receiver will fail it; keep in step
                send.dropped = True
                self._pump(send.pair)
        super().finish_send(request_id, done)

    def _post_done(self, peer: Peer, frame: dict[str, Any]) -> None:
        # No layer frames to follow: written now, not handed to the writer thread,
        # whose wake-up the receiver's end of the hand-off would wait for.
        try:
            peer.conn.send(frame)
        except OSError as e:
            self._peer_lost(peer, f"the done frame could not be sent: {e}")

    def _release_outgoing(self, out: Outgoing) -> None:
        send: _Send | None = out.extra.get("send")
        if send is not None and send.issued < len(send.plan):
            send.dropped = True
            self._pump(send.pair)

    def _pump(self, pair: Pair) -> None:
        """Queue what may go now on ``pair``: the oldest transfer's gathers and sends."""
        try:
            with pair.lock:
                while pair.sending and not pair.aborted:
                    out: Outgoing = pair.sending[0]
                    send: _Send = out.extra["send"]
                    self._advance(pair, out, send)
                    if send.issued < len(send.plan):
                        return
                    pair.sending.popleft()
                    send.staging = send.copy = None  # reused after their sends
                    self._cuda_events.give(send.events)
        except Exception as e:
            if not isinstance(e, nccl.NcclError):
                logger.exception("queueing a KV send failed")
            self._abort(pair, f"NCCL send failed: {type(e).__name__}: {e}")

    def _advance(self, pair: Pair, out: Outgoing, send: _Send) -> None:
        """Gather each layer that is in as soon as it is (one launch for those that came
        together), and send each message once all its layers are gathered."""
        while send.issued < len(send.plan):
            first, layers = send.plan[send.issued]
            if not send.dropped:
                end = min(send.ready, first + layers)
                if send.gathered < end:
                    self._gather_layers(pair, out, send, end)
                if send.gathered < first + layers:
                    return
            self._issue(pair, send)

    def _gather_layers(self, pair: Pair, out: Outgoing, send: _Send, end: int) -> None:
        """Queue the gather of layers ``send.gathered .. end - 1`` (all in message
        ``send.issued``) into that message's staging buffer, on the copy stream."""
        i = send.issued
        first = send.plan[i][0]
        slot = i % _RING
        with pair.on_device():
            record(send.computed, send.compute)  # the layers are computed
            wait(pair.copy_handle, send.computed)
            if send.gathered == first and i >= _RING:  # and the slot's last send is done
                wait(pair.copy_handle, send.sent(slot))
        begin, layers = send.gathered, end - send.gathered
        offset = slot * send.slot_bytes + (begin - first) * send.layer_bytes
        self._stage_layers(pair, out, send, begin, layers, offset)
        send.gathered = end

    def _stage_layers(
        self, pair: Pair, out: Outgoing, send: _Send, first: int, layers: int, offset: int
    ) -> None:
        """Gather ``layers`` layers from ``first`` into the staging ring at byte ``offset``."""
        if send.copy is not None:
            send.copy.gather(first, layers, offset)
            return
        kv = self._kv_view(send.staging[offset:], layers, out.ticket)
        self.gather(first, out.src_slots, kv, pair.copy_stream)

    def _issue(self, pair: Pair, send: _Send) -> None:
        """Queue the send of message ``send.issued``, after its gathers."""
        i = send.issued
        first, layers = send.plan[i]
        slot, lane = i % _RING, pair.lane(i).handle
        with pair.on_device():
            if send.gathered > first:  # its layers' gathers are queued (not filler)
                record(send.staged(slot), pair.copy_handle)
                wait(lane, send.staged(slot))
            at = send.staging_at + slot * send.slot_bytes
            pair.send(i, at, layers * send.layer_bytes)  # filler: whatever it holds
            record(send.sent(slot), lane)
        send.issued += 1

    def _peer_lost(self, peer: Peer, error: str) -> None:
        with self._lock:
            pair = self._send_pairs.pop(peer, None)
        if pair is not None:  # first, so the failed transfers queue no filler on it
            self._abort(pair, error)
        super()._peer_lost(peer, error)

    # ---- receiver -------------------------------------------------------------

    def _on_frame(self, conn: Connection, header: dict[str, Any]) -> None:
        if header["kind"] != "announce":
            return super()._on_frame(conn, header)
        pair: Pair | None = getattr(self._local, "pair", None)
        if pair is None:
            raise ConnectionError("a KV announce frame arrived before the hello frame")
        plan = [(int(first), int(n)) for first, n in header["messages"]]
        rid, layer_bytes = header["request_id"], header["layer_bytes"]
        with self._lock:  # a cancel cannot release the blocks while their scatters queue
            try:
                self._post_receives(pair, conn, rid, plan, layer_bytes)
            except Exception as e:
                if not isinstance(e, (nccl.NcclError, ConnectionError)):
                    logger.exception("queueing the KV receives of %s failed", rid)
                self._abort(pair, f"NCCL recv failed: {type(e).__name__}: {e}")
                raise ConnectionError(f"NCCL recv failed: {e}") from e

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
        nbytes = max(layers for _, layers in plan) * layer_bytes
        count = min(_RING, len(plan))
        recv = _Recv(pair, self._cuda_events.take(2 * len(plan)))
        with pair.lock:
            pair.check_open()
            staging = self._recv_ring(pair, count * nbytes)
            ring = [staging.data_ptr() + j * nbytes for j in range(count)]
            for i in range(count):
                self._queue_recv(pair, recv, ring, plan, i, layer_bytes)
            inc = self._accept(conn, rid, plan, layer_bytes)
            if inc is None:
                for i in range(count, len(plan)):
                    self._queue_recv(pair, None, ring, plan, i, layer_bytes)
                self._cuda_events.give(recv.received + recv.spare)
                self._release_ring(pair)
                return
            recv.live = inc.extra["live"] if self.fused_copy else None
            inc.extra["recv"] = recv
            self._prepare_scatters(pair, recv, inc, staging)
            for i in range(1, len(plan) + 1):
                if count <= i < len(plan):
                    self._queue_recv(pair, recv, ring, plan, i, layer_bytes)
                slot = (i - 1) % count
                self._queue_scatter(pair, recv, plan[i - 1], staging, slot * nbytes, inc)
            self._release_ring(pair)

    def _accept(self, conn: Connection, rid: str, plan, layer_bytes: int) -> Incoming | None:
        """The expected transfer ``rid``, now receiving; None when nobody expects it or
        its plan does not fit its ticket (it fails then). Caller holds the lock."""
        inc = self._incoming.get(rid)
        if inc is None:
            return None
        error = _check_plan(inc.ticket, plan, layer_bytes)
        if error is not None:
            self._fail(rid, "recv", error)
            return None
        inc.conn, inc.state = conn, TransferState.RECEIVING
        return inc

    def _recv_ring(self, pair: Pair, nbytes: int) -> torch.Tensor:
        """The pair's receive staging ring, of at least ``nbytes``; caller holds its lock.

        The ring is kept from one transfer to the next: allocating it when an announce
        comes cost about 90 us of the hand-off's start. It grows when a plan needs
        more. The receives queued next wait for all queued on it before (``_release_ring``).
        """
        if pair.ring_free is None:
            pair.ring_free = self._cuda_events.take(1)[0]  # the pair's own from now on
        if pair.ring is None or pair.ring.numel() < nbytes:
            with torch.cuda.stream(pair.copy_stream):
                pair.ring = self._bytes(nbytes)  # the old one, if any, freed after its uses
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
        events = self._cuda_events.take(len(pair.lanes))
        with pair.on_device():
            for lane, event in zip(pair.lanes, events):
                record(event, lane.handle)
                wait(pair.copy_handle, event)
            record(pair.ring_free, pair.copy_handle)
        self._cuda_events.give(events)  # each wait is queued: they may be recorded again

    def _prepare_scatters(
        self, pair: Pair, recv: _Recv, inc: Incoming, staging: torch.Tensor
    ) -> None:
        """Order the copy stream after the blocks' last use and the live flag's write,
        and bind the scatters to the staging ring; before any scatter is queued."""
        with pair.on_device():
            wait(pair.copy_handle, inc.extra["blocks_free"])
            if recv.live is not None:
                wait(pair.copy_handle, inc.extra["live_set"])  # it holds 1
        if recv.live is not None:
            recv.live.record_stream(pair.copy_stream)
        inc.dst_slots.record_stream(pair.copy_stream)
        if self.fused_copy:
            recv.copy = self._kernel.bind(inc.dst_slots, staging, pair.copy_stream, recv.live)

    def _queue_recv(self, pair: Pair, recv: _Recv | None, ring, plan, i: int, layer_bytes: int):
        """Receive message ``i`` into its ring buffer, once message i - 2's scatter is done."""
        lane = pair.lane(i).handle
        with pair.on_device():
            if recv is not None and i >= _RING:
                wait(lane, recv.scattered[i - _RING])
            pair.recv(i, ring[i % len(ring)], plan[i][1] * layer_bytes)
            if recv is not None:
                recv.record_next(recv.received, lane)

    def _queue_scatter(
        self, pair: Pair, recv: _Recv, message, staging: torch.Tensor, offset: int, inc: Incoming
    ) -> None:
        """Scatter ``message`` from byte ``offset`` of the staging ring, after its receive."""
        with pair.on_device():
            wait(pair.copy_handle, recv.received[len(recv.scattered)])
            self._unstage_layers(pair, recv, message, staging, offset, inc)
            recv.record_next(recv.scattered, pair.copy_handle)

    def _unstage_layers(
        self, pair: Pair, recv: _Recv, message, staging: torch.Tensor, offset: int, inc: Incoming
    ) -> None:
        """Scatter one received message into the transfer's blocks, on the copy stream."""
        first, layers = message
        if recv.copy is not None:
            recv.copy.scatter(first, layers, offset)
            return
        kv = self._kv_view(staging[offset:], layers, inc.ticket)
        self.scatter(first, inc.dst_slots, kv, recv.live, pair.copy_stream)

    def _live_flag(self) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A new int32 1 on the device, and the event after which it holds 1."""
        with torch.cuda.stream(self._flag_stream):
            live = torch.ones(1, dtype=torch.int32, device=self.device)
        return live, _record(self._flag_stream)

    def _on_done(self, conn: Connection, header: dict[str, Any]) -> None:
        # Wait for the last scatter here, outside the lock; base._on_done then finds it done.
        rid = header["request_id"]
        with self._lock:
            inc = self._incoming.get(rid)
        recv: _Recv | None = inc.extra.get("recv") if inc is not None else None
        if recv is not None:
            inc.layers_received = header["layers"]  # the sender's count; no per-layer frames
            if recv.scattered and not wait_event(recv.scattered[-1], recv.pair, inc.deadline):
                error = f"the KV of {rid} was not received by the transfer's deadline"
                self._abort(recv.pair, error)
                with self._lock:
                    self._fail(rid, "recv", error)
        super()._on_done(conn, header)

    def _recv_layer_data(self, inc: Incoming | None, header: dict, payload: bytearray) -> None:
        raise ConnectionError("the nccl KV transport takes no layer frames (a cpu sender?)")

    def _finish_incoming(self, inc: Incoming) -> None:
        recv: _Recv | None = inc.extra.get("recv")
        if recv is not None and recv.scattered:
            recv.scattered[-1].synchronize()  # done already (see _on_done)
            self._give_events(recv)

    def _give_events(self, recv: _Recv) -> None:
        """Back to the pool once every receive and scatter is done (the last scatter
        waited for them all); otherwise they are left to the garbage collector."""
        if recv.scattered and recv.scattered[-1].query():
            self._cuda_events.give(recv.received + recv.scattered + recv.spare)
        recv.received, recv.scattered, recv.spare = [], [], []

    def _release_incoming(self, inc: Incoming) -> None:
        """No scatter may write into the blocks after this returns (caller holds the lock)."""
        recv: _Recv | None = inc.extra.get("recv")
        if recv is None:
            return
        if recv.scattered and not recv.scattered[-1].query():
            self._stop_scatters(inc, recv)
        self._give_events(recv)

    def _stop_scatters(self, inc: Incoming, recv: _Recv) -> None:
        """Make sure no scatter of ``recv`` writes from now on: through its live flag, or
        (torch copies) by waiting for them."""
        rid, pair = inc.ticket.request_id, recv.pair
        if recv.live is None:  # torch copies: wait for the sender's bytes, as far as it goes
            if not wait_event(recv.scattered[-1], pair, max(inc.deadline, time.monotonic() + 1)):
                self._abort(pair, f"a KV receive of {rid} was still pending")
                _wait_or_log(recv.scattered[-1], self.timeout_s, rid)
            return
        with torch.cuda.stream(self._flag_stream):
            recv.live.zero_()
        _record(self._flag_stream).synchronize()
        # Scatters that start from now on write nothing. One may have started before:
        # only one whose receive is done, so wait for the last of those (GPU work only).
        done = [i for i, event in enumerate(recv.received) if event.query()]
        if done:
            _wait_or_log(recv.scattered[done[-1]], self.timeout_s, rid)
        if len(done) < len(recv.received) and time.monotonic() > inc.deadline:
            self._abort(pair, f"a KV receive of {rid} was still pending at its deadline")

    def _on_disconnect(self, conn: Connection) -> None:
        pair: Pair | None = getattr(self._local, "pair", None)
        if pair is not None and pair.conn is conn:
            self._abort(pair, "the prefill worker's connection ended")

    # ---- gather / scatter -----------------------------------------------------

    @property
    def fused_copy(self) -> bool:
        """Gather and scatter with the fused kernel (else torch index ops, ``kv_gather.py``).

        Only the fused scatter reads a ``live`` flag: with torch copies, a receiver that
        drops a transfer waits for its scatters (so for the sender's bytes)."""
        return self._fused_copy

    @fused_copy.setter
    def fused_copy(self, fused: bool) -> None:
        if fused and self._kernel is None:
            raise ValueError("the fused KV copy kernel did not build here (see the log)")
        self._fused_copy = fused

    def gather(
        self,
        first: int,
        slots: torch.Tensor,
        out: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """``out[j] = (K, V)[slots]`` of layer ``first + j`` (``[layers, 2, tokens, heads,
        head_dim]``), on ``stream`` (default: the current stream)."""
        if self.fused_copy:
            self._kernel.gather(first, slots, out, stream)
            return
        with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
            gather_kv(self.kv_cache.k, self.kv_cache.v, first, slots, out)

    def scatter(
        self,
        first: int,
        slots: torch.Tensor,
        kv: torch.Tensor,
        live: torch.Tensor | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """The inverse; with the fused kernel, nothing once ``live`` holds 0."""
        if self.fused_copy:
            self._kernel.scatter(first, slots, kv, live, stream)
        elif live is not None:
            raise ValueError("a live flag needs the fused KV copy kernel")
        else:
            with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
                scatter_kv(self.kv_cache.k, self.kv_cache.v, first, slots, kv)

    # ---- both -----------------------------------------------------------------

    def _abort(self, pair: Pair, reason: str) -> None:
        with pair.lock:
            if pair.aborted:
                return
            logger.info("aborting NCCL pair %s: %s", pair.key, reason)
            pair.abort()
            pair.ring = None  # freed once the scatters queued from it are done
        if pair.conn is not None:
            pair.conn.close()
        with self._lock:
            if pair in self._recv_pairs:
                self._recv_pairs.remove(pair)
            for peer in [p for p, q in self._send_pairs.items() if q is pair]:
                del self._send_pairs[peer]

    def _bytes(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _kv_view(self, buf: torch.Tensor, layers: int, ticket: TransferTicket) -> torch.Tensor:
        shape = (layers, *_kv_row_shape(ticket))
        dtype = ticket.layout.dtype
        n = torch.Size(shape).numel() * dtype.itemsize
        return buf[:n].view(dtype).view(shape)

    def close(self) -> None:
        super().close()
        with self._lock:
            pairs = list(self._send_pairs.values()) + list(self._recv_pairs)
        for pair in pairs:
            self._abort(pair, "transport closed")


def _check_plan(ticket: TransferTicket, plan: list[tuple[int, int]], layer_bytes: int):
    """An error when an announced plan does not fit the ticket, else None."""
    expected = ticket.layout.bytes_per_token(1) * ticket.num_transfer_tokens
    if layer_bytes != expected:
        return f"KV announce has {layer_bytes} bytes a layer, expected {expected}"
    firsts = [sum(n for _, n in plan[:i]) for i in range(len(plan))]
    if [f for f, _ in plan] != firsts or sum(n for _, n in plan) != ticket.num_layers:
        return f"KV announce plans messages {plan}, not layers 0..{ticket.num_layers - 1}"
    if any(n < 1 for _, n in plan):
        return f"KV announce plans an empty message: {plan}"
    return None


def _kv_row_shape(ticket: TransferTicket) -> tuple[int, ...]:
    """One layer of a transfer in a staging buffer: ``[2, tokens, kv_heads, head_dim]``."""
    lay = ticket.layout
    return (2, ticket.num_transfer_tokens, lay.num_kv_heads, lay.head_dim)


def _current_stream(device: torch.device) -> int:
    """The handle of ``device``'s current torch stream, without making a Stream object
    (``torch.cuda.current_stream`` costs about 3 us, once per layer on the hot path)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(device).cuda_stream
    return raw(device.index if device.index is not None else torch.cuda.current_device())


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait_or_log(event: torch.cuda.Event, timeout_s: float, rid: str) -> None:
    if not wait_event(event, None, time.monotonic() + timeout_s):
        logger.error("KV scatter of %s still pending after %.0f s", rid, timeout_s)
