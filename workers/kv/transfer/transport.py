"""A KV transport made of parts: the composition that implements ``base.KVTransport``.

    Transport
      Transfers       what is in flight, deadlines, events for poll()  (transfers.py)
      Sender          SENDING -> WAITING_FOR_ACK, over Peers          (sender.py)
        SendPath      how its layers leave                            (data_path.py)
      Receiver        EXPECTING -> RECEIVING -> arrived, over a Listener  (receiver.py)
        RecvPath      how its layers land

``CpuKVTransport`` (``cpu_transport.py``) and ``NcclKVTransport``
(``nccl_transport.py``) are this class with their data paths.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.base import TransferEvent
from splitserve.workers.kv.transfer.control import Listener
from splitserve.workers.kv.transfer.data_path import RecvPath, SendPath
from splitserve.workers.kv.transfer.receiver import Receiver
from splitserve.workers.kv.transfer.sender import Sender
from splitserve.workers.kv.transfer.ticket import TransferDone, TransferTicket
from splitserve.workers.kv.transfer.tracing import Tracer
from splitserve.workers.kv.transfer.transfers import Transfers


class Transport:
    """A sender and a receiver sharing one bookkeeping; see ``base.KVTransport``."""

    def __init__(
        self,
        kv_cache: KVCache,
        transfers: Transfers,
        listener: Listener,
        send_path: SendPath,
        recv_path: RecvPath,
        owner: str = "",
    ):
        self.kv_cache = kv_cache
        self.layout = kv_cache.layout
        self.owner = owner  # this worker's id, written into the tickets it issues
        self.address = listener.address
        self.transfers = transfers
        self.sender = Sender(kv_cache, transfers, send_path, listener.key)
        self.receiver = Receiver(kv_cache, transfers, listener, recv_path)
        self.receiver.start()

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
        self.receiver.expect(ticket)

    # ---- sender half --------------------------------------------------------

    def connect(self, ticket: TransferTicket) -> str | None:
        return self.sender.connect(ticket)

    def start_send(self, ticket: TransferTicket, src_block_ids: list[int]) -> None:
        self.sender.start_send(ticket, src_block_ids)

    def send_layer(self, request_id: str, layer_id: int) -> None:
        self.sender.send_layer(request_id, layer_id)

    def finish_send(self, request_id: str, done: TransferDone) -> None:
        self.sender.finish_send(request_id, done)

    # ---- both ---------------------------------------------------------------

    def cancel(self, request_id: str, ticket: TransferTicket | None = None) -> None:
        """Drop the transfer on this side and tell the other side; no event follows.

        A sender that holds a ``ticket`` but has not started sending passes it, so
        the receiver learns of the cancel too.
        """
        with self.transfers.lock:
            self.transfers.end(request_id, "recv")
            out = self.transfers.end(request_id, "send")
        self.sender.tell_cancel(request_id, out, ticket)

    def poll(self) -> list[TransferEvent]:
        """Transfers that ended since the last poll (timeouts are declared here)."""
        with self.transfers.lock:
            expired = self.transfers.expire()
            events = self.transfers.take_events()
        for rid in expired:
            self.cancel(rid)
        return events

    @property
    def num_in_flight(self) -> int:
        return self.transfers.num_in_flight

    @property
    def notify(self) -> Callable[[], None] | None:
        return self.transfers.notify

    @notify.setter
    def notify(self, notify: Callable[[], None] | None) -> None:
        self.transfers.notify = notify

    @property
    def tracer(self) -> Tracer | None:
        return self.transfers.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer | None) -> None:
        self.transfers.tracer = tracer

    @property
    def num_sent(self) -> int:
        return self.sender.num_sent

    @property
    def bytes_sent(self) -> int:
        return self.sender.bytes_sent

    @property
    def seconds_sending(self) -> float:
        return self.sender.seconds_sending

    def transfer_bytes(self, ticket: TransferTicket) -> int:
        return self.sender.transfer_bytes(ticket)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
