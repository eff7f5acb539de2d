"""Calls from the ingress into the worker pools' engines, with failures made explicit.

A worker's stream (``EngineConnection.generate``) yields lists of events; ``guard``
turns them into single events with each run of deltas merged, and its bad ends
into exceptions: ``Rejected`` is the ingress's 400, ``Overloaded`` ``WorkerBusy``
(another worker may take it), ``Failed`` or an error delta ``WorkerFailed``
(retried when no token was sent yet).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from splitserve.cluster.openai_api import invalid_request
from splitserve.workers.engine.engine_connection import EngineConnection
from splitserve.workers.engine.messages import (
    Delta,
    Event,
    Failed,
    GenerateCall,
    Overloaded,
    Rejected,
    merge_deltas,
)


class WorkerFailed(Exception):
    """A worker died or a hand-off failed: retried when no token was sent yet."""


class WorkerBusy(Exception):
    """The worker holds its limit of requests (its load report lagged): try another."""


async def watch_prefill(
    prefill: EngineConnection,
    call: GenerateCall,
    decode: EngineConnection,
    rid: str,
    routed: asyncio.Event | None = None,
) -> str | None:
    """Run the prefill side of a disaggregated request: it ends once the decode worker
    has the KV. Its first token goes into the decode side's stream as soon as it is
    sampled, so the client has it while the KV is still moving; ``routed`` (a prompt
    sent before the decode worker's ticket): not before the decode worker has said it
    does not compute the prompt itself. If it fails, the decode side's stream ends with
    the cause (its leaving aborts the request there, so its blocks return); returns the
    error."""
    last: Event | None = None
    try:
        async for events in prefill.generate(call):
            for event in events:  # its first token, before the KV is on the decode worker
                if isinstance(event, Delta) and event.token_ids and not event.finished:
                    if routed is not None:
                        await routed.wait()
                    decode.give_first(rid, event)
            last = events[-1]
        error = _error_of(last) if last is not None else "the prefill ended without a result"
    except ConnectionError as e:  # its connection was already gone
        error = str(e)
    if error is not None:
        decode.fail(rid, f"the {prefill.name} failed: {error}")
    return error


def culprit(
    decode: EngineConnection, prefill: EngineConnection | None, prefill_task: asyncio.Future | None
) -> EngineConnection:
    """Which worker a disaggregated request's retry leaves out after its decode stream
    failed: the prefill worker when its side failed, or when the decode worker is still
    connected and stepping (it reported the hand-off's failure: the prefill worker went
    away or never delivered, and the front's connection to it may not have noticed yet);
    else the decode worker (gone, or hung)."""
    if prefill is None:
        return decode
    prefill_failed = (
        prefill_task is not None
        and prefill_task.done()
        and not prefill_task.cancelled()
        and prefill_task.result() is not None
    )
    decode_healthy = decode.alive and not decode.hung
    return prefill if prefill_failed or decode_healthy else decode


async def guard(stream: AsyncIterator[list[Event]], who: str) -> AsyncIterator[Event]:
    """A worker's stream of event lists as single events, consecutive deltas merged."""
    async for events in stream:
        for event in _coalesced(events):
            if isinstance(event, Rejected):
                raise invalid_request(event.message)
            if isinstance(event, Overloaded):
                raise WorkerBusy(f"the {who} is busy: {event.message}")
            error = _error_of(event)
            if error is not None:
                raise WorkerFailed(
                    error if isinstance(event, Failed) else f"the {who} failed: {error}"
                )
            yield event


def _coalesced(events: list[Event]) -> list[Event]:
    """``events`` with each run of deltas merged into one (they are one request's)."""
    out: list[Event] = []
    run: list[Delta] = []
    for event in events:
        if isinstance(event, Delta) and event.error is None:
            run.append(event)
            continue
        if run:
            out.append(merge_deltas(run))
            run = []
        out.append(event)
    if run:
        out.append(merge_deltas(run))
    return out


def _error_of(event: Event) -> str | None:
    if isinstance(event, Failed | Rejected | Overloaded):
        return event.message
    if isinstance(event, Delta):
        return event.error
    return None
