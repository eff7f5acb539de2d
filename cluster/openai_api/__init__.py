"""The OpenAI API protocol of the HTTP ingress, without HTTP: request models and their
sampling params (``protocol``), prompts (``prompts``), response and SSE chunk JSON built from
the engine's delta outputs (``responses``, ``logprobs``), and OpenAI-shaped errors (``errors``).
"""

from splitserve.cluster.openai_api.errors import (
    OpenAIError,
    as_openai_error,
    context_length_exceeded,
    error_body,
    for_client,
    invalid_request,
    model_not_found,
    overloaded,
    request_failed,
)
from splitserve.cluster.openai_api.prompts import chat_prompt, completion_prompt
from splitserve.cluster.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from splitserve.cluster.openai_api.responses import (
    SSE_DONE,
    ChatResponseBuilder,
    CompletionResponseBuilder,
    error_event,
    response_builder,
    sse_event,
    sse_stream,
)

__all__ = [
    "SSE_DONE",
    "ChatCompletionRequest",
    "ChatResponseBuilder",
    "CompletionRequest",
    "CompletionResponseBuilder",
    "OpenAIError",
    "as_openai_error",
    "chat_prompt",
    "completion_prompt",
    "context_length_exceeded",
    "error_body",
    "error_event",
    "for_client",
    "invalid_request",
    "model_not_found",
    "overloaded",
    "parse_request",
    "request_failed",
    "response_builder",
    "sse_event",
    "sse_stream",
]
