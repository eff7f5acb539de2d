"""Ranks 1..N-1 of an expert-parallel group: each an engine in a process of its own.

Rank 0 (``front.py``) starts the process with a ``RankStart`` (the engine config with
the rank's device, its membership, its KV owner) and two pipes: the step pipe and the
calls pipe (``rank_calls.py``). The rank builds its ``LLMEngine`` (its shard of the
experts, its own KV cache, scheduler and KV transport), says ``Loaded`` right before
it joins the group, ``Ready`` (with its stats) once built, then serves rank 0's
calls: each ``StepCall`` brings the requests rank 0 placed here (``RankAdd``: a
prompt, a prompt with a decode worker's KV ticket, or a remote request whose KV a
prefill worker will send here) and the aborts, and the rank runs exactly one engine
step (a dummy one when it has no work) and answers with its outputs; its stats
(``WorkerStats``) ride along when rank 0 asked for them (at its stats period), and
when the whole group runs out of work rank 0 asks once more (``ReportCall``). Rank 0
sends one call per step of its own, so the ranks step together.

What crosses the pipes (pickled; the group never leaves the host):
``Loaded`` / ``Ready`` / ``StartFailed`` once, then per step ``StepCall`` ->
``StepReply`` (or ``ReportCall`` -> ``WorkerStats``), and ``Shutdown`` at the end.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from splitserve.config import EngineConfig, env, resolve_device
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.messages import WorkerStats
from splitserve.workers.kv.transfer.ticket import TransferTicket
from splitserve.workers.output.request_output import CompletionOutput, RequestOutput
from splitserve.workers.parallel.group import GroupMember
from splitserve.workers.parallel.rank_calls import RankSide


@dataclass(frozen=True)
class RankStart:
    config: EngineConfig  # its device set to the rank's
    member: GroupMember
    delta_outputs: bool
    owner: str = ""  # the rank's KV owner (``rank_owner.py``)
    rendezvous: bool = False  # NCCL sends: ask rank 0 for the rendezvous
    # Without kv_transfer.auth_key a transport uses its process's key: rank 0's is
    # passed, so a peer that may talk to rank 0 may talk to every rank.
    kv_key: bytes | None = None


@dataclass(frozen=True)
class Loaded:
    pass


@dataclass(frozen=True)
class Ready:
    stats: WorkerStats


@dataclass(frozen=True)
class StartFailed:
    error: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class RankAdd:
    """A request rank 0 placed here."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    kv_ticket: TransferTicket | bytes | None = None  # prefill side: send the KV there
    remote: bool = False  # decode side: reserve blocks, the KV comes from a prefill worker


@dataclass
class StepCall:
    adds: list[RankAdd] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    report: bool = False  # answer with the rank's stats


@dataclass(frozen=True)
class ReportCall:
    """Between steps, when the group went idle: answer with the rank's stats."""


@dataclass
class StepReply:
    outputs: list[RequestOutput]
    has_unfinished: bool
    has_runnable: bool  # work for a step now (not only transfers under way)
    stats: WorkerStats | None  # when asked for


def rank_main(start: RankStart, conn: Connection, calls: Connection) -> None:
    """The process's entry point (``multiprocessing`` spawn)."""
    from splitserve.workers.engine.llm_engine import LLMEngine

    member = start.member
    logging.basicConfig(
        level=env("SPLITSERVE_LOG_LEVEL").upper(),
        format=f"%(asctime)s %(levelname)s ep-rank{member.rank} %(name)s: %(message)s",
    )
    member = GroupMember(member.rank, member.size, member.address, lambda: conn.send(Loaded()))
    side = RankSide(calls)
    if start.kv_key is not None:  # the bytes ``auth.key_bytes`` takes as they are
        start.config.kv_transfer.auth_key = start.kv_key
    options = {"owner": start.owner} if start.owner else {}
    if start.rendezvous:
        options["rendezvous"] = side.rendezvous
    try:
        device = resolve_device(start.config.device)
        if device.type == "cuda":  # pinned: its kernels, memory and NCCL on its own GPU
            torch.cuda.set_device(device)
        engine = LLMEngine(
            start.config, delta_outputs=start.delta_outputs, member=member, **options
        )
        if engine.kv_transport is not None:
            side.transport = engine.kv_transport
            engine.kv_transport.notify = side.wake
    except BaseException:
        conn.send(StartFailed(traceback.format_exc()))
        return
    conn.send(Ready(rank_stats(engine, 0, wait=True)))
    try:
        serve(engine, conn)
    finally:
        engine.close()


def serve(engine, conn: Connection) -> None:
    steps = 0
    while True:
        call = conn.recv()
        if isinstance(call, Shutdown):
            return
        if isinstance(call, ReportCall):  # the group is idle: counts after the last step
            conn.send(rank_stats(engine, steps, wait=True))
            continue
        outputs = [out for add in call.adds if (out := _add(engine, add)) is not None]
        for request_id in call.aborts:
            engine.abort_request(request_id)
        outputs += engine.step()
        steps += 1
        stats = rank_stats(engine, steps, wait=False) if call.report else None
        busy, runnable = engine.has_unfinished_requests(), engine.has_runnable_requests()
        conn.send(StepReply(outputs, busy, runnable, stats))


def rank_stats(engine, num_steps: int, wait: bool) -> WorkerStats:
    """The rank's load; ``wait``: for the device's expert counts (only when idle)."""
    from splitserve.workers.engine.core_process import collect_stats

    return collect_stats(engine, num_steps, wait_for_experts=wait)


def _add(engine, add: RankAdd) -> RequestOutput | None:
    """Queue a request rank 0 placed here; an output with the error if it does not fit."""
    try:
        if add.remote:
            engine.add_remote_request(add.request_id, add.prompt, add.params)
        else:
            engine.add_request(add.request_id, add.prompt, add.params, kv_ticket=add.kv_ticket)
        return None
    except InvalidRequestError as e:
        prompt = add.prompt
        return RequestOutput(
            request_id=add.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt if isinstance(prompt, list) else [],
            outputs=[CompletionOutput(0, "", [], finish_reason="error")],
            finished=True,
            error=str(e),
        )
