"""KVTransport: moves a prompt's KV from a prefill worker into a decode worker's blocks.

This module is the interface (what the engine, the hand-off and the worker call)
and the states a transfer passes through. ``transport.Transport`` implements it
from parts (``README.md`` lists them); ``registry.make_kv_transport`` picks one.

Lifecycle of one hand-off (request ``r``)::

    decode side (receiver)                      prefill side (sender)
    ----------------------                      ---------------------
    make_ticket + expect(ticket)    EXPECTING
                      ticket travels with the request (msgpack)
                                                start_send(ticket, blocks)     SENDING
      the layers, in layer order        <----   send_layer(r, i) after layer i stored
      scatter into own blocks       RECEIVING
      "done" (first token)              <----   finish_send(r, done)   WAITING_FOR_ACK
      poll() -> recv event: arrived
      "ack"                             ---->   poll() -> send event: free the blocks

The states (``TransferState``): a receiver's transfer is EXPECTING from
``expect`` until its first layer (CPU) or its announce (NCCL) comes, then
RECEIVING; a sender's is SENDING from ``start_send`` until ``finish_send``, then
WAITING_FOR_ACK. Each transfer then ends, and leaves the transport, in one of
three ways:

- arrived / acked: ``poll()`` returns its event with ``ok=True``; the receiver's
  carries the first token (``TransferDone``);
- failed: ``poll()`` returns its event with ``ok=False`` and the error (no ack
  within ``timeout_s``, the other side's cancel, a lost connection, layers
  missing), so the engine frees the blocks and ends the request with that error;
- cancelled: ``cancel(r)`` on this side drops it and tells the other side; no
  event follows here.

The frames between the two workers (ticket aside) travel over one TCP
connection per ordered pair of workers, in order (``control.py``); the layer
data in "layer" frames (``cpu``) or over NCCL (``nccl``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.kv.transfer.ticket import TransferDone, TransferTicket
from splitserve.workers.kv.transfer.tracing import Tracer

CONNECTING = "connecting"  # ``connect``: a thread is connecting to the receiver


class TransferState(enum.Enum):
    EXPECTING = "expecting"  # receiver: blocks reserved, nothing arrived yet
    RECEIVING = "receiving"  # receiver: the layers are coming
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


class KVTransport(Protocol):
    """One worker's end of the KV hand-offs: a receiver half, a sender half, and both.

    The NCCL transport adds ``join(pair_key, unique_id)``, the receiver's half of
    making an NCCL pair (``nccl_pairs.py``).
    """

    layout: KVLayout  # this worker's KV cache
    address: str  # "host:port" of this transport, written into its tickets
    # Called (from a transport thread) when an event is ready for poll(), so an
    # idle engine loop can wake at once instead of polling.
    notify: Callable[[], None] | None
    tracer: Tracer | None  # sees each step of each transfer (tracing.py); None: off

    # ---- receiver half ------------------------------------------------------

    def make_ticket(
        self,
        request_id: str,
        block_ids: list[int],
        start_token: int,
        num_tokens: int,
        num_layers: int,
    ) -> TransferTicket:
        """A ticket for tokens ``start_token .. num_tokens - 1`` into ``block_ids``."""
        ...

    def expect(self, ticket: TransferTicket) -> None:
        """Wait for the ticket's transfer (EXPECTING): up to ``start_timeout_s`` for its
        first frame, then ``timeout_s`` from that frame (``transfers.py``)."""
        ...

    # ---- sender half --------------------------------------------------------

    def connect(self, ticket: TransferTicket) -> str | None:
        """Connect to the ticket's receiver on a thread of the transport (TCP, its
        challenge, NCCL's rendezvous); never blocks. None: connected; ``CONNECTING``:
        under way (``notify`` fires when it ends); else why it failed (once)."""
        ...

    def start_send(self, ticket: TransferTicket, src_block_ids: list[int]) -> None:
        """Open the transfer into the ticket's blocks (SENDING); raise ``ValueError`` on a
        layout mismatch, ``OSError`` when the receiver cannot be reached."""
        ...

    def send_layer(self, request_id: str, layer_id: int) -> None:
        """Send one layer's KV; call after the layer stored it (and before it changes)."""
        ...

    def finish_send(self, request_id: str, done: TransferDone) -> None:
        """No more layers: send the first token (WAITING_FOR_ACK)."""
        ...

    # ---- both ---------------------------------------------------------------

    def cancel(self, request_id: str, ticket: TransferTicket | None = None) -> None:
        """Drop the transfer on this side and tell the other side; no event follows.

        A sender that holds a ``ticket`` but has not started sending passes it, so
        the receiver learns of the cancel too.
        """
        ...

    def poll(self) -> list[TransferEvent]:
        """Transfers that ended since the last poll (timeouts are declared here)."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Transfers on either side that have not ended."""
        ...

    # Finished sends, for metrics: count, bytes, seconds from start_send to the ack.
    @property
    def num_sent(self) -> int: ...

    @property
    def bytes_sent(self) -> int: ...

    @property
    def seconds_sending(self) -> float: ...

    def transfer_bytes(self, ticket: TransferTicket) -> int:
        """Bytes of K and V the ticket's transfer moves."""
        ...

    def close(self) -> None:
        """Close every connection; transfers in flight fail on the other side."""
        ...
