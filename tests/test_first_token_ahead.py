"""A disaggregated request's first token reaches the front twice: from its prefill worker
as soon as it is sampled (``EngineConnection.give_first``), and from the decode worker's
engine once the KV is in. The stream keeps whichever comes first, exactly once.

The decode engine here is a scripted one on a real loopback socket, speaking the engine's
frames, so the order of the two copies is the test's to choose.
"""

from __future__ import annotations

import asyncio

from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine import messages
from splitserve.workers.engine.engine_connection import EngineConnection
from splitserve.workers.engine.messages import Abort, Delta, Failed, GenerateCall, StepEvents

SECRET = "s3cret"
RID = "cmpl-1"


def _delta(tokens: list[int], text: str, finish: str | None = None) -> Delta:
    return Delta(RID, tokens, text, None, finish, None, 0, None)


class ScriptedEngine:
    """Accepts one front; records its frames; sends the events the test gives it."""

    def __init__(self) -> None:
        self.received: list = []
        self.call_in = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.writer = writer
        while True:
            try:
                message = messages.decode(await messages.read_frame(reader))
            except asyncio.IncompleteReadError:
                return
            self.received.append(message)
            if isinstance(message, GenerateCall):
                self.call_in.set()

    async def send(self, *events) -> None:
        self.writer.write(messages.framed(messages.encode(StepEvents(list(events)))))
        await self.writer.drain()

    def close(self) -> None:
        self.server.close()


async def _run(script) -> tuple[list[list], list]:
    """Open a front to a scripted engine, send one call, run ``script(engine, front)``
    beside the stream; the lists of events the stream yielded, and the engine's frames."""
    engine = ScriptedEngine()
    front = await EngineConnection.open(await engine.start(), SECRET, "decode worker d1")
    call = GenerateCall(RID, [1, 2, 3], SamplingParams(max_tokens=3))
    taken: list[list] = []

    async def consume():
        async for events in front.generate(call):
            taken.append(events)

    consumer = asyncio.ensure_future(consume())
    await asyncio.wait_for(engine.call_in.wait(), 5)
    await script(engine, front)
    await asyncio.wait_for(consumer, 5)
    await asyncio.sleep(0.05)  # an abort the stream's end sent reaches the engine
    front.close()
    engine.close()
    return taken, engine.received


def _tokens(taken: list[list]) -> list[int]:
    return [t for events in taken for e in events if isinstance(e, Delta) for t in e.token_ids]


def test_the_prefill_workers_first_token_goes_out_and_the_engines_copy_is_left_out():
    async def script(engine, front):
        front.give_first(RID, _delta([7], "a"))
        await asyncio.sleep(0.05)
        await engine.send(_delta([7], "a"))  # the decode engine's copy, once the KV is in
        await engine.send(_delta([8], "b"), _delta([9], "c", "length"))

    taken, received = asyncio.run(_run(script))
    assert taken[0] == [_delta([7], "a")]  # before the engine said anything
    assert _tokens(taken) == [7, 8, 9]
    assert "".join(e.text for events in taken for e in events) == "abc"
    assert not any(isinstance(m, Abort) for m in received)


def test_a_first_token_from_the_engine_first_makes_the_prefill_copy_a_no_op():
    async def script(engine, front):
        await engine.send(_delta([7], "a"))
        await asyncio.sleep(0.05)
        front.give_first(RID, _delta([7], "a"))
        await engine.send(_delta([8], "b", "length"))

    taken, _ = asyncio.run(_run(script))
    assert _tokens(taken) == [7, 8]


def test_different_first_tokens_end_the_stream_with_an_error_and_abort_it():
    async def script(engine, front):
        front.give_first(RID, _delta([7], "a"))
        await asyncio.sleep(0.05)
        await engine.send(_delta([6], "z"))

    taken, received = asyncio.run(_run(script))
    assert _tokens(taken) == [7]
    (last,) = taken[-1][-1:]
    assert isinstance(last, Failed) and "different first tokens" in last.message
    assert Abort(RID) in received  # the decode engine frees the request's blocks


def test_a_failed_hand_off_after_the_prefill_workers_token_ends_with_its_own_cause():
    async def script(engine, front):
        front.give_first(RID, _delta([7], "a"))
        await asyncio.sleep(0.05)
        failed = Delta(RID, [], "", None, "error", None, 0, "the prefill worker went away")
        await engine.send(failed)

    taken, _ = asyncio.run(_run(script))
    assert _tokens(taken) == [7]
    last = taken[-1][-1]
    assert isinstance(last, Delta) and last.error == "the prefill worker went away"
