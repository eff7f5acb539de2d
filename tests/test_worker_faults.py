"""Hung and leaving engines, at the engine process boundary: real engine processes
(``EngineClient``), an ingress's ``WorkerDirectory`` over real connections, a fake board.

- A SIGSTOPped engine is skipped by ``acquire`` within its pool's stall timeout, its
  open streams end with ``Failed``, and it is chosen again once it runs; its replica's
  watchdog (``EngineClient.stalled``) reports it meanwhile.
- A draining engine is skipped, answers a late call ``Overloaded``, finishes what it
  holds; ``shutdown`` ends the requests still open with "shutting down".
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import pytest

from splitserve.cluster.routing import RouterConfig
from splitserve.cluster.serve_config import PoolConfig
from splitserve.cluster.worker_directory import WorkerDirectory
from splitserve.config import EngineConfig
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.engine_client import EngineClient
from splitserve.workers.engine.messages import Delta, Failed, GenerateCall, Overloaded

CONFIG = {
    "model": "qwen3-tiny",
    "device": "cpu",
    "cache": {"num_kv_blocks": 128},
    "scheduler": {"max_model_len": 512, "max_num_seqs": 8},
}
SECRET = "s3cret"
STALL_S = 0.5
LONG = SamplingParams(max_tokens=480, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    clients = [EngineClient(EngineConfig.from_dict(CONFIG), secret=SECRET) for _ in range(2)]
    yield clients
    for c in clients:
        os.kill(c.pid, signal.SIGCONT)
        c.shutdown()


class _Board:
    """The stats board as the directory reads it: ``await board.snapshot.remote()``."""

    def __init__(self, engines: list[EngineClient]):
        entries = {f"w{i}": ("mixed", {"address": e.address}) for i, e in enumerate(engines)}
        self.snapshot = SimpleNamespace(remote=lambda: self._snapshot(entries))

    async def _snapshot(self, entries):
        return entries


async def _directory(engines: list[EngineClient]) -> WorkerDirectory:
    pools = {"mixed": PoolConfig(stall_timeout_s=STALL_S, watchdog_timeout_s=STALL_S)}
    directory = WorkerDirectory(_Board(engines), SECRET, pools, RouterConfig())
    await directory.refresh()
    while len(directory.connections("mixed")) < len(engines) or any(
        c.stats is None for c in directory.connections("mixed")
    ):
        await asyncio.sleep(0.05)
    return directory


async def _watch(directory: WorkerDirectory) -> None:
    """What ``WorkerDirectory.run`` does besides reading the board."""
    while True:
        directory.check_stalls()
        await asyncio.sleep(0.05)


def _by_pid(directory: WorkerDirectory, pid: int):
    (conn,) = [c for c in directory.connections("mixed") if c.stats.engine_pid == pid]
    return conn


def _wait_idle(client: EngineClient) -> None:
    deadline = time.monotonic() + 10
    while client.holds_requests or client.stats.num_free_blocks != client.stats.num_blocks:
        assert time.monotonic() < deadline, client.stats
        time.sleep(0.05)


def test_a_stopped_engine_is_routed_around_and_comes_back(engines):
    stopped, live = engines

    async def run():
        directory = await _directory(engines)
        watcher = asyncio.ensure_future(_watch(directory))
        conn = _by_pid(directory, stopped.pid)
        stream = conn.generate(GenerateCall("held", [3] * 40, LONG))
        await stream.__anext__()  # running on the engine about to stop
        os.kill(stopped.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        events = [e for batch in [b async for b in stream] for e in batch]
        ended_s = time.monotonic() - t0
        chosen = [(await directory.acquire("mixed")).stats.engine_pid for _ in range(3)]
        watchdog = stopped.stalled(STALL_S)
        os.kill(stopped.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while len(directory.ranked("mixed")) < 2:
            assert time.monotonic() < deadline, "the resumed engine was not chosen again"
            await asyncio.sleep(0.05)
        watcher.cancel()
        for c in directory.connections("mixed"):
            c.close()
        return events, ended_s, chosen, watchdog

    events, ended_s, chosen, watchdog = asyncio.run(asyncio.wait_for(run(), 60))
    assert isinstance(events[-1], Failed) and "stalled" in events[-1].message, events[-1]
    assert "sent no load report" in events[-1].message
    assert STALL_S - 0.3 < ended_s < STALL_S + 1.5, ended_s  # from its last stats
    assert chosen == [live.pid] * 3
    assert watchdog is not None and "no stats" in watchdog
    assert stopped.stalled(STALL_S) is None
    _wait_idle(stopped)  # the abort sent while it was stopped freed its blocks


def test_a_draining_engine_finishes_what_it_holds_and_takes_nothing_new(engines):
    draining, live = engines

    async def run():
        directory = await _directory(engines)
        conn = _by_pid(directory, draining.pid)
        held = conn.generate(GenerateCall("held", [5] * 30, SHORT))
        first = await held.__anext__()
        draining.drain()
        while not conn.draining:
            await asyncio.sleep(0.05)
        chosen = (await directory.acquire("mixed")).stats.engine_pid
        late = [
            e async for batch in conn.generate(GenerateCall("late", [6] * 8, SHORT)) for e in batch
        ]
        rest = [e for batch in [first] + [b async for b in held] for e in batch]
        for c in directory.connections("mixed"):
            c.close()
        return chosen, late, rest

    chosen, late, rest = asyncio.run(asyncio.wait_for(run(), 60))
    assert chosen == live.pid
    assert len(late) == 1 and isinstance(late[0], Overloaded) and "shutting down" in late[0].message
    assert all(isinstance(e, Delta) for e in rest)
    assert sum(len(e.token_ids) for e in rest) == SHORT.max_tokens
    _wait_idle(draining)


def test_shutdown_ends_the_requests_still_open_with_shutting_down():
    client = EngineClient(EngineConfig.from_dict(CONFIG), secret=SECRET)

    async def run():
        directory = await _directory([client])
        (conn,) = directory.connections("mixed")
        stream = conn.generate(GenerateCall("open", [7] * 30, LONG))
        await stream.__anext__()
        await asyncio.to_thread(client.shutdown)
        events = [e for batch in [b async for b in stream] for e in batch]
        conn.close()
        return events

    events = asyncio.run(asyncio.wait_for(run(), 60))
    assert isinstance(events[-1], Failed), events[-1]
    assert events[-1].message == "the mixed worker is shutting down"
    assert client.process.returncode == 0


def test_a_stream_failed_on_the_front_side_is_aborted_on_the_engine(engines):
    """``fail`` (a hand-off failed elsewhere, a stall) ends the stream here; the engine
    must drop the request too, not keep it queued (or a decode reservation held)."""
    client = engines[1]  # the other one drains since the test before

    async def run():
        directory = await _directory(engines)
        conn = _by_pid(directory, client.pid)
        busy = [conn.generate(GenerateCall(f"busy{i}", [9] * 30, LONG)) for i in range(8)]
        for stream in busy:  # max_num_seqs of them run
            await stream.__anext__()
        queued = conn.generate(GenerateCall("queued", [9] * 30, LONG))
        first = asyncio.ensure_future(queued.__anext__())  # sent; it waits for a slot
        while client.stats.num_waiting == 0:
            await asyncio.sleep(0.01)
        conn.fail("queued", "the prefill worker failed")
        events = await first
        await queued.aclose()
        t0 = time.monotonic()
        while client.stats.num_waiting:
            await asyncio.sleep(0.01)
        dropped_s, running = time.monotonic() - t0, client.stats.num_running
        for stream in busy:
            await stream.aclose()
        for c in directory.connections("mixed"):
            c.close()
        return events, dropped_s, running

    events, dropped_s, running = asyncio.run(asyncio.wait_for(run(), 30))
    assert events == [Failed("queued", "the prefill worker failed")]
    assert dropped_s < 0.3 and running == 8, (dropped_s, running)  # gone before a slot freed
    _wait_idle(client)
