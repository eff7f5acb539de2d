"""Which worker a failed disaggregated request's retry leaves out (``worker_calls.culprit``).

A prefill worker that dies mid hand-off makes the decode worker end the request with
"the prefill worker went away", often before the front's own connection to the prefill
worker has noticed. Leaving the decode worker out then would leave a one-decode-worker
pool with nobody to retry on (a 503 for a healthy decode worker). Real connections to a
listening socket stand in for the engines: what ``culprit`` reads is the connection's
state (open, closed, ended as hung).
"""

from __future__ import annotations

import asyncio

from splitserve.cluster.worker_calls import culprit
from splitserve.workers.engine import messages
from splitserve.workers.engine.engine_connection import EngineConnection
from splitserve.workers.engine.messages import WorkerStats


async def _connections(frames: list = ()):
    """A decode and a prefill connection to one listener, which sends ``frames`` (stats,
    step events) to the first connection once the test sets ``send``."""
    send = asyncio.Event()
    writers = []

    async def accept(reader, writer):
        writers.append(writer)
        if len(writers) == 1:
            await send.wait()
            for frame in frames:
                writer.write(messages.framed(messages.encode(frame)))
        await reader.read()  # hold the connection open until the front closes it

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    decode = await EngineConnection.open(address, "s", "decode worker d1")
    prefill = await EngineConnection.open(address, "s", "prefill worker p1")
    return server, send, decode, prefill


async def _until(condition, timeout_s: float = 2.0) -> None:
    """Wait for ``condition`` (the listener's frames reach the connection's reader task)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)


def _finished(result) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future


def test_a_decode_worker_that_reports_the_failure_is_kept():
    async def run():
        server, _, decode, prefill = await _connections()
        pending = asyncio.get_running_loop().create_future()  # the prefill side runs on
        try:
            assert culprit(decode, prefill, pending) is prefill
            assert culprit(decode, prefill, _finished("went away")) is prefill
            assert culprit(decode, prefill, _finished(None)) is prefill
        finally:
            pending.cancel()
            for closable in (decode, prefill, server):
                closable.close()

    asyncio.run(run())


def test_a_decode_worker_gone_or_hung_is_left_out():
    async def run():
        server, _, decode, prefill = await _connections()
        try:
            assert culprit(decode, None, None) is decode  # no prefill worker yet
            decode.fail_open("the decode worker d1 stalled")  # routed around as hung
            assert culprit(decode, prefill, None) is decode
            assert culprit(decode, prefill, _finished("decode went away")) is prefill
            decode.close()  # its engine is gone
            assert not decode.alive and culprit(decode, prefill, None) is decode
        finally:
            for closable in (decode, prefill, server):
                closable.close()

    asyncio.run(run())


def test_a_hung_decode_worker_that_steps_again_is_kept_again():
    async def run():
        holding = [WorkerStats("decode", 1, num_running=1, num_steps=n) for n in (5, 6)]
        server, send, decode, prefill = await _connections(holding)
        try:
            decode.fail_open("the decode worker d1 stalled")
            assert culprit(decode, prefill, None) is decode
            send.set()  # its steps move again
            await _until(lambda: decode.stats is not None and decode.stats.num_steps == 6)
            assert not decode.hung and culprit(decode, prefill, None) is prefill
        finally:
            for closable in (decode, prefill, server):
                closable.close()

    asyncio.run(run())


def test_a_decode_worker_whose_engine_died_is_left_out():
    """The engine's loop died (an expert-parallel rank gone, say): it fails its open
    requests with ``engine_down`` before its process exits, while the connection is still
    open. The retry must leave that worker out, and no new request may go there."""

    async def run():
        step = messages.StepEvents([messages.Failed("r1", "the decode worker's engine failed")])
        down = messages.StepEvents(
            [messages.Failed("r2", "the decode worker's engine failed: rank 1 is gone", True)]
        )
        server, send, decode, prefill = await _connections([step, down])
        try:
            send.set()
            await _until(lambda: not decode.alive)
            assert not decode.alive
            assert decode.error == "the decode worker's engine failed: rank 1 is gone"
            assert culprit(decode, prefill, None) is decode
        finally:
            for closable in (decode, prefill, server):
                closable.close()

    asyncio.run(run())


def test_a_plain_failed_event_keeps_the_worker():
    async def run():
        failed = messages.StepEvents([messages.Failed("r1", "the prefill worker went away")])
        stats = WorkerStats("decode", 1, num_steps=3)
        server, send, decode, prefill = await _connections([failed, stats])
        try:
            send.set()
            await _until(lambda: decode.stats is not None)
            assert decode.stats is not None and decode.alive
            assert culprit(decode, prefill, None) is prefill
        finally:
            for closable in (decode, prefill, server):
                closable.close()

    asyncio.run(run())
