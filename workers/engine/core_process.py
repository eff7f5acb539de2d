"""The engine process: a worker replica's engine in a process of its own, owning the GPU.

The replica's ``EngineClient`` starts it (``python -m splitserve.workers.engine.core_process
FD``) and keeps one duplex socket of msgpack frames (``messages.py``) to it, for control:

    replica -> engine   Start (once), JoinPair (NCCL, decode side), RendezvousDone, Drain,
                        Shutdown
    engine -> replica   Ready or StartFailed (once), WorkerStats (every STATS_PERIOD_S),
                        Rendezvous (NCCL, prefill side), EngineDied (the loop raised)

Requests do not pass through the replica: fronts (ingress replicas) connect to the
engine's ``FrontListener`` and send ``GenerateCall`` / ``LateTicket`` / ``Abort``
(and ``ProfileCall``, answered ``ProfileDone``) there; each engine step sends every
front one ``StepEvents`` with its requests' events, and every front gets
``WorkerStats`` too. A front may abort (or give a ticket to) only its own requests;
when its connection closes, its requests are aborted. Beyond ``max_requests`` open
requests a call is answered ``Overloaded``.

Draining (the replica is leaving): after ``Drain`` the stats say ``draining``, so
fronts stop choosing this engine, and a call that still comes is answered
``Overloaded`` (the front tries another worker); what the engine holds runs on.
At ``Shutdown`` every request still open ends with ``Failed`` ("shutting down").

The main thread runs the engine loop; reader threads turn frames into commands and
wake it. So the engine never waits on any caller's Python, and no caller's event
loop waits on the model. When the replica's socket closes (the replica exited or
died) the process exits: it never outlives its replica.
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
from splitserve.workers.engine.front_listener import Front, FrontClosed, FrontListener, FrontOpened
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.engine.messages import (
    Abort,
    Delta,
    Event,
    Failed,
    GenerateCall,
    LateTicket,
    Overloaded,
    ProfileCall,
    ProfileDone,
    Rejected,
    Routed,
    StepEvents,
    TicketIssued,
    WorkerStats,
    is_last,
)
from splitserve.workers.engine.step_times import StepTimes
from splitserve.workers.output.request_output import RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # nothing runnable: wait this long for a command or a transfer event
STATS_PERIOD_S = 0.05  # how often the loop sends ``WorkerStats``
HEARTBEAT_PERIOD_S = 0.5  # how often a thread of its own says the process runs
RENDEZVOUS_TIMEOUT_S = 60.0


# ---- control messages of this boundary only ------------------------------------------


@messages.register
@dataclass(frozen=True)
class Start:
    config: dict  # dataclasses.asdict(EngineConfig)
    owner: str  # the replica's id, written into KV tickets
    rendezvous: bool  # prefill over NCCL: ask the replica to reach decode workers
    front_host: str  # where fronts connect
    secret: str  # what their Hello must carry
    max_requests: int | None = None  # open requests beyond this are Overloaded


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
    rank: int = 0  # the expert-parallel rank whose transport joins


@messages.register
@dataclass(frozen=True)
class Heartbeat:
    """From a thread of the engine process's own, whatever its loop does: the process
    runs, and how long the loop has been inside its current step (0: between steps).
    A loop stuck in one step (a kernel build, a long prompt, a wedged device) still
    beats; a stopped or frozen process does not."""

    in_step_s: float


@messages.register
@dataclass(frozen=True)
class Drain:
    pass


@messages.register
@dataclass(frozen=True)
class Shutdown:
    pass


# ---- the process -----------------------------------------------------------------------


class EngineCore:
    def __init__(self, conn: Connection, start: Start):
        self.replica = Front(conn, "replica")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (front, message)
        self._wakeup = threading.Event()
        self._rendezvous: dict[int, tuple[threading.Event, list]] = {}
        self._call_ids = itertools.count(1)  # next() is atomic under the GIL
        self._stopped = False
        self._draining = False
        self._max_requests = start.max_requests
        self._fronts: set[Front] = set()
        self._owners: dict[str, Front] = {}  # request id -> the front that sent it
        options = {"owner": start.owner} if start.owner else {}
        if start.rendezvous:
            options["rendezvous"] = self._ask_rendezvous
        config = EngineConfig.from_dict(start.config)
        self.engine = LLMEngine(config, delta_outputs=True, **options)
        if self.engine.kv_transport is not None:
            self.engine.kv_transport.notify = self._wakeup.set
        if self.engine.ep_front is not None:  # another rank's transport has news
            self.engine.ep_front.notify = self._wakeup.set
        self.listener = FrontListener(start.front_host, start.secret, self._on_front_message)
        self.num_steps = 0
        self.step_times = StepTimes()  # the loop's turns that ran a step
        self._step_started: float | None = None  # when the loop entered its current step
        # Fault injection (tests): hold a long prompt mid-prefill, see splitserve/config.py.
        self._prefill_step_delay_s = float(env("SPLITSERVE_PREFILL_STEP_DELAY_S"))

    def run(self) -> None:
        threading.Thread(target=self._read_replica, name="engine-control", daemon=True).start()
        threading.Thread(target=self._beat, name="engine-heartbeat", daemon=True).start()
        stats_time = 0.0
        while not self._stopped:
            turn_started = time.perf_counter()
            self._drain_commands()
            engine = self.engine
            if engine.has_unfinished_requests():  # a step also polls the transfers
                self._step(turn_started)
            if not engine.has_runnable_requests():
                self._wakeup.wait(IDLE_WAIT_S)  # a command or a transfer event wakes it
                self._wakeup.clear()
            if time.monotonic() - stats_time >= STATS_PERIOD_S:
                self._send_stats()
                stats_time = time.monotonic()
        message = f"the {self.engine.role} worker is shutting down"
        self._send_events([Failed(rid, message) for rid in list(self._owners)])
        self.listener.close()
        self.engine.close()

    def _step(self, turn_started: float) -> None:
        """One engine step and its events sent; a turn that launched a step is timed from
        ``turn_started`` (the commands read before it included) into ``step_times``."""
        engine = self.engine
        self._step_started = time.monotonic()
        last_step = engine.last_step
        events = [_event_of(output) for output in engine.step()]
        self.num_steps += 1
        self._send_events(events)
        if engine.last_step is not last_step:  # the call launched a step
            step, turn = engine.last_step, time.perf_counter() - turn_started
            counts = step.num_requests, step.num_prompt_requests, step.num_context_tokens
            self.step_times.record(*counts, turn, step.wait_seconds)
        if self._prefill_step_delay_s and _mid_prefill(engine):
            time.sleep(self._prefill_step_delay_s)  # a long step, as the replica sees it
        self._step_started = None

    def fail_open_requests(self, message: str) -> None:
        """End every open request with ``message`` (the loop died: say why to the fronts,
        and that the engine is down, so no front retries a request here)."""
        with contextlib.suppress(Exception):
            self._send_events([Failed(rid, message, True) for rid in list(self._owners)])

    def stats(self) -> WorkerStats:
        stats = collect_stats(self.engine, self.num_steps)
        stats.step_times = self.step_times.rows()
        stats.address = self.listener.address
        stats.draining = self._draining
        return stats

    # ---- events out --------------------------------------------------------------------

    def _send_events(self, events: list[Event]) -> None:
        """Each front gets one ``StepEvents`` with its requests' events, in order."""
        by_front: dict[Front, list[Event]] = {}
        for event in events:
            rid = event.request_id
            front = self._owners.pop(rid) if is_last(event) else self._owners.get(rid)
            if front is not None:  # else it was aborted: nobody waits for it
                by_front.setdefault(front, []).append(event)
        for front, front_events in by_front.items():
            front.send(StepEvents(front_events))

    def _beat(self) -> None:
        while not self._stopped:
            started = self._step_started
            in_step = time.monotonic() - started if started is not None else 0.0
            with contextlib.suppress(OSError):
                self.replica.send(Heartbeat(in_step))
            time.sleep(HEARTBEAT_PERIOD_S)

    def _send_stats(self) -> None:
        frame = messages.encode(self.stats())
        self.replica.send_frame(frame)
        for front in list(self._fronts):
            front.send_frame(frame)

    # ---- commands in -------------------------------------------------------------------

    def _on_front_message(self, front: Front, message) -> None:
        self._commands.put((front, message))
        self._wakeup.set()

    def _read_replica(self) -> None:
        """The replica's control frames; the socket closing ends the process."""
        try:
            while True:
                message = messages.decode(self.replica.conn.recv_bytes())
                if isinstance(message, RendezvousDone):
                    done, result = self._rendezvous[message.call_id]
                    result.append(message.error)
                    done.set()
                elif isinstance(message, JoinPair):  # returns at once: rank 1 in a thread
                    self.engine.join_kv_pair(message.pair_key, message.unique_id, message.rank)
                elif isinstance(message, Drain):
                    self._draining = True
                    self._wakeup.set()
                elif isinstance(message, Shutdown):
                    self._stopped = True
                    self._wakeup.set()
        except (EOFError, OSError):
            os._exit(0)  # the replica is gone: so is its engine

    def _drain_commands(self) -> None:
        while True:
            try:
                front, command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, GenerateCall):
                self._send_events(self._admit(front, command))
            elif isinstance(command, Abort):
                if self._owners.get(command.request_id) is front:  # its own requests only
                    self._abort(command.request_id)
            elif isinstance(command, LateTicket):
                if self._owners.get(command.request_id) is front:
                    outputs = self.engine.give_ticket(command.request_id, command.kv_ticket)
                    self._send_events([_event_of(o) for o in outputs])
            elif isinstance(command, ProfileCall):
                front.send(self._profile(command))
            elif isinstance(command, FrontOpened):
                self._fronts.add(front)
                front.send(self.stats())
            elif isinstance(command, FrontClosed):
                self._fronts.discard(front)
                for rid in [r for r, f in self._owners.items() if f is front]:
                    self._abort(rid)

    def _profile(self, call: ProfileCall) -> ProfileDone:
        """Open or close the profiler window here, in the loop's own thread (the thread
        that opened it must close it). Writing a trace takes seconds: the heartbeats say
        the loop is in a long step meanwhile, so the replica's watchdog waits."""
        self._step_started = time.monotonic()
        try:
            if call.start:
                self.engine.start_profile()
                return ProfileDone(call.call_id)
            return ProfileDone(call.call_id, trace=self.engine.stop_profile())
        except Exception as e:  # off, already open, not open, or the trace not written
            return ProfileDone(call.call_id, error=str(e) or type(e).__name__)
        finally:
            self._step_started = None

    def _abort(self, request_id: str) -> None:
        self._owners.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _admit(self, front: Front, call: GenerateCall) -> list[Event]:
        rid = call.request_id
        if rid in self._owners:  # the events go to the caller, the request stays its owner's
            front.send(StepEvents([Rejected(rid, f"request id {rid!r} is already in use")]))
            return []
        self._owners[rid] = front
        if self._draining:
            return [Overloaded(rid, f"the {self.engine.role} worker is shutting down")]
        if self._max_requests is not None and len(self._owners) > self._max_requests:
            limit = self._max_requests
            return [Overloaded(rid, f"the {self.engine.role} worker holds its {limit} requests")]
        return self._add(call)

    def _add(self, call: GenerateCall) -> list[Event]:
        """Events of an admitted call: a decode worker's route, and its KV ticket at once
        when blocks are free (in the same frame: the prefill worker can start without
        waiting for this loop's next step)."""
        engine, rid, ids = self.engine, call.request_id, call.prompt_token_ids
        try:
            if not call.remote:
                engine.add_request(
                    rid,
                    ids,
                    call.params,
                    kv_ticket=call.kv_ticket,
                    ticket_follows=call.ticket_follows,
                )
                return []
            cached = engine.num_cached_prefix_tokens(ids)
            ratio = call.local_prefix_ratio
            if ratio is not None and routing.keeps_prefix_hit_local(cached, len(ids), ratio):
                engine.add_request(rid, ids, call.params)
                return [Routed(rid, routing.LOCAL_PREFIX_HIT)]
            engine.add_remote_request(rid, ids, call.params)
        except InvalidRequestError as e:
            return [Rejected(rid, str(e))]
        tickets = engine.issue_tickets() if engine.ep_front is None else []  # EP: in a step
        return [Routed(rid, routing.DISAGGREGATED), *map(_event_of, tickets)]

    def _ask_rendezvous(self, ticket, pair_key: str, unique_id: bytes) -> None:
        """NCCL prefill side, on a transport thread: the replica reaches the decode worker."""
        call_id = next(self._call_ids)
        done, result = threading.Event(), []
        self._rendezvous[call_id] = (done, result)
        try:
            self.replica.send(Rendezvous(call_id, ticket.owner, pair_key, unique_id))
            if not done.wait(RENDEZVOUS_TIMEOUT_S):
                raise ConnectionError(f"no NCCL rendezvous with {ticket.owner} within 60 s")
            if result[0] is not None:
                raise ConnectionError(f"NCCL rendezvous with {ticket.owner} failed: {result[0]}")
        finally:
            self._rendezvous.pop(call_id, None)


