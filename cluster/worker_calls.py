"""Calls from the ingress into the worker pools, with failures made explicit."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import RequestCancelledError

from splitserve.cluster.openai_api import invalid_request
from splitserve.workers.engine.messages import (
    Delta,
    Event,
    Failed,
    Rejected,
    merge_deltas,
)


class WorkerFailed(Exception):
    """A worker died or a hand-off failed: retried when no token was sent yet."""


async def watch_prefill(call, decode_call, failure: list[str]) -> None:
    """Cancel the decode side when the prefill side fails (its blocks are freed)."""
    try:
        last = await call
    except RequestCancelledError:
        return
    except (RayActorError, RayTaskError) as e:
        last = Failed("", f"the prefill worker failed: {e}")
    error = _error_of(last)
    if error is not None:
        failure.append(error)
        decode_call.cancel()


async def guard(call, who: str, failure: list[str] | None = None) -> AsyncIterator[Event]:
    """A worker's stream of event lists as single events, consecutive deltas merged;
    a rejection raises the ingress's 400, a worker's death or failure ``WorkerFailed``."""
    try:
        async for events in call:
            for event in _coalesced(events):
                if isinstance(event, Rejected):
                    raise invalid_request(event.message)
                if isinstance(event, Failed):
                    raise WorkerFailed(f"the {who} failed: {event.message}")
                error = _error_of(event)
                if error is not None:
                    raise WorkerFailed(error)
                yield event
    except RequestCancelledError as e:
        if failure:
            raise WorkerFailed(failure[0]) from e
        raise
    except (RayActorError, RayTaskError) as e:
        raise WorkerFailed(f"the {who} failed: {type(e).__name__}: {e}") from e


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
    if isinstance(event, Failed):
        return event.message
    if isinstance(event, Rejected):
        return event.message
    if isinstance(event, Delta):
        return event.error
    return None
