"""Errors in OpenAI's shape: an HTTP status plus ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """A request that cannot be served, with what the HTTP response should say."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        fields = f"{self.status}, {self.message!r}, type={self.type!r}, param={self.param!r}"
        return f"OpenAIError({fields})"


def error_body(err: OpenAIError) -> dict[str, Any]:
    """The JSON body of an error response (and of an error event in a stream)."""
    # Valid UTF-8 whatever the message quotes (a lone surrogate cannot be encoded).
    message = err.message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": err.type, "param": err.param, "code": err.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str, served: list[str] | None = None) -> OpenAIError:
    """404 for a ``model`` this server does not serve; ``served`` lists the ones it does."""
    message = f"the model '{model}' does not exist"
    if served:
        message += f"; this server serves: {', '.join(served)}"
    return OpenAIError(404, message, "invalid_request_error", "model", "model_not_found")


def context_length_exceeded(
    prompt_tokens: int, max_model_len: int, param: str = "prompt", status: int = 400
) -> OpenAIError:
    """The prompt leaves no room for a generated token (``status`` 413 if the caller prefers)."""
    message = (
        f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
        f"{prompt_tokens} tokens: a prompt may have at most {max_model_len - 1} tokens"
    )
    return OpenAIError(status, message, "invalid_request_error", param, "context_length_exceeded")


def overloaded(message: str = "the server is overloaded; retry later") -> OpenAIError:
    return OpenAIError(503, message, "server_error", None, "overloaded")


def request_failed(message: str | None) -> OpenAIError:
    """500 for a request the engine gave up on after accepting it."""
    return OpenAIError(500, message or "the request failed in the engine", "server_error")


def unauthorized(message: str) -> OpenAIError:
    """401: the request did not carry the server's API key."""
    return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")


# What a worker's or Ray's error text may carry that is none of the client's business.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_INTERNALS = [
    (re.compile(r"\((?:pid|ip)=[^)]*\)"), ""),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"), "<address>"),
    (re.compile(r"\[?\b[0-9a-fA-F]{0,4}(?::[0-9a-fA-F]{0,4}){2,7}\]?(?::\d+)?"), "<address>"),
    (re.compile(r"\b(?:pid|ip|node_ip|node_id|actor_id|worker_id)[=: ]+\S+", re.I), ""),
    (re.compile(r"\b[0-9a-f]{16,}\b"), "<id>"),
]
MAX_CLIENT_MESSAGE = 300


def client_message(text: str) -> str:
    """``text`` as a client may read it: its first line, without terminal colour codes,
    addresses, pids and Ray ids, at most ``MAX_CLIENT_MESSAGE`` characters."""
    text = _ANSI.sub("", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    text = lines[0] if lines else ""
    for pattern, replacement in _INTERNALS:
        text = pattern.sub(replacement, text)
    text = re.sub(r"\s{2,}", " ", text).strip(" :,")
    if len(text) > MAX_CLIENT_MESSAGE:
        text = text[: MAX_CLIENT_MESSAGE - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def for_client(err: OpenAIError, request_id: str) -> OpenAIError:
    """The error a client is told about ``request_id``. A server error (5xx) says what
    failed for this request, scrubbed by ``client_message``; its full text goes to the
    log. A client error (4xx) is about the client's own input and is kept."""
    if err.status < 500:
        return err
    logger.error("request %s failed (%d): %s", request_id, err.status, err.message)
    message = f"request {request_id} failed: {client_message(err.message) or 'internal error'}"
    return OpenAIError(err.status, message, err.type, err.param, err.code)


def as_openai_error(e: Exception) -> OpenAIError:
    """``e`` itself if it is an OpenAIError, else a 500 carrying its text (for the log;
    ``for_client`` scrubs what the client sees)."""
    if isinstance(e, OpenAIError):
        return e
    logger.error("unexpected error", exc_info=e)
    return OpenAIError(500, f"{type(e).__name__}: {e}", "server_error")
