"""The NCCL pairs of one transport: making them (as either rank), finding them, aborting
them. A pair (``nccl_pair.Pair``) links a sender to a receiver by 2-rank
communicators, its lanes.

Making a pair (the first ``start_send`` from a sender to a receiver)::

    sender (rank 0)                              receiver (rank 1)
    connect: a unique id per lane, pair key
      rendezvous(ticket, key, ids)  -- Ray call -->  join(key, ids): rank 1, in a thread
      rank 0 of each lane (blocks until rank 1 is in), then a warm-up send/recv on each
      "hello" {pair: key}           -- TCP ------->  on_hello: this connection uses that pair

``rendezvous`` is the caller's: in serving it calls the decode worker that
``ticket.owner`` names, which calls ``join``; ``join`` returns at once.

Failure: a communicator whose peer died cannot be reused (its pending kernels
never finish). The pair's are aborted (``comm.abort()`` ends them), dropped, and
its TCP connection closed, when the connection is lost, when an NCCL call fails,
or when a receive is still pending at its transfer's deadline. The other side
sees the connection close and aborts its end; the next ``start_send`` to that
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
from typing import Any

import cupy
import torch

from splitserve.workers.kv.transfer.control import Peer
from splitserve.workers.kv.transfer.framing import Connection
from splitserve.workers.kv.transfer.nccl_pair import (
    Lane,
    NcclOptions,
    Pair,
    communicator,
    split_ids,
    unique_id,
)
from splitserve.workers.kv.transfer.ticket import TransferTicket

logger = logging.getLogger(__name__)

Rendezvous = Callable[[TransferTicket, str, bytes], Any]

_WARMUP_BYTES = 32 << 20  # the first send/recv of a pair connects its channels


class NcclPairs:
    """The pairs this transport sends on (one per receiver) and receives on."""

    def __init__(
        self,
        device: torch.device,
        name: str,
        options: NcclOptions,
        timeout_s: float,
        rendezvous: Rendezvous | None = None,
    ):
        self.device = device
        self.name = name  # this side in pair keys: the worker's id, or its address
        self.options = options
        self.timeout_s = timeout_s
        self.rendezvous = rendezvous  # needed to send; a receive-only worker may leave it None
        self._lock = threading.Lock()
        self._send_pairs: dict[Peer, Pair] = {}
        self._recv_pairs: list[Pair] = []
        self._joined: dict[str, Pair | Exception] = {}  # by pair key, until its hello
        self._joined_cv = threading.Condition()
        # Each accepted connection has its own thread (control.Listener): the pair of
        # the connection a thread serves is thread-local.
        self._local = threading.local()

    # ---- sender (rank 0) ------------------------------------------------------

    def connect(self, peer: Peer, ticket: TransferTicket) -> None:
        """Make the pair to the ticket's receiver over the new connection ``peer``."""
        them = ticket.owner or ticket.address
        key = f"{self.name}->{them}#{uuid.uuid4().hex[:12]}"
        try:
            if self.rendezvous is None:
                raise ValueError(
                    "the nccl KV transport needs rendezvous=... to send: a callable "
                    "(ticket, pair_key, unique_id) that makes the receiver call join()"
                )
            uid = unique_id(self.options.lanes)
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
            self.abort(pair, f"the hello frame could not be sent: {e}")  # closes the conn
            raise
        with self._lock:
            self._send_pairs[peer] = pair

    def sending(self, peer: Peer) -> Pair | None:
        """The pair made over ``peer``; None once it is gone."""
        with self._lock:
            return self._send_pairs.get(peer)

    def peer_lost(self, peer: Peer, error: str) -> None:
        with self._lock:
            pair = self._send_pairs.pop(peer, None)
        if pair is not None:
            self.abort(pair, error)

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
                self.abort(box["pair"], "made after its rendezvous timed out")

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

    # ---- receiver (rank 1) ----------------------------------------------------

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

    def on_hello(self, conn: Connection, header: dict[str, Any]) -> None:
        """The sender names the pair that ``conn`` (served by this thread) goes with."""
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

    def serving(self) -> Pair | None:
        """The pair of the connection this thread serves; None before its hello."""
        return getattr(self._local, "pair", None)

    def disconnected(self, conn: Connection) -> None:
        """``conn``, served by this thread, ended: its pair cannot be used again."""
        pair = self.serving()
        if pair is not None and pair.conn is conn:
            self.abort(pair, "the prefill worker's connection ended")

    # ---- both -----------------------------------------------------------------

    def _make_pair(self, key: str, uid: bytes, rank: int) -> Pair:
        device = self.device
        lanes: list[Lane] = []
        try:
            for lane_id in split_ids(uid):  # both ranks make them in the same order
                with cupy.cuda.Device(device.index):
                    comm = communicator(lane_id, rank)
                stream = torch.cuda.Stream(device, priority=self.options.stream_priority)
                lanes.append(Lane(comm, stream))
        except BaseException:
            for lane in lanes:
                lane.comm.abort()
            raise
        pair = Pair(key, lanes, 1 - rank, torch.cuda.Stream(device))
        # NCCL connects a communicator's channels during its first send/recv, with
        # both ranks in the call: do that here, not under the first real transfer. The
        # bytes are whatever the buffer holds; it is freed once every lane is done.
        warm = torch.empty(_WARMUP_BYTES, dtype=torch.uint8, device=device)
        for i in range(len(lanes)):
            (pair.send if rank == 0 else pair.recv)(i, warm.data_ptr(), _WARMUP_BYTES)
        for lane in lanes:
            lane.stream.synchronize()
        return pair

    def abort(self, pair: Pair, reason: str) -> None:
        """End the pair's pending NCCL kernels, drop it and close its connection."""
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

    def sending_pairs(self) -> list[Pair]:
        """Every pair this side sends on."""
        with self._lock:
            return list(self._send_pairs.values())

    def receiving_pairs(self) -> list[Pair]:
        """Every pair this side receives on, oldest first."""
        with self._lock:
            return list(self._recv_pairs)

    def close(self) -> None:
        for pair in self.sending_pairs() + self.receiving_pairs():
            self.abort(pair, "transport closed")
