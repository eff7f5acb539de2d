"""One side of the NCCL link between a prefill and a decode worker.

A ``Pair`` holds the link's lanes (each a 2-rank communicator and the stream
that uses it), its copy stream (gather on the sender, scatter on the receiver)
and the sender's queue of transfers in announce order. ``message_plan`` splits
a transfer's layers into NCCL messages; both sides read the plan from the
transfer's "announce" frame, so they agree on every message's size and order
(``check_plan`` is the receiver's check of it against the ticket).
``NcclOptions`` holds a transport's settings: the plan's and the lanes'.

Message i of a transfer goes on lane ``i % lanes``, so consecutive messages run
on different communicators: the next message's kernel is already on the wire
when the one before drains, and a scatter (or gather) launched between them
cannot hold it off the SMs. Each lane keeps the messages in the same order on
both sides, which is all NCCL needs to match them.
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

from splitserve.workers.kv.transfer.ticket import TransferTicket

try:
    from cupy.cuda import nccl
except ImportError:  # machines without cupy: message_plan still works; nccl_transport says why
    nccl = None

_SPIN_S = 0.02  # how long a wait spins on an event before it sleeps between queries
ID_BYTES = 128  # an NCCL unique id (NCCL_UNIQUE_ID_BYTES)
_CTAS_ENV = "NCCL_MAX_CTAS"


@dataclass(eq=False)
class Lane:
    """One 2-rank communicator of a pair and the stream its sends (or receives) run on."""

    comm: Any  # nccl.NcclCommunicator
    stream: torch.cuda.Stream

    @functools.cached_property
    def handle(self) -> int:
        """The stream's handle (torch's Stream properties cost host time at each read)."""
        return self.stream.cuda_stream


@dataclass(eq=False)
class Pair:
    """This side of the link with one peer: its lanes, and the copy stream.

    ``lock`` orders every NCCL call on the lanes, the sender's queue and
    ``abort``: sends (and receives) are queued in the order they take it.
    """

    key: str
    lanes: list[Lane]
    peer_rank: int
    copy_stream: torch.cuda.Stream  # gather (sender) or scatter (receiver)
    conn: Any = None  # its control connection (framing.Connection)
    aborted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    sending: deque = field(default_factory=deque)  # sender: Outgoing, in announce order
    # Receiver: the staging ring, kept from one transfer to the next, and an event
    # after the last scatter queued from it (``NcclRecvPath._recv_ring``).
    ring: torch.Tensor | None = None
    ring_free: torch.cuda.Event | None = None

    def check_open(self) -> None:
        """Raise ConnectionError once the communicator was aborted; caller holds lock."""
        if self.aborted:
            raise ConnectionError(f"NCCL communicator {self.key} was aborted")

    # Plain ints for the hot path, read once: torch's Stream properties cost host
    # time at each read.
    @functools.cached_property
    def device_index(self) -> int:
        return self.copy_stream.device.index

    @functools.cached_property
    def copy_handle(self) -> int:
        """The copy stream's handle."""
        return self.copy_stream.cuda_stream

    def lane(self, message: int) -> Lane:
        """The lane that message ``message`` of a transfer goes on (both sides agree)."""
        return self.lanes[message % len(self.lanes)]

    def send(self, message: int, ptr: int, nbytes: int) -> None:
        """Queue message ``message``'s send of ``nbytes`` from device address ``ptr`` on
        its lane; caller holds lock."""
        lane = self.lane(message)
        with self.on_device():
            lane.comm.send(ptr, nbytes, nccl.NCCL_UINT8, self.peer_rank, lane.handle)

    def recv(self, message: int, ptr: int, nbytes: int) -> None:
        """Queue message ``message``'s receive of ``nbytes`` into device address ``ptr``;
        caller holds lock."""
        lane = self.lane(message)
        with self.on_device():
            lane.comm.recv(ptr, nbytes, nccl.NCCL_UINT8, self.peer_rank, lane.handle)

    def abort(self) -> None:
        """End every lane's pending kernels; caller holds lock.

        The lanes are aborted at once, each in its own thread: an abort waits for the
        device, so one lane's abort would hang behind the other lane's stuck kernel.
        """
        self.aborted = True
        threads = [threading.Thread(target=lane.comm.abort, daemon=True) for lane in self.lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def on_device(self) -> contextlib.AbstractContextManager:
        """The communicator's device as the current one (a no-op when it is, as in a
        worker that sees one GPU: the stream is passed to NCCL, not entered)."""
        index = self.device_index
        return (
            contextlib.nullcontext()
            if torch.cuda.current_device() == index
            else (torch.cuda.device(index))
        )


def transfer_plan(
    num_layers: int, layer_bytes: int, cap: int, first: int = 1, max_bytes: int | None = None
) -> list[tuple[int, int]]:
    """``message_plan`` for a transfer of ``layer_bytes`` a layer, its ``cap`` lowered so
    that a message holds at most ``max_bytes`` (``None``: no limit) but at least one
    layer. Both sides stage two of the largest messages, so this bounds their buffers
    whatever the prompt's length."""
    if max_bytes is not None and layer_bytes > 0:
        cap = max(1, min(cap, max_bytes // layer_bytes))
    return message_plan(cap, num_layers, first)


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


def check_plan(ticket: TransferTicket, plan: list[tuple[int, int]], layer_bytes: int):
    """An error when an announced plan does not fit the ticket, else None."""
    expected = ticket.layout.bytes_per_token(1) * ticket.num_transfer_tokens
    if layer_bytes != expected:
        return f"KV announce has {layer_bytes} bytes a layer, expected {expected}"
    firsts = [sum(n for _, n in plan[:i]) for i in range(len(plan))]
    if [f for f, _ in plan] != firsts or sum(n for _, n in plan) != ticket.num_layers:
        return f"KV announce plans messages {plan}, not layers 0..{ticket.num_layers - 1}"
    if any(n < 1 for _, n in plan):
        return f"KV announce plans an empty message: {plan}"
    return None


@dataclass
class NcclOptions:
    """One transport's NCCL settings, read where they are used: a change applies from
    the next transfer (its plan) or the next pair (lanes, priority). The plan's are
    the sender's (its receivers follow the announced plan), the lanes the pair
    maker's (the receiver joins them)."""

    layers_per_message: int = 8  # message_plan's cap
    first_message_layers: int = 1  # and its ramp
    max_message_bytes: int | None = 128 << 20  # lowers the cap for long prompts
    lanes: int = 2  # communicators of each pair this side makes
    # CUDA priority of the pairs' NCCL streams (lower is higher; 0 is the default's):
    # high, so NCCL's blocks start ahead of queued copy and compute kernels.
    stream_priority: int = -1
    max_ctas: int | None = None  # thread blocks an NCCL kernel of the process may take: cap_ctas

    def check(self) -> None:
        """Raise ValueError on a setting no transfer could use."""
        message_plan(self.layers_per_message, 1, self.first_message_layers)  # raises
        if self.lanes < 1:
            raise ValueError(f"an NCCL pair needs at least one lane, got {self.lanes}")
        if self.max_message_bytes is not None and self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be at least 1, got {self.max_message_bytes}")
        if self.max_ctas is not None and self.max_ctas < 1:
            raise ValueError(f"max_ctas must be at least 1 or None, got {self.max_ctas}")


def wait_event(event: torch.cuda.Event, pair: Pair | None, deadline: float) -> bool:
    """Wait for ``event``; False at the deadline or when ``pair`` is aborted.

    It spins first, yielding the CPU (and the GIL) between queries with
    ``sched_yield``, not ``sleep(0)``: a zero sleep still costs a timer's slack,
    which a hand-off's end would wait for.
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


def unique_id(count: int = 1) -> bytes:
    """``count`` new NCCL unique ids, as one string of bytes (it travels in Ray calls)."""
    return b"".join(_one_unique_id() for _ in range(count))


def _one_unique_id() -> bytes:
    uid = nccl.get_unique_id()
    if isinstance(uid, bytes):  # cupy >= 14
        return uid
    return bytes(b & 0xFF for b in uid)  # older cupy: a tuple of C chars


def split_ids(uid: bytes) -> list[bytes]:
    """The NCCL unique ids in ``uid`` (``unique_id``'s output)."""
    if not uid or len(uid) % ID_BYTES:
        raise ValueError(f"NCCL unique ids come in {ID_BYTES} bytes each, got {len(uid)} bytes")
    return [uid[i : i + ID_BYTES] for i in range(0, len(uid), ID_BYTES)]


def cap_ctas(max_ctas: int | None) -> int | None:
    """Cap the thread blocks of this process's NCCL kernels at ``max_ctas`` unless the
    environment already sets ``NCCL_MAX_CTAS``; returns the cap in force (None: NCCL's own).

    A receiver queues a transfer's receives when its prompt's prefill starts, so each
    lane's receive kernel sits on the decode GPU's SMs, polling, while the prompt
    computes. With NCCL's 32 channels a peer over NVLink and two lanes that is up to 64
    of an H200's 132 SMs: a decode step's weight-bound projection at 96 requests took
    1.42x as long as alone, and 0.98x with 16 blocks a kernel (``benchmarks/recv_spin.py``).
    The cap costs the hand-off bandwidth: a 4096-token Qwen3-8B hand-off took 2.27 ms
    capped at 16 against 2.05 uncapped (``benchmarks/kv_transfer.py``). NCCL reads the
    variable once, at the process's first communicator, so the transport calls this
    before it makes any and the cap holds for every communicator of the process.
    """
    if max_ctas is not None and _CTAS_ENV not in os.environ:
        os.environ[_CTAS_ENV] = str(max_ctas)
    value = os.environ.get(_CTAS_ENV, "")
    return int(value) if value.strip().isdigit() else None


def communicator(uid: bytes, rank: int) -> Any:
    """Rank ``rank`` of a 2-rank communicator on the current device; blocks until both join."""
    try:
        return nccl.NcclCommunicator(2, uid, rank)
    except TypeError:  # older cupy takes the id as a tuple of C chars (signed on x86-64)
        return nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in uid), rank)
