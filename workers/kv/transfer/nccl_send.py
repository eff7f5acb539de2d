"""The NCCL sender's data path: a transfer's layers gathered into a staging ring as they
are computed and sent as the messages its announce planned.

One transfer on the sender (the receiver's side is ``nccl_recv.py``)::

    start_send: "announce" {plan}   -- TCP -->   the receiver queues every receive
    send_layer(l), l in message i:
      gather l  (copy stream, into i's buffer;
                 waits the compute stream, and send i-2 for i's first layer)
      send i    (lane i % lanes; once i's layers are gathered, waits those gathers)
    finish_send: "done" {layers}    -- TCP -->   the receiver acks once all is scattered

So each layer is gathered as soon as it is computed and message i+1's layers
during send i; the host never waits on the hot path. The gather is bound to the
transfer's slots and staging at set-up (``Copier.bind``), so a gather costs the
host one kernel launch. The compute stream never waits for the transport.

NCCL matches a pair's sends and receives by order, so the sender keeps the
announce order: it queues a transfer's sends only after every send of the
transfers announced before it on the pair (``Pair.sending``), and every
announced message is sent. A transfer that ends early (cancelled, failed,
finished with layers missing) sends the rest of its plan from its staging
buffers as filler.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from cupy.cuda import nccl

from splitserve.kernels.kv_gather_cuda import KVCopyLaunch
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.kv.transfer.control import Peer
from splitserve.workers.kv.transfer.copier import RING, Copier, TorchCopy, ring_size
from splitserve.workers.kv.transfer.event_pool import EventPool, record, wait
from splitserve.workers.kv.transfer.nccl_pair import NcclOptions, Pair, transfer_plan
from splitserve.workers.kv.transfer.nccl_pairs import NcclPairs
from splitserve.workers.kv.transfer.ticket import TransferTicket, transfer_bytes
from splitserve.workers.kv.transfer.transfers import Outgoing, Transfers

logger = logging.getLogger(__name__)

_SEND_EVENTS = 1 + 2 * RING  # computed, staged per slot, sent per slot


@dataclass(eq=False)
class _Send:
    """The sender's progress through one transfer's plan (``Outgoing.data``)."""

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
    staging: torch.Tensor | None = None  # the ring: RING slots, flat uint8, one allocation
    staging_at: int = 0  # its device address
    slot_bytes: int = 0  # one slot's size (the largest message)
    copy: KVCopyLaunch | TorchCopy | None = None  # the gathers into the ring

    @property
    def computed(self) -> torch.cuda.Event:
        """Recorded on the compute stream once a layer, for the copy stream to wait on."""
        return self.events[0]

    def staged(self, slot: int) -> torch.cuda.Event:
        """The gathers into ``slot`` that its send waits for."""
        return self.events[1 + slot]

    def sent(self, slot: int) -> torch.cuda.Event:
        """The last send from ``slot``, which the next gathers into it wait for."""
        return self.events[1 + RING + slot]


class NcclSendPath:
    """The sender's half of the NCCL data path (``data_path.SendPath``)."""

    def __init__(
        self,
        transfers: Transfers,
        pairs: NcclPairs,
        copier: Copier,
        events: EventPool,
        layout: KVLayout,
        options: NcclOptions,
    ):
        self.transfers = transfers
        self.pairs = pairs
        self.copier = copier
        self.events = events
        self.layout = layout  # this side's cache
        self.options = options  # the plan: layers_per_message, first_message_layers, ...
        self.device = copier.device

    def connect(self, peer: Peer, ticket: TransferTicket) -> None:
        self.pairs.connect(peer, ticket)

    def open(self, out: Outgoing) -> None:
        """Announce the transfer's plan, so the receiver queues its receives now."""
        pair = self.pairs.sending(out.peer)
        if pair is None:
            raise ConnectionError(f"the NCCL communicator with {out.ticket.address} is gone")
        t = out.ticket
        layer_bytes = transfer_bytes(self.layout, t) // max(t.num_layers, 1)
        o = self.options
        plan = transfer_plan(
            t.num_layers,
            layer_bytes,
            o.layers_per_message,
            o.first_message_layers,
            o.max_message_bytes,
        )
        compute = _current_stream(self.device)
        send = _Send(pair, plan, layer_bytes, compute, self.events.take(_SEND_EVENTS))
        out.data, out.release = send, functools.partial(self._release, out)
        out.src_slots.record_stream(pair.copy_stream)
        if plan:
            self._stage(pair, out, send)  # now, not on the first layer's hot path
        header = {"kind": "announce", "request_id": t.request_id, "layer_bytes": layer_bytes}
        header["messages"] = [list(m) for m in plan]
        with pair.lock:  # the queue and the wire see the same order
            pair.check_open()
            pair.conn.send(header)
            pair.sending.append(out)

    def send_layer(self, out: Outgoing, layer: int) -> None:
        send: _Send = out.data
        if layer != send.ready:
            raise ValueError(
                f"send_layer({out.ticket.request_id!r}, {layer}): the nccl KV "
                f"transport sends layers in order, the next is {send.ready}"
            )
        send.ready += 1
        send.compute = _current_stream(self.device)
        self._pump(send.pair)

    def finish(self, out: Outgoing, done: dict[str, Any]) -> None:
        send: _Send = out.data
        if send.ready < out.ticket.num_layers:  # the receiver will fail it; keep in step
            send.dropped = True
            self._pump(send.pair)
        # No layer frames to follow: written now, not handed to the writer thread,
        # whose wake-up the receiver's end of the hand-off would wait for.
        out.peer.conn.send(done)

    def peer_lost(self, peer: Peer, error: str) -> None:
        self.pairs.peer_lost(peer, error)

    def _release(self, out: Outgoing) -> None:
        """``out`` ended (acked, failed or cancelled): what is left of its plan goes out
        as filler. Caller holds the transfers' lock."""
        send: _Send = out.data
        if send.issued < len(send.plan):
            send.dropped = True
            self._pump(send.pair)

    def _stage(self, pair: Pair, out: Outgoing, send: _Send) -> None:
        """The transfer's staging ring (one allocation) and its bound gathers."""
        nbytes, count = ring_size(send.plan, send.layer_bytes)
        send.slot_bytes = nbytes
        with torch.cuda.stream(pair.copy_stream):
            send.staging = self.copier.bytes(count * nbytes)
        send.staging_at = send.staging.data_ptr()
        for lane in pair.lanes:
            send.staging.record_stream(lane.stream)
        send.copy = self.copier.bind(out.src_slots, send.staging, pair.copy_stream, out.ticket)

    def _pump(self, pair: Pair) -> None:
        """Queue what may go now on ``pair``: the oldest transfer's gathers and sends."""
        try:
            with pair.lock:
                while pair.sending and not pair.aborted:
                    out: Outgoing = pair.sending[0]
                    send: _Send = out.data
                    self._advance(pair, out, send)
                    if send.issued < len(send.plan):
                        return
                    pair.sending.popleft()
                    send.staging = send.copy = None  # reused after their sends
                    self.events.give(send.events)
        except Exception as e:
            if not isinstance(e, nccl.NcclError):
                logger.exception("queueing a KV send failed")
            self.pairs.abort(pair, f"NCCL send failed: {type(e).__name__}: {e}")

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
            self._issue(pair, out, send)

    def _gather_layers(self, pair: Pair, out: Outgoing, send: _Send, end: int) -> None:
        """Queue the gather of layers ``send.gathered .. end - 1`` (all in message
        ``send.issued``) into that message's staging buffer, on the copy stream."""
        i = send.issued
        first = send.plan[i][0]
        slot = i % RING
        begin, layers = send.gathered, end - send.gathered
        tracer = self.transfers.tracer
        if tracer is not None:
            rid, span = out.ticket.request_id, {"first": begin, "layers": layers}
            tracer("gather_begin", rid, time.perf_counter(), **span)
        with pair.on_device():
            record(send.computed, send.compute)  # the layers are computed
            wait(pair.copy_handle, send.computed)
            if send.gathered == first and i >= RING:  # and the slot's last send is done
                wait(pair.copy_handle, send.sent(slot))
        offset = slot * send.slot_bytes + (begin - first) * send.layer_bytes
        if tracer is not None:
            tracer("gather_launch", rid, time.perf_counter(), **span, stream=pair.copy_stream)
        send.copy.gather(begin, layers, offset)
        if tracer is not None:
            tracer("gather_queued", rid, time.perf_counter(), **span, stream=pair.copy_stream)
        send.gathered = end

    def _issue(self, pair: Pair, out: Outgoing, send: _Send) -> None:
        """Queue the send of message ``send.issued``, after its gathers."""
        i = send.issued
        first, layers = send.plan[i]
        slot, lane = i % RING, pair.lane(i).handle
        tracer = self.transfers.tracer
        if tracer is not None:
            rid, stream = out.ticket.request_id, pair.lane(i).stream
            tracer("message_begin", rid, time.perf_counter(), message=i)
        with pair.on_device():
            if send.gathered > first:  # its layers' gathers are queued (not filler)
                record(send.staged(slot), pair.copy_handle)
                wait(lane, send.staged(slot))
            at = send.staging_at + slot * send.slot_bytes
            if tracer is not None:
                tracer("message_launch", rid, time.perf_counter(), message=i, stream=stream)
            pair.send(i, at, layers * send.layer_bytes)  # filler: whatever it holds
            if tracer is not None:
                tracer("message_queued", rid, time.perf_counter(), message=i, stream=stream)
            record(send.sent(slot), lane)
        send.issued += 1


def _current_stream(device: torch.device) -> int:
    """The handle of ``device``'s current torch stream, without making a Stream object
    (``torch.cuda.current_stream`` does, once per layer on the hot path)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(device).cuda_stream
    return raw(device.index if device.index is not None else torch.cuda.current_device())
