"""The engine process: a worker replica's engine in a process of its own, owning the GPU.

The replica's ``EngineClient`` starts it (``python -m splitserve.workers.engine.core_process
FD``) and the two talk over one duplex socket of msgpack frames (``messages.py``):

    replica -> engine   GenerateCall, Abort, JoinPair (NCCL, decode side), RendezvousDone,
                        Shutdown
    engine -> replica   Ready or StartFailed (once), StepEvents (one per step),
                        WorkerStats (every STATS_PERIOD_S), Rendezvous (NCCL, prefill side),
                        EngineDied (the loop raised; the process exits)

The main thread runs the engine loop; a reader thread turns frames into commands
and wakes it. So the engine never waits on the replica's Python, and the replica's
event loop never waits on the model. When the socket closes (the replica exited
or died) the process exits: it never outlives its replica.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from splitserve.cluster import routing
from splitserve.config import EngineConfig, env
from splitserve.errors import InvalidRequestError
from splitserve.scheduler.request import RequestStatus
from splitserve.workers.engine import messages
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.engine.messages import (
    Abort,
    Delta,
    Event,
    GenerateCall,
    Rejected,
    Routed,
    StepEvents,
    TicketIssued,
    WorkerStats,
)
from splitserve.workers.output.request_output import RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # nothing runnable: wait this long for a command or a transfer event
STATS_PERIOD_S = 0.05  # how often the loop sends ``WorkerStats``
RENDEZVOUS_TIMEOUT_S = 60.0


# ---- control messages of this boundary only ------------------------------------------


@messages.register
@dataclass(frozen=True)
class Start:
    config: dict  # dataclasses.asdict(EngineConfig)
    owner: str  # the replica's id, written into KV tickets
    rendezvous: bool  # prefill over NCCL: ask the replica to reach decode workers


@messages.register
@dataclass(frozen=True)
class Ready:
    stats: WorkerStats


@messages.register
@dataclass(frozen=True)
class StartFailed:
    error: str  # the cause, with its traceback


@messages.register
@dataclass(frozen=True)
class EngineDied:
    error: str  # the loop's exception, with its traceback


@messages.register
@dataclass(frozen=True)
class Rendezvous:
    call_id: int
    owner: str  # the decode replica to reach
    pair_key: str
    unique_id: bytes


@messages.register
@dataclass(frozen=True)
class RendezvousDone:
    call_id: int
    error: str | None = None


@messages.register
@dataclass(frozen=True)
class JoinPair:
    pair_key: str
    unique_id: bytes


@messages.register
@dataclass(frozen=True)
class Shutdown:
    pass


# ---- the process -----------------------------------------------------------------------


class EngineCore:
    def __init__(self, conn: Connection, start: Start):
        self.conn = conn
        self._send_lock = threading.Lock()  # the loop and transport threads both send
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._rendezvous: dict[int, tuple[threading.Event, list]] = {}
        self._call_ids = itertools.count(1)  # next() is atomic under the GIL
        self._stopped = False
        options = {"owner": start.owner} if start.owner else {}
        if start.rendezvous:
            options["rendezvous"] = self._ask_rendezvous
        config = EngineConfig.from_dict(start.config)
        self.engine = LLMEngine(config, delta_outputs=True, **options)
        if self.engine.kv_transport is not None:
            self.engine.kv_transport.notify = self._wakeup.set
        self.num_steps = 0

    def send(self, message) -> None:
        frame = messages.encode(message)
        with self._send_lock:
            self.conn.send_bytes(frame)

    def run(self) -> None:
        threading.Thread(target=self._read, name="engine-commands", daemon=True).start()
        stats_time = 0.0
        while not self._stopped:
            self._drain_commands()
            engine = self.engine
            if engine.has_unfinished_requests():  # a step also polls the transfers
                events = [_event_of(output) for output in engine.step()]
                self.num_steps += 1
                if events:
                    self.send(StepEvents(events))
            if not engine.has_runnable_requests():
                self._wakeup.wait(IDLE_WAIT_S)  # a command or a transfer event wakes it
                self._wakeup.clear()
            if time.monotonic() - stats_time >= STATS_PERIOD_S:
                self.send(collect_stats(engine, self.num_steps))
                stats_time = time.monotonic()
        self.engine.close()

    # ---- commands --------------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: frames in, commands queued; the socket closing ends it all."""
        try:
            while True:
                message = messages.decode(self.conn.recv_bytes())
                if isinstance(message, RendezvousDone):
                    done, result = self._rendezvous[message.call_id]
                    result.append(message.error)
                    done.set()
                elif isinstance(message, JoinPair):  # returns at once: rank 1 in a thread
                    self.engine.kv_transport.join(message.pair_key, message.unique_id)
                else:
                    self._commands.put(message)
                    self._wakeup.set()
        except (EOFError, OSError):
            os._exit(0)  # the replica is gone: so is its engine

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, GenerateCall):
                event = self._add(command)
                if event is not None:
                    self.send(StepEvents([event]))
            elif isinstance(command, Abort):
                self.engine.abort_request(command.request_id)
            elif isinstance(command, Shutdown):
                self._stopped = True

    def _add(self, call: GenerateCall) -> Event | None:
        engine, rid, ids = self.engine, call.request_id, call.prompt_token_ids
        try:
            if not call.remote:
                engine.add_request(rid, ids, call.params, kv_ticket=call.kv_ticket)
                return None
            cached = engine.num_cached_prefix_tokens(ids)
            ratio = call.local_prefix_ratio
            if ratio is not None and routing.keeps_prefix_hit_local(cached, len(ids), ratio):
                engine.add_request(rid, ids, call.params)
                return Routed(rid, routing.LOCAL_PREFIX_HIT)
            engine.add_remote_request(rid, ids, call.params)
            return Routed(rid, routing.DISAGGREGATED)
        except InvalidRequestError as e:
            return Rejected(rid, str(e))

    def _ask_rendezvous(self, ticket, pair_key: str, unique_id: bytes) -> None:
        """NCCL prefill side, on a transport thread: the replica reaches the decode worker."""
        call_id = next(self._call_ids)
        done, result = threading.Event(), []
        self._rendezvous[call_id] = (done, result)
        try:
            self.send(Rendezvous(call_id, ticket.owner, pair_key, unique_id))
            if not done.wait(RENDEZVOUS_TIMEOUT_S):
                raise ConnectionError(f"no NCCL rendezvous with {ticket.owner} within 60 s")
            if result[0] is not None:
                raise ConnectionError(f"NCCL rendezvous with {ticket.owner} failed: {result[0]}")
        finally:
            self._rendezvous.pop(call_id, None)


