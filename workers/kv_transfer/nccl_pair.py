"""One side of a 2-rank NCCL communicator between a prefill and a decode worker.

A ``Pair`` holds the communicator and the two streams that use it (NCCL, and
copies: gather on the sender, scatter on the receiver), plus the sender's queue
of transfers in announce order. ``message_plan`` splits a transfer's layers
into NCCL messages; both sides read the plan from the transfer's "announce"
frame, so they agree on every message's size and order.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    from cupy.cuda import nccl
except ImportError:  # machines without cupy: message_plan still works; nccl_transport says why
    nccl = None

_SPIN_S = 0.02  # how long a wait spins on an event before it sleeps between queries


@dataclass(eq=False)
class Pair:
    """This side of one 2-rank communicator, and the streams that use it.

    ``lock`` orders every NCCL call on the communicator, the sender's queue and
    ``abort``: sends (and receives) are queued in the order they take it.
    """

    key: str
    comm: Any  # nccl.NcclCommunicator
    peer_rank: int
    nccl_stream: torch.cuda.Stream
    copy_stream: torch.cuda.Stream  # gather (sender) or scatter (receiver)
    conn: Any = None  # its control connection (framing.Connection)
    aborted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    sending: deque = field(default_factory=deque)  # sender: Outgoing, in announce order
    # Receiver: the staging ring, kept from one transfer to the next, and an event
    # after the last scatter queued from it (``NcclKVTransport._recv_ring``).
    ring: torch.Tensor | None = None
    ring_free: torch.cuda.Event | None = None

    def check_open(self) -> None:
        """Raise ConnectionError once the communicator was aborted; caller holds lock."""
        if self.aborted:
            raise ConnectionError(f"NCCL communicator {self.key} was aborted")

    # Plain ints for the hot path, read once: torch's Stream properties cost a
    # microsecond each.
    @functools.cached_property
    def device_index(self) -> int:
        return self.nccl_stream.device.index

    @functools.cached_property
    def stream(self) -> int:
        """The NCCL stream's handle."""
        return self.nccl_stream.cuda_stream

    @functools.cached_property
    def copy_handle(self) -> int:
        """The copy stream's handle."""
        return self.copy_stream.cuda_stream

    def send(self, ptr: int, nbytes: int) -> None:
        """Queue a send of ``nbytes`` from device address ``ptr`` on the NCCL stream;
        caller holds lock."""
        with self.on_device():
            self.comm.send(ptr, nbytes, nccl.NCCL_UINT8, self.peer_rank, self.stream)

    def recv(self, ptr: int, nbytes: int) -> None:
        """Queue a receive of ``nbytes`` into device address ``ptr``; caller holds lock."""
        with self.on_device():
            self.comm.recv(ptr, nbytes, nccl.NCCL_UINT8, self.peer_rank, self.stream)

    def on_device(self) -> contextlib.AbstractContextManager:
        """The communicator's device as the current one (a no-op when it is, as in a
        worker that sees one GPU: the stream is passed to NCCL, not entered)."""
        index = self.device_index
        return (
            contextlib.nullcontext()
            if torch.cuda.current_device() == index
            else (torch.cuda.device(index))
        )


def message_plan(cap: int, num_layers: int, first: int = 1) -> list[tuple[int, int]]:
    """``(first layer, layers)`` of each NCCL message of a transfer.

    Messages grow ``first``, 2 ``first``, 4 ``first``, ... up to ``cap`` layers and
    shrink the same way at the end: the first send starts after ``first`` layers'
    gather, the last scatter is that size, and the messages between run near the
    link's peak. ``cap`` 1 sends each layer alone; ``first`` >= ``cap`` sends
    ``cap`` layers a message throughout.
    """
    if cap < 1 or first < 1:
        raise ValueError(f"layers per message must be at least 1, got cap {cap}, first {first}")
    head, tail, left, n = [], [], num_layers, first
    while left > 0 and n < cap:
        for side in (head, tail):
            take = min(n, left)
            if take:
                side.append(take)
                left -= take
        n *= 2
    middle = [cap] * (left // cap) + ([left % cap] if left % cap else [])
    plan, start = [], 0
    for size in head + middle + tail[::-1]:
        plan.append((start, size))
        start += size
    return plan


def wait_event(event: torch.cuda.Event, pair: Pair | None, deadline: float) -> bool:
    """Wait for ``event``; False at the deadline or when ``pair`` is aborted.

    It spins first, yielding the CPU (and the GIL) between queries with
    ``sched_yield``, not ``sleep(0)``: a zero sleep still costs a timer's slack
    (about 50 us on Linux), which a hand-off's end would wait for.
    """
    spin_until = time.monotonic() + _SPIN_S
    while not event.query():
        if pair is not None and pair.aborted:
            return False
        now = time.monotonic()
        if now > deadline:
            return False
        if now < spin_until:
            os.sched_yield()
        else:
            time.sleep(0.0005)
    return True


def unique_id() -> bytes:
    """A new NCCL unique id, as bytes (it travels in Ray calls)."""
    uid = nccl.get_unique_id()
    if isinstance(uid, bytes):  # cupy >= 14
        return uid
    return bytes(b & 0xFF for b in uid)  # older cupy: a tuple of C chars


def communicator(uid: bytes, rank: int) -> Any:
    """Rank ``rank`` of a 2-rank communicator on the current device; blocks until both join."""
    try:
        return nccl.NcclCommunicator(2, uid, rank)
    except TypeError:  # older cupy takes the id as a tuple of C chars (signed on x86-64)
        return nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in uid), rank)
