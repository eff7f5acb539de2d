"""The HTTP front's guards, one ASGI layer around the ingress's FastAPI app.

In order, for every HTTP request:

1. CORS (Starlette's ``CORSMiddleware``), only when ``http.cors_origins`` is set;
   a browser's preflight is answered here, before any key is asked for.
2. The API key: ``Authorization: Bearer <key>`` as OpenAI's clients send it;
   401 when it is missing or wrong (``/health`` and ``/metrics`` are open unless
   ``http.auth_health_and_metrics``).
3. A POST body must be ``application/json`` (415; the profiler's two endpoints
   take none) and at most ``http.max_body_bytes`` (413, from ``Content-Length``
   before reading, or while reading a chunked body). The body is read here and
   handed on whole.
4. ``routes`` (the completions endpoints) go straight to their ASGI handler, not
   through the app's router, dependencies and middleware (on the 2-core CPU box
   about 0.25 ms a request, and three wrappers around every streamed chunk's
   send); the app still declares them, for ``/openapi.json``.
5. Anything the app raises before its response started becomes a 500 in
   OpenAI's error shape, with no detail (the detail goes to the log).

Every refusal is OpenAI's error JSON.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from splitserve.cluster.openai_api.errors import (
    OpenAIError,
    error_body,
    invalid_request,
    unauthorized,
)
from splitserve.cluster.serve_config import HttpConfig

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # without the key unless auth_health_and_metrics
BODYLESS_POSTS = ("/start_profile", "/stop_profile")  # take no body: any Content-Type


class HttpGuard:
    """``app`` behind the guards of ``config`` (an ASGI app itself)."""

    def __init__(
        self, app: Any, config: HttpConfig, routes: dict[tuple[str, str], Any] | None = None
    ):
        """``routes``: ``(method, path)`` -> an ASGI app that serves it instead of ``app``."""
        self.app = app
        self.config = config
        self.routes = routes or {}
        if hasattr(app, "add_exception_handler"):  # Starlette answers 500 itself, in plain text
            app.add_exception_handler(Exception, _internal_error)
        self._entry: Any = self._guarded
        if config.cors_origins:
            self._entry = CORSMiddleware(
                self._guarded,
                allow_origins=config.cors_origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )

    def add_exception_handler(self, *args, **kwargs) -> None:
        """Ray Serve registers its back-pressure handler on the app it is given."""
        self.app.add_exception_handler(*args, **kwargs)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        await self._entry(scope, receive, send)

    async def _guarded(self, scope, receive, send) -> None:
        headers = _headers(scope)
        try:
            self._check(scope, headers)
            body = await _read_body(receive, headers, self.config.max_body_bytes)
        except OpenAIError as err:
            await _send_error(send, err)
            return
        started = False

        async def replay():
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()  # the client's disconnect, for a stream

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        app = self.routes.get((scope.get("method"), scope.get("path")), self.app)
        try:
            await app(scope, replay, tracked)
        except Exception:
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await _send_error(send, OpenAIError(500, "internal error", "server_error"))

    def _check(self, scope, headers: dict[str, str]) -> None:
        key = self.config.api_key
        path = scope.get("path", "")
        if key is not None and (self.config.auth_health_and_metrics or path not in OPEN_PATHS):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise unauthorized(
                    "this server needs an API key: send 'Authorization: Bearer <key>'"
                )
            if not hmac.compare_digest(token.strip().encode(), key.encode()):
                raise unauthorized("the API key is not valid")
        if scope.get("method") == "POST" and path not in BODYLESS_POSTS:
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                shown = media or "none"
                raise OpenAIError(
                    415,
                    f"the request body must be application/json, got Content-Type {shown!r:.80}",
                    "invalid_request_error",
                    None,
                    "unsupported_media_type",
                )


async def _read_body(receive, headers: dict[str, str], limit: int) -> bytes:
    """The whole body; 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise invalid_request(f"invalid Content-Length {declared!r:.40}")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _internal_error(request, exc: Exception) -> JSONResponse:
    err = OpenAIError(500, "internal error", "server_error")
    return JSONResponse(error_body(err), status_code=500)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body has more than {limit} bytes ({size} so far), the most this server "
        "accepts (http.max_body_bytes)",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def _send_error(send, err: OpenAIError) -> None:
    body = json.dumps(error_body(err)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
