"""KVTransport: moves a prompt's KV from a prefill worker into a decode worker's blocks.

Lifecycle of one hand-off (request ``r``)::

    decode side                               prefill side
    -----------                               ------------
    make_ticket + expect(ticket)  EXPECTING
                      ticket travels with the request (msgpack)
                                              start_send(ticket, blocks)  SENDING
      "layer" frames, in layer order   <----  send_layer(r, i) after layer i stored
      scatter into own blocks    RECEIVING
      "done" (first token)             <----  finish_send(r, done)  WAITING_FOR_ACK
      poll() -> recv event       ARRIVED
      "ack"                            ---->  poll() -> send event: free the blocks

Either side may ``cancel(r)`` at any point (the other side is told), and a
transfer not finished within ``timeout_s`` fails. Failures come out of
``poll()`` as events with ``ok=False`` and an error message, so the engine
frees the blocks and ends the request with that error.

All frames between two workers go over one TCP connection per ordered pair,
written by one writer thread, so frames for a peer stay in order (a subclass may
write a frame from the calling thread when nothing queued can be behind it, as
the NCCL transport's "hello" and "announce" do). Subclasses move the layer data:
``CpuKVTransport`` in "layer" frames, ``NcclKVTransport`` over NCCL, with one
"announce" frame per transfer instead of layer frames.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.framing import Connection, listen
from splitserve.workers.kv.transfer.ticket import (
    TransferDone,
    TransferTicket,
    token_slots,
)

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    EXPECTING = "expecting"  # receiver: blocks reserved, nothing arrived yet
    RECEIVING = "receiving"  # receiver: some layers scattered
    SENDING = "sending"  # sender: layers going out
    WAITING_FOR_ACK = "waiting_for_ack"  # sender: "done" sent


@dataclass
class TransferEvent:
    """A finished hand-off, from ``poll()``: ``side`` is "send" or "recv"."""

    request_id: str
    side: str
    ok: bool
    error: str | None = None
    done: TransferDone | None = None  # the first token, on a successful receive


@dataclass
class Outgoing:
    ticket: TransferTicket
    src_slots: torch.Tensor  # sender cache slots of the transferred tokens
    peer: Peer
    deadline: float
    state: TransferState = TransferState.SENDING
    layers_sent: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


@dataclass
class Incoming:
    ticket: TransferTicket
    dst_slots: torch.Tensor  # receiver cache slots of the transferred tokens
    deadline: float
    state: TransferState = TransferState.EXPECTING
    layers_received: int = 0
    conn: Connection | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Peer:
    """An outgoing connection and its writer thread (frames leave in queue order)."""

    def __init__(self, address: str, conn: Connection):
        self.address = address
        self.conn = conn
        self.alive = True
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, header: dict[str, Any], payload: Any = b"") -> None:
        self.queue.put((header, payload))


class KVTransport(ABC):
    name = "base"

    def __init__(
        self,
        kv_cache: KVCache,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        owner: str = "",
    ):
        self.kv_cache = kv_cache
        self.owner = owner  # this worker's id, written into the tickets it issues
        self.layout = kv_cache.layout
        self.timeout_s = timeout_s
        self._server = listen(host)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._lock = threading.RLock()
        self._outgoing: dict[str, Outgoing] = {}
        self._incoming: dict[str, Incoming] = {}
        self._peers: dict[str, Peer] = {}  # outgoing, by address
        self._accepted: list[Connection] = []  # incoming
        self._events: list[TransferEvent] = []
        # Called (from a transport thread) when an event is ready for poll(), so an
        # idle engine loop can wake at once instead of polling.
        self.notify: Callable[[], None] | None = None
        self._closed = False
        # Finished sends, for metrics: count, bytes, seconds from start to ack.
        self.num_sent = 0
        self.bytes_sent = 0
        self.seconds_sending = 0.0
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()

    # ---- receiver half ------------------------------------------------------

    def make_ticket(
        self,
        request_id: str,
        block_ids: list[int],
        start_token: int,
        num_tokens: int,
        num_layers: int,
    ) -> TransferTicket:
        return TransferTicket(
            request_id=request_id,
            address=self.address,
            block_ids=list(block_ids),
            start_token=start_token,
            num_tokens=num_tokens,
            num_layers=num_layers,
            layout=self.layout,
            owner=self.owner,
        )

    def expect(self, ticket: TransferTicket) -> None:
        t = ticket
        slots = token_slots(t.block_ids, t.block_size, t.start_token, t.num_tokens)
        # Not blocking: the engine may have a step queued (async scheduling).
        slots = slots.to(self.device, non_blocking=True)
        incoming = Incoming(ticket, slots, time.monotonic() + self.timeout_s)
        with self._lock:
            self._incoming[ticket.request_id] = incoming

    # ---- sender half --------------------------------------------------------

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
        peer = self._peer(ticket)
        slots = slots.to(self.device, non_blocking=True)  # as in expect
        outgoing = Outgoing(ticket, slots, peer, time.monotonic() + self.timeout_s)
        with self._lock:
            self._outgoing[ticket.request_id] = outgoing

    def send_layer(self, request_id: str, layer_id: int) -> None:
        """Send one layer's KV; call after the layer stored it (and before it changes)."""
        with self._lock:
            out = self._outgoing.get(request_id)
        if out is None or out.state != TransferState.SENDING:
            return
        if layer_id >= out.ticket.num_layers:
            return
        header = {"kind": "layer", "request_id": request_id, "layer": layer_id}
        self._send_layer_data(out, header)
        out.layers_sent += 1

    def finish_send(self, request_id: str, done: TransferDone) -> None:
        with self._lock:
            out = self._outgoing.get(request_id)
            if out is None or out.state != TransferState.SENDING:
                return
            out.state = TransferState.WAITING_FOR_ACK
        self._post_done(out.peer, {"kind": "done", "layers": out.layers_sent, **asdict(done)})

    def _post_done(self, peer: Peer, frame: dict[str, Any]) -> None:
        """Queue the "done" frame behind the transfer's layer frames."""
        peer.post(frame)

    # ---- both ---------------------------------------------------------------

    def cancel(self, request_id: str, ticket: TransferTicket | None = None) -> None:
        """Drop the transfer on this side and tell the other side; no event follows.

        A sender that holds a ``ticket`` but has not started sending passes it, so
        the receiver learns of the cancel too.
        """
        with self._lock:
            out = self._outgoing.pop(request_id, None)
            inc = self._incoming.pop(request_id, None)
            if inc is not None:
                self._release_incoming(inc)
            if out is not None:
                self._release_outgoing(out)
        peer = out.peer if out is not None else None
        if peer is None and ticket is not None:
            with contextlib.suppress(OSError):
                peer = self._peer(ticket)
        if peer is not None and peer.alive:
            peer.post({"kind": "cancel", "request_id": request_id})

    def poll(self) -> list[TransferEvent]:
        """Transfers that ended since the last poll (timeouts are declared here)."""
        now = time.monotonic()
        expired = []
        with self._lock:
            for rid, t in list(self._outgoing.items()) + list(self._incoming.items()):
                if t.deadline < now:
                    expired.append(rid)
            for rid in expired:
                side = "send" if rid in self._outgoing else "recv"
                self._fail(rid, side, f"KV transfer timed out after {self.timeout_s:.0f} s")
            events, self._events = self._events, []
        for rid in expired:
            self.cancel(rid)
        return events

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._outgoing) + len(self._incoming)

    @property
    def device(self) -> torch.device:
        return self.kv_cache.k[0].device

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            peers, accepted = list(self._peers.values()), list(self._accepted)
        for peer in peers:
            peer.alive = False
            peer.conn.close()
        for conn in accepted:
            conn.close()

    # ---- data movement: subclasses ------------------------------------------

    @abstractmethod
    def _send_layer_data(self, out: Outgoing, header: dict[str, Any]) -> None:
        """Post the header (and move the data) for one layer of ``out``."""

    @abstractmethod
    def _recv_layer_data(self, inc: Incoming | None, header: dict, payload: bytearray) -> None:
        """Place one layer into ``inc``'s blocks; with ``inc`` None, consume and drop it."""

    def _finish_incoming(self, inc: Incoming) -> None:
        """Make the received KV visible to the engine (e.g. wait for a copy stream)."""

    def _release_incoming(self, inc: Incoming) -> None:
        """The engine is about to free ``inc``'s blocks: no write may still be in flight."""

    def _release_outgoing(self, out: Outgoing) -> None:
        """``out`` ended (acked, failed or cancelled); caller holds the lock."""

    def _on_frame(self, conn: Connection, header: dict[str, Any]) -> None:
        """A frame of a kind the base does not handle."""
        raise ConnectionError(f"unknown KV frame kind {header['kind']!r}")

    def _on_connect(self, peer: Peer, ticket: TransferTicket) -> None:
        """A new outgoing connection, before any frame (NCCL creates its communicator here)."""

    def _on_hello(self, conn: Connection, header: dict[str, Any]) -> None:
        """A peer introduced itself on an incoming connection."""

    def _on_disconnect(self, conn: Connection) -> None:
        """An incoming connection ended, before its transfers fail (NCCL aborts here)."""

    # ---- threads ------------------------------------------------------------

    def _peer(self, ticket: TransferTicket) -> Peer:
        address = ticket.address
        with self._lock:
            peer = self._peers.get(address)
            if peer is not None and peer.alive:
                return peer
        conn = Connection.connect(address, timeout_s=self.timeout_s)
        peer = Peer(address, conn)
        self._on_connect(peer, ticket)
        with self._lock:
            self._peers[address] = peer
        threading.Thread(target=self._write_loop, args=(peer,), daemon=True).start()
        threading.Thread(target=self._ack_loop, args=(peer,), daemon=True).start()
        return peer

    def _write_loop(self, peer: Peer) -> None:
        try:
            while peer.alive:
                header, payload = peer.queue.get()
                if header is None:
                    break
                peer.conn.send(header, payload)
        except OSError as e:
            self._peer_lost(peer, f"connection to decode worker {peer.address} failed: {e}")

    def _ack_loop(self, peer: Peer) -> None:
        try:
            while True:
                header, _ = peer.conn.recv()
                if header["kind"] == "ack":
                    self._on_ack(header)
        except OSError as e:
            self._peer_lost(peer, f"decode worker {peer.address} went away: {e}")

    def _on_ack(self, header: dict[str, Any]) -> None:
        with self._lock:
            rid = header["request_id"]
            out = self._outgoing.pop(rid, None)
            if out is None:
                return
            self._release_outgoing(out)
            if header["ok"]:
                self.num_sent += 1
                self.bytes_sent += self.transfer_bytes(out.ticket)
                self.seconds_sending += time.monotonic() - out.started
            self._add_event(TransferEvent(rid, "send", header["ok"], header.get("error")))

    def transfer_bytes(self, ticket: TransferTicket) -> int:
        return self.layout.bytes_per_token(ticket.num_layers) * ticket.num_transfer_tokens

    def _peer_lost(self, peer: Peer, error: str) -> None:
        with self._lock:
            if not peer.alive and self._closed:
                return
            peer.alive = False
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
            for rid in [r for r, o in self._outgoing.items() if o.peer is peer]:
                self._fail(rid, "send", error)
        peer.queue.put((None, b""))
        peer.conn.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            conn = Connection(sock)
            with self._lock:
                self._accepted.append(conn)
            threading.Thread(target=self._serve_peer, args=(conn,), daemon=True).start()

    def _serve_peer(self, conn: Connection) -> None:
        try:
            while True:
                header, payload = conn.recv()
                kind = header["kind"]
                if kind == "layer":
                    self._on_layer(conn, header, payload)
                elif kind == "done":
                    self._on_done(conn, header)
                elif kind == "cancel":
                    self._on_cancel(header["request_id"])
                elif kind == "hello":
                    self._on_hello(conn, header)
                else:
                    self._on_frame(conn, header)
        except OSError as e:
            self._on_disconnect(conn)
            with self._lock:
                lost = [r for r, i in self._incoming.items() if i.conn is conn]
                for rid in lost:
                    self._fail(rid, "recv", f"prefill worker went away mid-transfer: {e}")
                if conn in self._accepted:
                    self._accepted.remove(conn)
            conn.close()

    def _on_layer(self, conn: Connection, header: dict[str, Any], payload: bytearray) -> None:
        with self._lock:
            inc = self._incoming.get(header["request_id"])
            if inc is not None:
                inc.conn, inc.state = conn, TransferState.RECEIVING
            # Under the lock: a cancel cannot free the blocks while they are written.
            self._recv_layer_data(inc, header, payload)
            if inc is not None:
                inc.layers_received += 1

    def _on_done(self, conn: Connection, header: dict[str, Any]) -> None:
        rid = header["request_id"]
        ack: dict[str, Any] = {"kind": "ack", "request_id": rid, "ok": True}
        with self._lock:
            inc = self._incoming.pop(rid, None)
            if inc is None:
                ack.update(ok=False, error="the decode worker no longer expects this request")
            elif inc.layers_received != inc.ticket.num_layers:
                error = f"received {inc.layers_received} of {inc.ticket.num_layers} KV layers"
                ack.update(ok=False, error=error)
                self._incoming[rid] = inc
                self._fail(rid, "recv", error)
            else:
                self._finish_incoming(inc)
                top = [tuple(t) for t in header["top_logprobs"]]
                done = TransferDone(rid, header["first_token"], header["logprob"], top)
                self._add_event(TransferEvent(rid, "recv", True, done=done))
        conn.send(ack)

    def _on_cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._incoming:
                self._fail(request_id, "recv", "the prefill worker cancelled the transfer")

    def _fail(self, request_id: str, side: str, error: str) -> None:
        """Record a failure; caller holds the lock."""
        table = self._outgoing if side == "send" else self._incoming
        t = table.pop(request_id, None)
        if t is None:
            return
        if isinstance(t, Incoming):
            self._release_incoming(t)
        else:
            self._release_outgoing(t)
        logger.warning("KV transfer of %s failed: %s", request_id, error)
        self._add_event(TransferEvent(request_id, side, False, error))

    def _add_event(self, event: TransferEvent) -> None:
        """Queue an event for poll(); caller holds the lock."""
        self._events.append(event)
        if self.notify is not None:
            self.notify()
