"""A streamed completion's HTTP response: Server-Sent Events.

Starlette's ``StreamingResponse`` writes the headers, then starts the body's
iterator, and on ASGI servers before spec 2.4 (uvicorn's) runs the body and a
disconnect listener in an anyio task group. ``EventStreamResponse`` starts the
iterator first, so the request's call is on its way to the engine before the
headers are written, and watches for the client's disconnect in one plain task:
a disconnect cancels the stream, whose ``finally`` blocks abort the request on
the workers (its KV blocks are freed).

An error before the first event is still an event (``sse_stream`` turns every
failure into one), so a stream's status is always 200, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.responses import Response

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies pass each event on as it comes
]


class EventStreamResponse(Response):
    def __init__(self, events: AsyncIterator[str]):
        # Response's own body and headers are not used: __call__ writes both.
        super().__init__(status_code=200)
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.current_task()
        gone = asyncio.Event()
        watcher = asyncio.get_running_loop().create_task(_watch(receive, stream, gone))
        try:
            await self._stream(send)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # cancelled from outside (shutdown): not ours to swallow
            stream.uncancel()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await self.events.aclose()  # an unfinished stream aborts its request

    async def _stream(self, send) -> None:
        # The first event is asked for in a task of its own, which sends the call and
        # waits; the headers go meanwhile (sent with the first event instead, they would
        # cross the proxy after it, on the TTFT's path).
        first_event = asyncio.ensure_future(anext(self.events, None))
        try:
            await asyncio.sleep(0)  # the task runs up to its wait: the call is out
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        except BaseException:  # the iterator is the task's: it ends there before it closes
            first_event.cancel()
            await asyncio.gather(first_event, return_exceptions=True)
            raise
        event = await first_event
        while event is not None:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            event = await anext(self.events, None)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _watch(receive, stream: asyncio.Task, gone: asyncio.Event) -> None:
    """Cancel ``stream`` when the client disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            stream.cancel()
            return
