"""Errors in OpenAI's shape: an HTTP status plus ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any


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
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


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
