"""A worker replica's handle on its engine process (``core_process.py``), for asyncio.

``EngineClient`` starts the process and waits for it to be ready (a failed start
raises the engine's own error). ``generate`` queues a request and yields lists
of its events as they come: whatever piled up since the caller last looked,
so a caller that lags takes several steps' events at once instead of falling
further behind. Leaving the iteration early (a client disconnect, a cancelled
call) aborts the request, so its KV blocks return.

A reader thread receives the process's frames, one per engine step, decodes
them and hands each to the event loop in one call. If the process dies, every
open stream ends with ``Failed`` and ``alive`` turns False (the replica's
health check reports it); ``shutdown`` stops the process, and kills it if it
does not stop in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection

from splitserve.config import EngineConfig
from splitserve.workers.engine import messages
from splitserve.workers.engine.core_process import (
    EngineDied,
    JoinPair,
    Ready,
    Rendezvous,
    RendezvousDone,
    Shutdown,
    Start,
    StartFailed,
)
from splitserve.workers.engine.messages import (
    Abort,
    Event,
    Failed,
    GenerateCall,
    Rejected,
    StepEvents,
    WorkerStats,
)

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0

# The replica's side of the NCCL rendezvous: (decode replica id, pair key, unique id).
RendezvousCall = Callable[[str, str, bytes], None]


class EngineStartError(RuntimeError):
    """The engine process could not start; the message holds its own traceback."""


class _Stream:
    """One request's events, waiting for its ``generate`` to take them."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ready = asyncio.Event()

    def put(self, event: Event) -> None:
        self.events.append(event)
        self.ready.set()

    async def take(self) -> list[Event]:
        await self.ready.wait()
        self.ready.clear()
        events, self.events = self.events, []
        return events


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        owner: str = "",
        rendezvous: RendezvousCall | None = None,
    ):
        self._rendezvous = rendezvous
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "splitserve.workers.engine.core_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        start = Start(dataclasses.asdict(config), owner, rendezvous is not None)
        self._send(start)
        self.stats: WorkerStats = self._wait_ready()
        self.stats.pid = os.getpid()
        self.error: str | None = None  # why the process is gone
        self._closing = False
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self.process.poll() is None

    @property
    def pid(self) -> int:
        return self.process.pid

    async def generate(self, call: GenerateCall) -> AsyncIterator[list[Event]]:
        """Queue a request; yield its events in order, in lists, until its last."""
        if not self.alive:
            raise RuntimeError(f"the engine process has stopped: {self.error}")
        self._loop = asyncio.get_running_loop()
        rid = call.request_id
        stream = self._streams[rid] = _Stream()
        finished = False
        try:
            self._send(call)
            while not finished:
                events = await stream.take()
                finished = any(_is_last(e) for e in events)
                yield events
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(OSError):
            self._send(Abort(request_id))

    def join(self, pair_key: str, unique_id: bytes) -> None:
        """NCCL, decode side: join a prefill worker's pair as rank 1 (returns at once)."""
        self._send(JoinPair(pair_key, unique_id))

    def shutdown(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._send(Shutdown())
        try:
            self.process.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop; killing it", self.process.pid)
            self.process.kill()
            self.process.wait()
        self.conn.close()

    # ---- the process's side ------------------------------------------------------------

    def _send(self, message) -> None:
        frame = messages.encode(message)
        with self._send_lock:
            self.conn.send_bytes(frame)

    def _wait_ready(self) -> WorkerStats:
        try:
            message = messages.decode(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            code = self.process.wait()
            raise EngineStartError(f"the engine process exited with code {code}") from e
        if isinstance(message, StartFailed):
            self.process.wait()
            raise EngineStartError(f"the engine could not start:\n{message.error}")
        assert isinstance(message, Ready), message
        return message.stats

    def _read(self) -> None:
        """The reader thread: one frame at a time, decoded here, handled on the loop."""
        try:
            while True:
                message = messages.decode(self.conn.recv_bytes())
                if isinstance(message, WorkerStats):
                    message.pid = os.getpid()
                    self.stats = message
                elif isinstance(message, StepEvents):
                    self._call_soon(self._dispatch, message.events)
                elif isinstance(message, Rendezvous):
                    threading.Thread(target=self._answer_rendezvous, args=(message,)).start()
                elif isinstance(message, EngineDied):
                    self.error = f"the engine loop died:\n{message.error}"
        except (EOFError, OSError):
            code = self.process.wait()
            self.error = self.error or f"the engine process exited with code {code}"
        if not self._closing:
            logger.error("engine process %d is gone: %s", self.process.pid, self.error)
        self._call_soon(self._fail_all)

    def _call_soon(self, callback, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)

    def _dispatch(self, events: list[Event]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None:  # else the caller left; its abort is on the way
                stream.put(event)

    def _fail_all(self) -> None:
        first_line = (self.error or "").splitlines()[0] if self.error else "gone"
        for rid, stream in list(self._streams.items()):
            stream.put(Failed(rid, first_line))

    def _answer_rendezvous(self, call: Rendezvous) -> None:
        error = None
        try:
            self._rendezvous(call.owner, call.pair_key, call.unique_id)
        except Exception as e:  # the engine's transport raises it for the transfer
            error = f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):
            self._send(RendezvousDone(call.call_id, error))


def _is_last(event: Event) -> bool:
    return isinstance(event, Failed | Rejected) or getattr(event, "finished", False)
