"""The seam between a transport's state machines and its data: how the layers move.

Every transport runs the same sender and receiver (``sender.py``,
``receiver.py``) over the same control plane (``control.py``); what carries the
layers plugs in as two halves. ``cpu_transport.LayerFrames`` (both halves) sends
each layer in a "layer" frame; ``nccl_send.NcclSendPath`` and
``nccl_recv.NcclRecvPath`` send NCCL messages through staging rings. A half that
holds something for a transfer keeps it in the record's ``data`` and sets its
``release`` (``transfers.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

from splitserve.workers.kv.transfer.control import Peer
from splitserve.workers.kv.transfer.framing import Connection
from splitserve.workers.kv.transfer.ticket import TransferTicket
from splitserve.workers.kv.transfer.transfers import Incoming, Outgoing


class SendPath(Protocol):
    """The sender's half: called by ``Sender`` in each transfer's order."""

    def connect(self, peer: Peer, ticket: TransferTicket) -> None:
        """A new connection to the ticket's receiver, before any frame is queued on it;
        raise (after closing ``peer.conn``) to refuse it."""
        ...

    def open(self, out: Outgoing) -> None:
        """``out`` is in the table: get it going (NCCL announces its plan). If this
        raises, the transfer is dropped and ``start_send`` raises."""
        ...

    def send_layer(self, out: Outgoing, layer: int) -> None:
        """Move layer ``layer`` of ``out``, which is stored in the cache now."""
        ...

    def finish(self, out: Outgoing, done: dict[str, Any]) -> None:
        """No more layers: send what the transfer still owes, then the ``done`` frame;
        an ``OSError`` loses the peer."""
        ...

    def peer_lost(self, peer: Peer, error: str) -> None:
        """``peer``'s connection failed; its transfers fail next."""
        ...


class RecvPath(Protocol):
    """The receiver's half: called by ``Receiver``."""

    def expect(self, inc: Incoming) -> None:
        """``inc`` is about to be expected (it is not in the table yet)."""
        ...

    def on_frame(self, conn: Connection, header: dict[str, Any], payload: bytearray) -> None:
        """A frame other than "done" and "cancel"; raise ``ConnectionError`` to end the
        connection (``control.unknown_frame`` for a kind it does not know)."""
        ...

    def settle(self, inc: Incoming, layers: int) -> str | None:
        """The "done" frame says ``layers`` were sent: wait until the KV is in place (not
        under the lock; the transfer may end meanwhile). An error when it cannot be."""
        ...

    def disconnected(self, conn: Connection) -> None:
        """``conn`` ended; the transfers that came on it fail next."""
        ...
