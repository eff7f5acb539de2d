"""A front's (an ingress replica's) connection to one engine process, for asyncio.

One TCP connection per front and engine carries every request the front sends
there: ``generate`` sends a ``GenerateCall`` and yields lists of the request's
events as they come (whatever piled up since the caller last looked, so a
caller that lags takes several steps' events at once instead of falling
further behind); leaving the iteration early aborts the request, so its KV
blocks return. The engine also pushes its ``WorkerStats`` here every stats
period, which the front routes on.

If the connection ends (the engine process or its replica died), every open
stream ends with ``Failed`` and ``alive`` turns False; so does a ``Failed`` that says
the engine is down (its loop died and it is exiting: no retry may land there).
``stalled`` says when the engine looks hung (its stats stopped coming, or its step
count stopped moving while it holds requests); the front then routes around it and
``fail_open`` ends its streams (``cluster/worker_directory.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable

from splitserve.workers.engine import messages
from splitserve.workers.engine.messages import (
    Abort,
    Delta,
    Event,
    Failed,
    GenerateCall,
    Hello,
    LateTicket,
    ProfileCall,
    ProfileDone,
    StepEvents,
    WorkerStats,
    is_last,
)

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


class _Stream:
    """One request's events, waiting for its ``generate`` to take them. (A bare future
    wakes the taker: an ``asyncio.Event`` costs more, once per token.)

    A disaggregated request's first token comes twice: from its prefill worker as the
    prompt's step ends (``give_first``) and from the engine here once the KV is in. The
    first of the two to come is the one kept. (An engine's error delta carries no token
    and goes through as it is: the hand-off failed, and says why.)"""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ended = False  # its last event is in: nothing goes after it
        self.ended_here = False  # ... put by this side, not the engine's: abort it there
        self.given_first: Delta | None = None  # the prefill worker's first token, kept
        self.engine_started = False  # the engine's first delta came
        self._waiter: asyncio.Future | None = None

    def give_first(self, delta: Delta) -> None:
        if not self.engine_started and self.given_first is None:
            self.given_first = delta
            self.put(delta)

    def put_from_engine(self, event: Event) -> None:
        if isinstance(event, Delta) and event.token_ids and not self.engine_started:
            self.engine_started = True
            given = self.given_first
            if given is not None:
                if same_first_token(given, event):
                    return  # the client has it already
                message = "the prefill and decode workers gave different first tokens"
                event = Failed(event.request_id, message)
                self.put(event, here=True)
                return
        self.put(event)

    def put(self, event: Event, here: bool = False) -> None:
        if self.ended:
            return
        self.ended = is_last(event)
        self.ended_here = self.ended and here
        self.events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Event]:
        """The events put since the last take (waits for one); the last event, once in,
        is in the list this returns."""
        if not self.events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self.events = self.events, []
        return events


class EngineConnection:
    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.name = name  # for messages: "the decode worker 3f2a"
        self.stats: WorkerStats | None = None
        self.error: str | None = None
        self.on_update: Callable[[], None] | None = None  # stats came, or a request ended
        self.sent_since_stats = 0  # calls sent since the last stats (routing adds them)
        self.sent_tokens_since_stats = 0  # and their prompt tokens
        self.stats_at = time.monotonic()  # when stats last came (or the connection opened)
        self.progress_at = self.stats_at  # when its step count last moved, or it held nothing
        self.hung = False  # its open streams were ended as it looked hung (until it steps)
        self._reader = reader
        self._writer = writer
        self._streams: dict[str, _Stream] = {}
        self._profile_calls: dict[int, asyncio.Future] = {}  # call id -> its ProfileDone
        self._call_ids = itertools.count(1)
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, address: str, secret: str, name: str = "") -> EngineConnection:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port)), CONNECT_TIMEOUT_S
        )
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = cls(name or address, reader, writer)
        connection._send(Hello(secret))
        return connection

    @property
    def alive(self) -> bool:
        return self.error is None

    @property
    def num_open(self) -> int:
        """This front's requests open on the engine."""
        return len(self._streams)

    @property
    def draining(self) -> bool:
        """The engine finishes what it holds and takes nothing new (its replica is going)."""
        return self.stats is not None and self.stats.draining

    def stalled(self, timeout_s: float) -> str | None:
        """Why the engine looks hung (None: it does not): no stats for ``timeout_s``, or
        no step in ``timeout_s`` while it holds requests; not while it answers a profile
        call (writing a trace takes its loop seconds; the caller's timeout bounds it)."""
        if self._profile_calls:
            return None
        now = time.monotonic()
        if now - self.stats_at > timeout_s:
            return f"sent no load report for {now - self.stats_at:.1f} s"
        if now - self.progress_at > timeout_s:
            return f"made no step in {now - self.progress_at:.1f} s while holding requests"
        return None

    async def generate(self, call: GenerateCall) -> AsyncIterator[list[Event]]:
        """Send a request; yield its events in order, in lists, until its last."""
        if not self.alive:
            raise ConnectionError(f"{self.name}: {self.error}")
        rid = call.request_id
        stream = self._streams[rid] = _Stream()
        finished = False
        try:
            self._send(call)
            self.sent_since_stats += 1
            self.sent_tokens_since_stats += len(call.prompt_token_ids)
            while not finished:
                events = await stream.take()
                finished = stream.ended  # its last event is in ``events``
                yield events
        finally:
            self._streams.pop(rid, None)
            if not finished or stream.ended_here:  # the engine still holds it
                self.abort(rid)
            if self.on_update is not None:
                self.on_update()

    async def profile(self, start: bool) -> ProfileDone:
        """Open (``start``) or close the engine's torch.profiler window; its answer."""
        if not self.alive:
            raise ConnectionError(f"{self.name}: {self.error}")
        call = ProfileCall(next(self._call_ids), start)
        done = self._profile_calls[call.call_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(call)
            return await done
        finally:
            self._profile_calls.pop(call.call_id, None)

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._send(Abort(request_id))

    def send_ticket(self, request_id: str, kv_ticket: bytes) -> None:
        """A prefill worker's request sent with ``ticket_follows``: its decode worker's
        ticket (the engine sends the prompt's KV there)."""
        if self.alive:
            self._send(LateTicket(request_id, kv_ticket))

    def give_first(self, request_id: str, delta: Delta) -> None:
        """A disaggregated request's first token from its prefill worker, ahead of this
        engine's (which repeats it once the KV is in, and is then left out)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.give_first(delta)

    def fail(self, request_id: str, message: str) -> None:
        """End a request's stream with ``Failed`` from this side (its hand-off failed
        elsewhere); the stream's end then aborts it on the engine."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(Failed(request_id, message), here=True)

    def fail_open(self, message: str) -> None:
        """End every open stream with ``Failed`` (the engine looks hung); each stream's
        end sends its abort, which the engine acts on if it wakes."""
        self.hung = True
        self._fail_all(message)

    def close(self) -> None:
        self.error = self.error or f"the connection to {self.name} was closed"
        self._task.cancel()
        self._writer.close()
        self._fail_all(self.error)
        self._end_profile_calls()

    # ---- the engine's side -------------------------------------------------------------

    def _send(self, message) -> None:
        self._writer.write(messages.framed(messages.encode(message)))

    async def _read(self) -> None:
        try:
            while True:
                message = messages.decode(await messages.read_frame(self._reader))
                if isinstance(message, StepEvents):
                    self._dispatch(message.events)
                elif isinstance(message, ProfileDone):
                    self.stats_at = self.progress_at = time.monotonic()  # it answers: alive
                    done = self._profile_calls.get(message.call_id)
                    if done is not None and not done.done():
                        done.set_result(message)
                elif isinstance(message, WorkerStats):
                    self._on_stats(message)
                    self.sent_since_stats = self.sent_tokens_since_stats = 0
                    if self.on_update is not None:
                        self.on_update()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # closed, reset, or a frame that is not ours
            self.error = f"the connection to {self.name} ended ({type(e).__name__})"
            logger.warning("%s", self.error)
        self._fail_all(self.error)
        self._end_profile_calls()
        with contextlib.suppress(Exception):
            self._writer.close()

    def _on_stats(self, stats: WorkerStats) -> None:
        now = time.monotonic()
        moved = self.stats is None or stats.num_steps != self.stats.num_steps
        if moved or not holds_requests(stats):
            self.progress_at = now
            self.hung = False
        self.stats, self.stats_at = stats, now

    def _dispatch(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Failed) and event.engine_down and self.error is None:
                self.error = event.message  # no new request goes there (nor a retry)
            stream = self._streams.get(event.request_id)
            if stream is not None:  # else the caller left; its abort is on the way
                stream.put_from_engine(event)

    def _end_profile_calls(self) -> None:
        for done in self._profile_calls.values():
            if not done.done():
                done.set_exception(ConnectionError(f"{self.name}: {self.error}"))

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            stream.put(Failed(rid, message), here=True)


def same_first_token(given: Delta, delta: Delta) -> bool:
    """Whether the engine's first delta repeats the one the prefill worker gave."""
    return (
        delta.token_ids == given.token_ids
        and delta.text == given.text
        and delta.finish_reason is None
        and delta.error is None
    )


def holds_requests(stats: WorkerStats) -> bool:
    """Whether the engine has requests it must step (its loop steps while it does)."""
    held = stats.num_running + stats.num_waiting + stats.num_waiting_for_kv
    return held + stats.num_sending_kv > 0