def _mid_prefill(engine: LLMEngine) -> bool:
    """Whether a running request's prompt is partly computed."""
    return any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)


def _event_of(output: RequestOutput) -> Event:
    if output.kv_ticket is not None:
        return TicketIssued(output.request_id, output.kv_ticket)
    return Delta.of(output)


def collect_stats(
    engine: LLMEngine, num_steps: int, wait_for_experts: bool | None = None
) -> WorkerStats:
    """The engine's load; rank 0 of an expert-parallel group: the group's.
    ``wait_for_experts``: see ``LLMEngine.expert_tokens``."""
    stats = _engine_stats(engine, num_steps)
    stats.expert_tokens = engine.expert_tokens(wait_for_experts)
    return engine.ep_front.group_stats(stats) if engine.ep_front is not None else stats


def _engine_stats(engine: LLMEngine, num_steps: int) -> WorkerStats:
    sched, bm, transport = engine.scheduler, engine.block_manager, engine.kv_transport
    spec = engine.spec_stats
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
        kv_late_tickets=engine.num_late_tickets,
        kv_transfer_bytes=transport.bytes_sent if transport else 0,
        kv_transfer_seconds=transport.seconds_sending if transport else 0.0,
        num_steps=num_steps,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_acceptance_lengths=list(spec.acceptance_lengths),
        forward_counts=engine.runner.forward_rows(),
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
    core.replica.send(Ready(core.stats()))
    try:
        core.run()
    except BaseException as e:
        logger.exception("the engine loop died")
        core.fail_open_requests(f"the {core.engine.role} worker's engine failed: {e}")
        core.replica.send(EngineDied(traceback.format_exc()))
        sys.exit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]))
