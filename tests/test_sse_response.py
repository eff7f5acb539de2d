"""EventStreamResponse: the stream starts before the headers are written, events go out
in order, and a client's disconnect ends the stream with its generator closed."""

import asyncio

from splitserve.cluster.sse_response import EventStreamResponse


class Client:
    """The ASGI server's side: what was sent, in order, and a disconnect on demand."""

    def __init__(self):
        self.log: list[object] = []
        self.disconnect = asyncio.Event()

    async def receive(self):
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.log.append(("start", message["status"]))
        else:
            self.log.append(("body", message["body"], message["more_body"]))


def run(coro):
    return asyncio.run(coro)


async def stalled(closed: asyncio.Event, *first: str):
    """Events ``first``, then a wait only a cancel ends; ``closed`` set when the generator
    closes (where the ingress aborts the request on its workers)."""
    try:
        for event in first:
            yield event
        await asyncio.sleep(30)
        yield "data: never\n\n"
    finally:
        closed.set()


def test_the_call_goes_out_before_the_headers_and_events_follow_in_order():
    async def main():
        client = Client()

        async def events():
            client.log.append("call sent")
            await asyncio.sleep(0.01)  # the engine computes the first token
            yield "data: 1\n\n"
            yield "data: 2\n\n"

        await EventStreamResponse(events())({"type": "http"}, client.receive, client.send)
        return client.log

    assert run(main()) == [
        "call sent",
        ("start", 200),
        ("body", b"data: 1\n\n", True),
        ("body", b"data: 2\n\n", True),
        ("body", b"", False),
    ]


def test_an_empty_stream_still_ends_the_response():
    async def main():
        client = Client()

        async def events():
            return
            yield

        await EventStreamResponse(events())({"type": "http"}, client.receive, client.send)
        return client.log

    assert run(main()) == [("start", 200), ("body", b"", False)]


def test_a_disconnect_cancels_the_stream_and_closes_its_generator():
    async def main():
        client = Client()
        closed = asyncio.Event()
        response = EventStreamResponse(stalled(closed, "data: 1\n\n"))
        task = asyncio.create_task(response({"type": "http"}, client.receive, client.send))
        await asyncio.sleep(0.01)
        client.disconnect.set()
        await asyncio.wait_for(task, 2)  # returns, without raising
        return client.log, closed.is_set(), task.cancelled()

    log, closed, cancelled = run(main())
    assert log == [("start", 200), ("body", b"data: 1\n\n", True)]
    assert closed and not cancelled


def test_a_disconnect_before_the_first_event_closes_the_generator():
    async def main():
        client = Client()
        closed = asyncio.Event()  # the prompt is still computing
        task = asyncio.create_task(
            EventStreamResponse(stalled(closed))({"type": "http"}, client.receive, client.send)
        )
        await asyncio.sleep(0.01)
        client.disconnect.set()
        await asyncio.wait_for(task, 2)
        return client.log, closed.is_set()

    log, closed = run(main())
    assert log == [("start", 200)]
    assert closed


def test_a_cancel_from_outside_is_not_swallowed():
    async def main():
        client = Client()

        response = EventStreamResponse(stalled(asyncio.Event()))
        task = asyncio.create_task(response({"type": "http"}, client.receive, client.send))
        await asyncio.sleep(0.01)
        task.cancel()  # the server shutting down, say
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "returned"

    assert run(main()) == "cancelled"


def test_a_failed_header_write_closes_the_generator_and_raises():
    async def main():
        client = Client()
        closed = asyncio.Event()

        async def broken_send(message):
            raise OSError("the connection is gone")

        try:
            response = EventStreamResponse(stalled(closed))
            await response({"type": "http"}, client.receive, broken_send)
        except OSError:
            return closed.is_set()
        return "returned"

    assert run(main()) is True