def _event_of(output: RequestOutput) -> Event:
    if output.kv_ticket is not None:
        return TicketIssued(output.request_id, output.kv_ticket)
    return Delta.of(output)


def collect_stats(engine: LLMEngine, num_steps: int) -> WorkerStats:
    sched, bm, transport = engine.scheduler, engine.block_manager, engine.kv_transport
    statuses = [r.status for r in sched.requests.values()]
    queued = sum(
        r.num_tokens - r.num_computed_tokens
        for r in list(sched.waiting) + sched.running
        if r.num_computed_tokens < r.num_prompt_tokens
    )
    return WorkerStats(
        role=engine.role,
        engine_pid=os.getpid(),
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
        num_steps=num_steps,
    )


def main(fd: int) -> None:
    conn = Connection(socket.socket(fileno=fd).detach())
    start = messages.decode(conn.recv_bytes())
    logging.basicConfig(
        level=env("SPLITSERVE_LOG_LEVEL").upper(),
        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s",
    )
    try:
        core = EngineCore(conn, start)
    except BaseException:  # the replica raises it, so the cause reaches the user
        conn.send_bytes(messages.encode(StartFailed(traceback.format_exc())))
        sys.exit(1)
    core.send(Ready(collect_stats(core.engine, 0)))
    try:
        core.run()
    except BaseException:
        logger.exception("the engine loop died")
        with contextlib.suppress(OSError):
            core.send(EngineDied(traceback.format_exc()))
        sys.exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
