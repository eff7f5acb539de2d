"""The server's ``POST /start_profile`` and ``POST /stop_profile``: every engine's
``torch.profiler`` window opened or closed at once, as vLLM's and SGLang's endpoints do.

The ingress replica that takes the call asks each live engine of every pool over its
own connection (``EngineConnection.profile``) and answers once all have: 200 with each
engine's trace path (written on the engine's node, in ``engine.torch_profiler_dir``);
400 when that directory is not set (profiling is off); 409 when an engine refused
(a window already open, or none to close) or its connection failed, naming each.
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse

from splitserve.cluster.openai_api.errors import OpenAIError, error_body, invalid_request
from splitserve.workers.engine.engine_connection import EngineConnection

PROFILE_TIMEOUT_S = 300.0  # a long window's trace takes a while to write


async def profile_engines(
    connections: dict[str, list[EngineConnection]], profiler_dir: str | None, start: bool
) -> JSONResponse:
    """``connections``: each pool's live engines."""
    if profiler_dir is None:
        err = invalid_request(
            "profiling is off: start the server with --torch-profiler-dir DIR "
            "(engine.torch_profiler_dir in its config)",
            code="profiling_off",
        )
        return JSONResponse(error_body(err), status_code=400)
    engines = [(pool, conn) for pool, conns in connections.items() for conn in conns]
    if not engines:
        err = OpenAIError(503, "no engine is live to profile", "server_error")
        return JSONResponse(error_body(err), status_code=503)
    answers = await asyncio.gather(
        *(asyncio.wait_for(conn.profile(start), PROFILE_TIMEOUT_S) for _, conn in engines),
        return_exceptions=True,
    )
    results, refusals = [], []
    for (pool, conn), answer in zip(engines, answers):
        failed = isinstance(answer, BaseException)
        error = _failure(answer) if failed else answer.error
        trace = None if failed else answer.trace
        results.append({"pool": pool, "worker": conn.name, "error": error, "trace": trace})
        if error is not None:
            refusals.append(f"{conn.name}: {error}")
    if refusals:
        action = "start" if start else "stop"
        err = OpenAIError(409, f"could not {action} profiling on " + "; ".join(refusals))
        return JSONResponse(error_body(err) | {"engines": results}, status_code=409)
    return JSONResponse({"profiling": start, "engines": results})


def _failure(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return f"no answer in {PROFILE_TIMEOUT_S:.0f} s"
    return str(e) or type(e).__name__
