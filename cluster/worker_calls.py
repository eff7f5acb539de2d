"""Calls from the ingress into the worker pools, with failures made explicit."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import RequestCancelledError

from splitserve.cluster.openai_api import invalid_request
from splitserve.workers.output.request_output import RequestOutput


class WorkerFailed(Exception):
    """A worker died or a hand-off failed: retried when no token was sent yet."""


async def watch_prefill(call, decode_call, failure: list[str]) -> None:
    """Cancel the decode side when the prefill side fails (its blocks are freed)."""
    try:
        result = await call
    except RequestCancelledError:
        return
    except (RayActorError, RayTaskError) as e:
        result = {"ok": False, "error": f"the prefill worker failed: {e}"}
    if not result["ok"]:
        failure.append(result["error"])
        decode_call.cancel()


async def guard(call, who: str, failure: list[str] | None = None) -> AsyncIterator[dict]:
    """Iterate a worker's stream, turning worker deaths into WorkerFailed."""
    try:
        async for item in call:
            if "error" in item:
                raise invalid_request(item["error"])
            yield item
    except RequestCancelledError as e:
        if failure:
            raise WorkerFailed(failure[0]) from e
        raise
    except (RayActorError, RayTaskError) as e:
        raise WorkerFailed(f"the {who} failed: {type(e).__name__}: {e}") from e


def output_of(item: dict) -> RequestOutput:
    output = item["output"]
    if output.error is not None:
        raise WorkerFailed(output.error)
    return output
