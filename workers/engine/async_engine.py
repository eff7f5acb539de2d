"""The engine loop on its own thread, fed and read from asyncio.

``AsyncEngine`` is what a serving replica holds: ``generate`` queues a request
and yields its outputs as they come; leaving the iteration early (a client
disconnect, a cancelled call) aborts the request, so its KV blocks return. All
engine calls happen on the loop thread; other threads only post commands.

``generate`` yields, in order: a ``Route`` (decode workers: whether the prompt
is computed here or by a prefill worker), a ticket output (``kv_ticket`` set)
when a prefill worker must send the KV, then delta ``RequestOutput``s whose
``outputs[0]`` holds only what is new.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from splitserve.config import EngineConfig
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.request import RequestStatus
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.output.request_output import RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # nothing runnable: wait this long for a command or a transfer event
STATS_PERIOD_S = 0.05  # how often the loop refreshes ``stats``


@dataclass(frozen=True)
class Route:
    """How a decode worker serves a request: "disaggregated" or "local_<reason>"."""

    name: str


@dataclass
class WorkerStats:
    role: str
    pid: int
    num_running: int
    num_waiting: int  # prompts waiting to be scheduled
    num_waiting_for_kv: int  # remote requests with reserved blocks or waiting for them
    num_sending_kv: int  # prefill side: first token sampled, waiting for the ack
    queued_prompt_tokens: int  # prompt tokens not computed yet
    num_free_blocks: int
    num_blocks: int  # usable blocks (the null page excluded)
    kv_usage: float
    num_preemptions: int
    kv_transfers: int  # finished sends
    kv_transfer_bytes: int
    kv_transfer_seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


class AsyncEngine:
    def __init__(self, config: EngineConfig, **transport_options):
        self.engine = LLMEngine(config, delta_outputs=True, **transport_options)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None  # set if the loop thread died
        if self.engine.kv_transport is not None:
            self.engine.kv_transport.notify = self._wakeup.set
        self.stats = self._collect_stats()
        self._stats_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        remote: bool = False,
        kv_ticket: bytes | None = None,
        local_prefix_ratio: float | None = None,
    ) -> AsyncIterator[RequestOutput | Route]:
        """Queue a request and yield its outputs; see the module docstring."""
        if not self.alive:
            raise RuntimeError(f"the engine loop has stopped: {self.error}")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        add = (request_id, prompt_token_ids, params, remote, kv_ticket, local_prefix_ratio)
        self._post(("add", add))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if isinstance(item, RequestOutput) and item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine.close()

    # ---- the loop thread --------------------------------------------------------

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_commands()
                engine = self.engine
                if engine.has_unfinished_requests():  # a step also polls the transfers
                    for output in engine.step():
                        self._emit(output.request_id, output)
                if not engine.has_runnable_requests():
                    self._wait(IDLE_WAIT_S)  # a command or a transfer event wakes it
                if time.monotonic() - self._stats_time >= STATS_PERIOD_S:
                    self.stats = self._collect_stats()
                    self._stats_time = time.monotonic()
        except BaseException as e:  # the replica's health check reports it
            logger.exception("engine loop died")
            self.error = e
            for rid in list(self._streams):
                self._emit(rid, RuntimeError(f"the engine loop died: {e}"))

    def _wait(self, seconds: float) -> None:
        self._wakeup.wait(seconds)
        self._wakeup.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                self.engine.abort_request(arg)

    def _add(self, rid, token_ids, params, remote, kv_ticket, local_prefix_ratio) -> None:
        engine = self.engine
        try:
            if not remote:
                engine.add_request(rid, token_ids, params, kv_ticket=kv_ticket)
                return
            cached = engine.num_cached_prefix_tokens(token_ids)
            if local_prefix_ratio is not None and cached >= local_prefix_ratio * len(token_ids):
                engine.add_request(rid, token_ids, params)
                self._emit(rid, Route("local_prefix_hit"))
            else:
                engine.add_remote_request(rid, token_ids, params)
                self._emit(rid, Route("disaggregated"))
        except InvalidRequestError as e:
            self._emit(rid, e)

    def _emit(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return  # the caller left; its abort is queued
        loop, stream = target
        loop.call_soon_threadsafe(stream.put_nowait, item)

    def _collect_stats(self) -> WorkerStats:
        engine = self.engine
        sched, bm, transport = engine.scheduler, engine.block_manager, engine.kv_transport
        statuses = [r.status for r in sched.requests.values()]
        queued = sum(
            r.num_tokens - r.num_computed_tokens
            for r in list(sched.waiting) + sched.running
            if r.num_computed_tokens < r.num_prompt_tokens
        )
        return WorkerStats(
            role=engine.role,
            pid=os.getpid(),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_waiting_for_kv=statuses.count(RequestStatus.WAITING_FOR_KV),
            num_sending_kv=statuses.count(RequestStatus.SENDING_KV),
            queued_prompt_tokens=queued,
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_usable_blocks,
            kv_usage=bm.usage,
            num_preemptions=engine.num_preemptions,
            kv_transfers=transport.num_sent if transport else 0,
            kv_transfer_bytes=transport.bytes_sent if transport else 0,
            kv_transfer_seconds=transport.seconds_sending if transport else 0.0,
        )
