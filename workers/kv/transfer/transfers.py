"""The bookkeeping every part of a transport shares: the transfers in flight on each
side, their deadlines, and the events waiting for ``poll()``.

Deadlines: a sender's transfer has ``timeout_s`` from ``start_send`` (the step
that finishes its prompt). A receiver's waits up to ``start_timeout_s`` for the
sender's first frame (its announce or first layer): the prefill may queue behind
others for long, and a prefill that fails reaches the decode worker through the
ingress anyway. The first frame re-arms it to ``timeout_s``.

One re-entrant lock guards both tables and the events. A transfer leaves its
table once (it arrived, was acked, failed or was cancelled), through ``end``,
which calls its ``release`` under that lock: the data path sets ``release`` when
it holds something for the transfer, and once it returns no write into the
transfer's blocks is in flight (the engine may free them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve.workers.kv.transfer.base import TransferEvent, TransferState
from splitserve.workers.kv.transfer.control import Peer
from splitserve.workers.kv.transfer.framing import Connection
from splitserve.workers.kv.transfer.ticket import TransferTicket
from splitserve.workers.kv.transfer.tracing import Tracer

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # how long a receiver waits for its transfer to start


@dataclass(eq=False)
class Outgoing:
    """A sender's transfer, from ``start_send`` to the receiver's ack."""

    ticket: TransferTicket
    src_slots: torch.Tensor  # sender cache slots of the transferred tokens
    peer: Peer  # the connection to the receiver
    deadline: float
    state: TransferState = TransferState.SENDING
    layers_sent: int = 0
    started: float = field(default_factory=time.monotonic)
    data: Any = None  # the send path's state of this transfer (NCCL: its plan's progress)
    release: Callable[[], None] | None = None  # the send path's, see the module docstring


@dataclass(eq=False)
class Incoming:
    """A receiver's transfer, from ``expect`` to its arrival."""

    ticket: TransferTicket
    dst_slots: torch.Tensor  # receiver cache slots of the transferred tokens
    deadline: float
    state: TransferState = TransferState.EXPECTING
    layers_received: int = 0
    conn: Connection | None = None  # the sender's connection, once receiving
    data: Any = None  # the receive path's state of this transfer (NCCL: its receives)
    release: Callable[[], None] | None = None  # the receive path's


class Transfers:
    """Transfers in flight (``outgoing`` and ``incoming``, by request id) and the events
    that ended ones left for ``poll()``."""

    def __init__(self, timeout_s: float, start_timeout_s: float = START_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.start_timeout_s = max(start_timeout_s, timeout_s)
        self.lock = threading.RLock()
        self.outgoing: dict[str, Outgoing] = {}
        self.incoming: dict[str, Incoming] = {}
        self.notify: Callable[[], None] | None = None  # see base.KVTransport
        self.tracer: Tracer | None = None  # see tracing.py
        self._events: list[TransferEvent] = []

    def deadline(self) -> float:
        """The deadline of a transfer that starts now."""
        return time.monotonic() + self.timeout_s

    def start_deadline(self) -> float:
        """The deadline of a receive expected now: for its first frame to come."""
        return time.monotonic() + self.start_timeout_s

    def end(self, request_id: str, side: str) -> Outgoing | Incoming | None:
        """Take the transfer off its side's table ("send" or "recv") and release it;
        None when it is not there. Caller holds the lock."""
        table = self.outgoing if side == "send" else self.incoming
        transfer = table.pop(request_id, None)
        if transfer is not None and transfer.release is not None:
            transfer.release()
        return transfer

    def fail(self, request_id: str, side: str, error: str) -> None:
        """End the transfer with a failed event; caller holds the lock."""
        if self.end(request_id, side) is None:
            return
        logger.warning("KV transfer of %s failed: %s", request_id, error)
        if self.tracer is not None:
            self.tracer("failed", request_id, time.perf_counter(), side=side, error=error)
        self.add_event(TransferEvent(request_id, side, False, error))

    def receiving(self, request_id: str, conn: Connection) -> Incoming | None:
        """The expected transfer ``request_id``, now RECEIVING from ``conn``; None when
        nobody expects it. Caller holds the lock."""
        incoming = self.incoming.get(request_id)
        if incoming is not None and incoming.state == TransferState.EXPECTING:
            incoming.deadline = self.deadline()  # the sender started: timeout_s from now
        if incoming is not None:
            incoming.conn, incoming.state = conn, TransferState.RECEIVING
        return incoming

    def expire(self) -> list[str]:
        """Fail the transfers past their deadline; their request ids. Caller holds the lock."""
        now = time.monotonic()
        tables = list(self.outgoing.items()) + list(self.incoming.items())
        expired = [(rid, t) for rid, t in tables if t.deadline < now]
        for rid, t in expired:
            side = "send" if rid in self.outgoing else "recv"
            if t.state == TransferState.EXPECTING:
                error = f"no KV transfer started within {self.start_timeout_s:.0f} s"
            else:
                error = f"KV transfer timed out after {self.timeout_s:.0f} s"
            self.fail(rid, side, error)
        return [rid for rid, _ in expired]

    def add_event(self, event: TransferEvent) -> None:
        """Queue an event for poll(); caller holds the lock."""
        self._events.append(event)
        if self.notify is not None:
            self.notify()

    def take_events(self) -> list[TransferEvent]:
        """The events queued since the last call; caller holds the lock."""
        events, self._events = self._events, []
        return events

    @property
    def num_in_flight(self) -> int:
        with self.lock:
            return len(self.outgoing) + len(self.incoming)
