"""The sender's state machine: one transfer from ``start_send`` to the receiver's ack.

    start_send(ticket, blocks)  check the layouts, connect to the receiver (the first
                                time: ``SendPath.connect``), open it (``SendPath.open``)
                                                                      SENDING
    send_layer(r, l)            the send path moves layer l, once it is stored
    finish_send(r, done)        the send path sends what it still owes, then "done"
                                                                      WAITING_FOR_ACK
    "ack" from the receiver     the transfer ends: an event for poll(), ok or with
                                the receiver's error

A lost connection fails every transfer on it. Deadlines and cancels are the
transport's (``transport.py``); the receiver's half is ``receiver.py``.

Connecting to a receiver (TCP, its challenge, the send path's link: the NCCL
rendezvous and communicators) may take long or hang with the receiver. ``connect``
does it on a thread of its own, so an engine loop asks and moves on (the engine
holds a request back until its receiver is connected: ``handoff.py``);
``start_send`` connects in the caller's thread only if nobody did before.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Any

from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.auth import answer
from splitserve.workers.kv.transfer.base import CONNECTING, TransferEvent, TransferState
from splitserve.workers.kv.transfer.control import Peer
from splitserve.workers.kv.transfer.data_path import SendPath
from splitserve.workers.kv.transfer.framing import Connection
from splitserve.workers.kv.transfer.ticket import (
    TransferDone,
    TransferTicket,
    token_slots,
    transfer_bytes,
)
from splitserve.workers.kv.transfer.transfers import Outgoing, Transfers

logger = logging.getLogger(__name__)


class Sender:
    """The prefill side of a transport: its transfers' states, its peers, its metrics."""

    def __init__(self, kv_cache: KVCache, transfers: Transfers, path: SendPath, key: bytes):
        """``key``: what this worker answers receivers' challenges with (``auth.py``)."""
        self.kv_cache = kv_cache
        self.key = key
        self.layout = kv_cache.layout
        self.transfers = transfers
        self.path = path
        # Finished sends, for metrics: count, bytes, seconds from start to ack.
        self.num_sent = 0
        self.bytes_sent = 0
        self.seconds_sending = 0.0
        self._peers: dict[str, Peer] = {}  # by receiver address; under the transfers' lock
        self._attempts: dict[str, list] = {}  # address -> [error] once connect's thread ended
        self._closed = False

    def start_send(self, ticket: TransferTicket, src_block_ids: list[int]) -> None:
        """Check the ticket against this cache and open the peer; raise on a mismatch."""
        self.layout.check_matches(ticket.layout)
        if ticket.num_layers > self.layout.num_layers:
            raise ValueError(
                f"ticket asks for {ticket.num_layers} layers, the cache has "
                f"{self.layout.num_layers}"
            )
        slots = token_slots(
            src_block_ids, self.kv_cache.block_size, ticket.start_token, ticket.num_tokens
        )
        peer = self.peer(ticket)
        # Not blocking: the engine may have a step queued (async scheduling).
        slots = slots.to(self.kv_cache.k[0].device, non_blocking=True)
        out = Outgoing(ticket, slots, peer, self.transfers.deadline())
        rid = ticket.request_id
        with self.transfers.lock:
            self.transfers.outgoing[rid] = out
            if not peer.alive:  # lost before this transfer was on it: fail it as those were
                error = f"decode worker {peer.address} went away before the transfer started"
                self.transfers.fail(rid, "send", error)
                return
        try:
            self.path.open(out)
        except BaseException:
            with self.transfers.lock:
                self.transfers.outgoing.pop(rid, None)
            raise
        if self.transfers.tracer is not None:
            self.transfers.tracer("send_started", rid, time.perf_counter())

    def send_layer(self, request_id: str, layer_id: int) -> None:
        """Send one layer's KV; call after the layer stored it (and before it changes)."""
        with self.transfers.lock:
            out = self.transfers.outgoing.get(request_id)
        if out is None or out.state != TransferState.SENDING:
            return
        if layer_id >= out.ticket.num_layers:
            return
        tracer = self.transfers.tracer
        if tracer is not None:
            tracer("layer_ready", request_id, time.perf_counter(), layer=layer_id)
        self.path.send_layer(out, layer_id)
        out.layers_sent += 1

    def finish_send(self, request_id: str, done: TransferDone) -> None:
        with self.transfers.lock:
            out = self.transfers.outgoing.get(request_id)
            if out is None or out.state != TransferState.SENDING:
                return
            out.state = TransferState.WAITING_FOR_ACK
        if self.transfers.tracer is not None:
            at = time.perf_counter()
            self.transfers.tracer("finish_send", request_id, at, layers=out.layers_sent)
        frame = {"kind": "done", "layers": out.layers_sent, **asdict(done)}
        try:
            self.path.finish(out, frame)
        except OSError as e:
            self._peer_lost(out.peer, f"the done frame could not be sent: {e}")

    def connect(self, ticket: TransferTicket) -> str | None:
        """Whether the ticket's receiver is connected: None (yes), ``CONNECTING`` (a
        thread is connecting; ``notify`` fires when it ends), or why the last attempt
        failed (said once: the next call tries again). Never blocks."""
        address = ticket.address
        with self.transfers.lock:
            peer = self._peers.get(address)
            if peer is not None and peer.alive:
                return None
            attempt = self._attempts.get(address)
            if attempt is None:
                attempt = self._attempts[address] = []
                args = (ticket, attempt)
                threading.Thread(target=self._connect, args=args, daemon=True).start()
                return CONNECTING
            if not attempt:
                return CONNECTING
            del self._attempts[address]
            return attempt[0]

    def _connect(self, ticket: TransferTicket, attempt: list) -> None:
        try:
            self.peer(ticket)
            error = None
        except Exception as e:  # unreachable, refused, a failed rendezvous: its requests fail
            error = f"{type(e).__name__}: {e}"
        with self.transfers.lock:
            attempt.append(error)
            if self.transfers.notify is not None:
                self.transfers.notify()

    def peer(self, ticket: TransferTicket) -> Peer:
        """The connection to the ticket's receiver; made (with the send path's link to it)
        the first time. Raises ``OSError`` when the receiver cannot be reached."""
        address = ticket.address
        with self.transfers.lock:
            peer = self._peers.get(address)
            if peer is not None and peer.alive:
                return peer
        conn = Connection.connect(address, timeout_s=self.transfers.timeout_s)
        try:
            answer(conn, self.key)
        except BaseException:
            conn.close()
            raise
        peer = Peer(address, conn)
        self.path.connect(peer, ticket)
        with self.transfers.lock:
            self._peers[address] = peer
        peer.start(self._on_answer, self._peer_lost)
        return peer

    def tell_cancel(
        self, request_id: str, out: Outgoing | None, ticket: TransferTicket | None
    ) -> None:
        """Tell the receiver of a cancel: on the transfer's connection, or the ticket's
        receiver's (connected to on a thread if need be: the caller never waits)."""
        frame = {"kind": "cancel", "request_id": request_id}
        peer = out.peer if out is not None else None
        if peer is None and ticket is not None:
            with self.transfers.lock:
                peer = self._peers.get(ticket.address)
            if peer is None or not peer.alive:
                args = (ticket, frame)
                threading.Thread(target=self._connect_and_post, args=args, daemon=True).start()
                return
        if peer is not None and peer.alive:
            peer.post(frame)

    def _connect_and_post(self, ticket: TransferTicket, frame: dict[str, Any]) -> None:
        try:
            self.peer(ticket).post(frame)
        except Exception as e:  # the receiver is gone: its own deadline ends the transfer
            logger.info("could not tell %s of a cancel: %s", ticket.address, e)

    def transfer_bytes(self, ticket: TransferTicket) -> int:
        return transfer_bytes(self.layout, ticket)

    def close(self) -> None:
        self._closed = True
        with self.transfers.lock:
            peers = list(self._peers.values())
        for peer in peers:
            peer.alive = False
            peer.conn.close()

    def _on_answer(self, header: dict[str, Any]) -> None:
        if header["kind"] != "ack":
            return
        rid, ok = header["request_id"], header["ok"]
        with self.transfers.lock:
            out = self.transfers.end(rid, "send")
            if out is None:
                return
            if self.transfers.tracer is not None:
                self.transfers.tracer("acked", rid, time.perf_counter(), ok=ok)
            if ok:
                self.num_sent += 1
                self.bytes_sent += self.transfer_bytes(out.ticket)
                self.seconds_sending += time.monotonic() - out.started
            self.transfers.add_event(TransferEvent(rid, "send", ok, header.get("error")))

    def _peer_lost(self, peer: Peer, error: str) -> None:
        self.path.peer_lost(peer, error)  # first: the NCCL pair, so no filler goes on it
        with self.transfers.lock:
            if not peer.alive and self._closed:
                return
            peer.alive = False
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            for rid in [r for r, o in self.transfers.outgoing.items() if o.peer is peer]:
                self.transfers.fail(rid, "send", error)
        peer.stop()
