"""Calls between rank 0 and another rank outside the steps, on a pipe of their own.

The step pipe (``rank_process.py``) carries one call and one reply a step, in
lockstep; what cannot wait for a step travels here, each end read by a thread:

- rank 0 -> rank r: ``JoinPair`` (NCCL, decode side): rank r's KV transport joins a
  prefill worker's pair as its rank 1 (returns at once). The decode replica got the
  call for the owner ``"{worker}/{r}"`` (``rank_owner.py``) and passed it to rank 0.
- rank r -> rank 0: ``Rendezvous`` (NCCL, prefill side): rank r's transport, sending
  for the first time to a decode rank, needs that rank to join; only rank 0's process
  reaches the replica, so rank 0 makes the call with its own transport's rendezvous
  and answers ``RendezvousDone``. The transport thread that asked waits for it.
- rank r -> rank 0: ``Wake``: rank r's transport has news (KV arrived, an ack, a
  connection made), so rank 0's loop steps the group now instead of after its idle
  wait.

When a rank's process ends, its pipe closes: rank 0's reader marks the rank lost and
wakes the loop, whose next step fails the group with the rank's exit code.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from splitserve.workers.kv.transfer.ticket import TransferTicket

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 90.0  # rank 0's own call waits 60 s for the decode replica


@dataclass(frozen=True)
class JoinPair:
    pair_key: str
    unique_id: bytes


@dataclass(frozen=True)
class Rendezvous:
    call_id: int
    ticket: TransferTicket
    pair_key: str
    unique_id: bytes


@dataclass(frozen=True)
class RendezvousDone:
    call_id: int
    error: str | None = None


@dataclass(frozen=True)
class Wake:
    pass


class RankSide:
    """Rank r's end. ``rendezvous`` is its transport's (blocking, on a transport thread);
    ``wake`` its transport's ``notify``; ``transport`` joins the pairs rank 0 passes on."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.transport = None  # set once the engine is built
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[threading.Event, list]] = {}
        self._ids = itertools.count(1)
        threading.Thread(target=self._read, name="ep-rank-calls", daemon=True).start()

    def rendezvous(self, ticket: TransferTicket, pair_key: str, unique_id: bytes) -> None:
        call_id = next(self._ids)
        done, result = threading.Event(), []
        self._calls[call_id] = (done, result)
        try:
            self._send(Rendezvous(call_id, ticket, pair_key, unique_id))
            if not done.wait(RENDEZVOUS_TIMEOUT_S):
                raise ConnectionError(f"no NCCL rendezvous with {ticket.owner} through rank 0")
            if result[0] is not None:
                raise ConnectionError(f"NCCL rendezvous with {ticket.owner} failed: {result[0]}")
        finally:
            self._calls.pop(call_id, None)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # rank 0 is gone: this process ends soon
            self._send(Wake())

    def _send(self, message) -> None:
        with self._lock:
            self.conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(message, JoinPair):
                self.transport.join(message.pair_key, message.unique_id)
            elif isinstance(message, RendezvousDone) and message.call_id in self._calls:
                done, result = self._calls[message.call_id]
                result.append(message.error)
                done.set()


class FrontSide:
    """Rank 0's end of every other rank's pipe (``conns[r - 1]``)."""

    def __init__(self, conns: list[Connection], rendezvous: Callable | None):
        self.conns = conns
        self.rendezvous = rendezvous  # rank 0's transport's; None: no NCCL sends
        self.notify: Callable[[], None] | None = None  # wakes rank 0's loop
        self.lost: set[int] = set()  # ranks whose process ended
        self._locks = [threading.Lock() for _ in conns]
        for rank, conn in enumerate(conns, 1):
            name = f"ep-rank{rank}-calls"
            threading.Thread(target=self._read, args=(rank, conn), name=name, daemon=True).start()

    def join(self, rank: int, pair_key: str, unique_id: bytes) -> None:
        self._send(rank, JoinPair(pair_key, unique_id))

    def _send(self, rank: int, message) -> None:
        with self._locks[rank - 1]:
            self.conns[rank - 1].send(message)

    def _wake(self) -> None:
        if self.notify is not None:
            self.notify()

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self.lost.add(rank)
                self._wake()
                return
            if isinstance(message, Wake):
                self._wake()
            elif isinstance(message, Rendezvous):
                args = (rank, message)
                threading.Thread(target=self._answer, args=args, daemon=True).start()

    def _answer(self, rank: int, call: Rendezvous) -> None:
        error = None
        try:
            if self.rendezvous is None:
                raise ConnectionError("rank 0 has no NCCL rendezvous to make")
            self.rendezvous(call.ticket, call.pair_key, call.unique_id)
        except Exception as e:  # rank r's transport raises it for the transfer
            error = f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):
            self._send(rank, RendezvousDone(call.call_id, error))
