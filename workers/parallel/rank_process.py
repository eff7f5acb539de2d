"""Ranks 1..N-1 of an expert-parallel group: each an engine in a process of its own.

Rank 0 (``front.py``) starts the process with the engine config (its device set to
the rank's) and one end of a pipe. The rank builds its ``LLMEngine`` (its shard of
the experts, its own KV cache and scheduler), says ``Loaded`` right before it joins
the group, ``Ready`` once built, then serves rank 0's calls: each ``StepCall`` brings
the requests rank 0 placed here and the aborts, and the rank runs exactly one engine
step (a dummy one when it has no work) and answers with its outputs. Rank 0 sends
one call per step of its own, so the ranks step together.

What crosses the pipe (pickled; the group never leaves the host):
``Loaded`` / ``Ready`` / ``StartFailed`` once, then per step ``StepCall`` ->
``StepReply``, and ``Shutdown`` at the end.
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
from splitserve.workers.output.request_output import CompletionOutput, RequestOutput
from splitserve.workers.parallel.group import GroupMember, tokens_per_expert

LOAD_PERIOD_STEPS = 16  # a rank reports its experts' token counts this often (a device wait)


@dataclass(frozen=True)
class Loaded:
    pass


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class StartFailed:
    error: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass
class StepCall:
    adds: list[tuple[str, str | list[int], SamplingParams]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


@dataclass
class StepReply:
    outputs: list[RequestOutput]
    has_unfinished: bool
    tokens_per_expert: list[int] | None  # this rank's experts, now and then


def rank_main(
    config: EngineConfig, member: GroupMember, conn: Connection, delta_outputs: bool
) -> None:
    """The process's entry point (``multiprocessing`` spawn)."""
    from splitserve.workers.engine.llm_engine import LLMEngine

    logging.basicConfig(
        level=env("SPLITSERVE_LOG_LEVEL").upper(),
        format=f"%(asctime)s %(levelname)s ep-rank{member.rank} %(name)s: %(message)s",
    )
    member = GroupMember(member.rank, member.size, member.address, lambda: conn.send(Loaded()))
    try:
        device = resolve_device(config.device)
        if device.type == "cuda":  # pinned: its kernels, memory and NCCL on its own GPU
            torch.cuda.set_device(device)
        engine = LLMEngine(config, delta_outputs=delta_outputs, member=member)
    except BaseException:
        conn.send(StartFailed(traceback.format_exc()))
        return
    conn.send(Ready())
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
        outputs = [out for add in call.adds if (out := _add(engine, *add)) is not None]
        for request_id in call.aborts:
            engine.abort_request(request_id)
        outputs += engine.step()
        steps += 1
        busy = engine.has_unfinished_requests()
        report = steps % LOAD_PERIOD_STEPS == 0 or not busy
        load = tokens_per_expert(engine.runner.model) if report else None
        conn.send(StepReply(outputs, busy, load))


def _add(engine, request_id: str, prompt, params: SamplingParams) -> RequestOutput | None:
    """Queue a request rank 0 placed here; an output with the error if it does not fit."""
    try:
        engine.add_request(request_id, prompt, params)
        return None
    except InvalidRequestError as e:
        return RequestOutput(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=prompt if isinstance(prompt, list) else [],
            outputs=[CompletionOutput(0, "", [], finish_reason="error")],
            finished=True,
            error=str(e),
        )
