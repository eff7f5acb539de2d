"""Response JSON for /v1/completions and /v1/chat/completions, built from the engine's deltas.

The engine streams delta ``RequestOutput``s: ``outputs[0]`` holds only what is new in the step
(text, token ids, ``TokenLogprobs``); the last one carries ``finish_reason``. A builder is made
per request and fed every delta, either

- ``add(out)`` for each, then ``response()``: the whole (non-streaming) response; or
- ``chunks(out)`` for each, giving the SSE chunk dicts to send, then ``usage_chunk()`` (None
  unless ``stream_options.include_usage``), each sent with ``sse_event``, then ``SSE_DONE``.

Both raise ``OpenAIError`` (500) for an output with ``error`` set; mid-stream, send
``error_event(err)`` then ``SSE_DONE``. ``sse_stream`` does all of this for an async iterator
(any error in it reaches the client as ``errors.for_client`` words it).

Finish reasons pass through: "stop" and "length" are OpenAI's; "abort" is kept as is.
vLLM's ``return_token_ids`` adds ``prompt_token_ids`` (top level; streaming: in the first
chunk's choice) and per-choice ``token_ids`` (streaming: the chunk's new ids).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from splitserve.cluster.openai_api.errors import (
    OpenAIError,
    as_openai_error,
    error_body,
    for_client,
    request_failed,
)
from splitserve.cluster.openai_api.logprobs import ChatLogprobs, CompletionLogprobs, TokenTexts
from splitserve.cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.workers.output.request_output import CompletionOutput, RequestOutput
from splitserve.workers.sampling.sampler import TokenLogprobs

SSE_DONE = "data: [DONE]\n\n"
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # one for every event


def sse_event(obj: dict[str, Any]) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


def error_event(err: OpenAIError) -> str:
    """The event that ends a stream whose request failed (then send SSE_DONE)."""
    return sse_event(error_body(err))


class _ResponseBuilder:
    id_prefix: str
    response_object: str
    chunk_object: str

    def __init__(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        tokenizer,
        prompt_token_ids: list[int],
        model: str,
        *,
        request_id: str | None = None,
        created: int | None = None,
    ) -> None:
        self.request = request
        self.model = model
        self.id = request_id or f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time()) if created is None else created
        self.prompt_token_ids = list(prompt_token_ids)
        self.texts = TokenTexts(tokenizer)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprob_steps: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self._stream_logprobs = self._logprobs_formatter()
        self._started = False  # a stream's first chunk is out

    # --- folding deltas

    def add(self, output: RequestOutput) -> CompletionOutput:
        """Fold one delta in; return its (delta) completion. Raises OpenAIError on failure."""
        delta = output.outputs[0]
        if output.error is not None or delta.finish_reason == "error":
            raise request_failed(output.error)
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprob_steps += [s for s in delta.logprobs or [] if s is not None]
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        return delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def usage(self, cached_tokens: int | None = None) -> dict[str, Any]:
        """``cached_tokens`` defaults to the most the engine reported."""
        cached = self.num_cached_tokens if cached_tokens is None else cached_tokens
        prompt, completion = len(self.prompt_token_ids), len(self.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # --- non-streaming

    def response(self, cached_tokens: int | None = None) -> dict[str, Any]:
        choice = {"index": 0, **self._choice_body()}
        choice["logprobs"] = self._logprobs(self._logprobs_formatter(), self.logprob_steps)
        choice["finish_reason"] = self.finish_reason
        choice["stop_reason"] = self.stop_reason
        out = {**self._header(self.response_object), "choices": [choice]}
        if self.request.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        out["usage"] = self.usage(cached_tokens)
        return out

    # --- streaming

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        """Fold one delta in and return the chunks to send for it (possibly none)."""
        raise NotImplementedError

    def usage_chunk(self, cached_tokens: int | None = None) -> dict[str, Any] | None:
        """The last chunk (empty choices, usage) when the request asked for it, else None."""
        if not self.request.include_usage:
            return None
        return {
            **self._header(self.chunk_object),
            "choices": [],
            "usage": self.usage(cached_tokens),
        }

    def _chunk(self, body: dict[str, Any], delta: CompletionOutput | None) -> dict[str, Any]:
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": None}
        if delta is not None:
            choice["logprobs"] = self._logprobs(self._stream_logprobs, delta.logprobs or [])
            choice["finish_reason"] = delta.finish_reason
            choice["stop_reason"] = delta.stop_reason
            if self.request.return_token_ids:
                choice["token_ids"] = list(delta.token_ids)
        if self.request.return_token_ids and not self._started:
            choice["prompt_token_ids"] = list(self.prompt_token_ids)
        self._started = True
        return {**self._header(self.chunk_object), "choices": [choice]}

    def _worth_sending(self, delta: CompletionOutput) -> bool:
        """Skip steps that add nothing visible (a held-back partial character)."""
        extras = self.request.return_token_ids or self._stream_logprobs is not None
        return bool(delta.text or delta.finish_reason or (delta.token_ids and extras))

    # --- pieces

    def _header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, formatter, steps: list[TokenLogprobs | None]) -> dict[str, Any] | None:
        if formatter is None:
            return None
        return formatter.format([s for s in steps if s is not None])

    def _logprobs_formatter(self):
        raise NotImplementedError

    def _choice_body(self) -> dict[str, Any]:
        raise NotImplementedError


class CompletionResponseBuilder(_ResponseBuilder):
    """For /v1/completions. With ``echo``, the text starts with the prompt: ``prompt_text``,
    or the prompt ids decoded when the prompt was token ids."""

    id_prefix = "cmpl"
    response_object = "text_completion"
    chunk_object = "text_completion"

    def __init__(
        self,
        request: CompletionRequest,
        tokenizer,
        prompt_token_ids: list[int],
        model: str,
        *,
        prompt_text: str | None = None,
        request_id: str | None = None,
        created: int | None = None,
    ) -> None:
        super().__init__(
            request, tokenizer, prompt_token_ids, model, request_id=request_id, created=created
        )
        self.echo_text = ""
        if request.echo:
            self.echo_text = prompt_text
            if prompt_text is None:
                self.echo_text = tokenizer.decode(prompt_token_ids, skip_special_tokens=True)

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        delta = self.add(output)
        if not self._worth_sending(delta):
            return []
        text = delta.text if self._started else self.echo_text + delta.text
        return [self._chunk({"text": text}, delta)]

    def _choice_body(self) -> dict[str, Any]:
        return {"text": self.echo_text + self.text}

    def _logprobs_formatter(self) -> CompletionLogprobs | None:
        if self.request.logprobs is None:
            return None
        return CompletionLogprobs(self.texts)


class ChatResponseBuilder(_ResponseBuilder):
    """For /v1/chat/completions; a stream opens with a chunk carrying the assistant role."""

    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        delta = self.add(output)
        out = []
        if not self._started:
            out.append(self._chunk({"delta": {"role": "assistant", "content": ""}}, None))
        if self._worth_sending(delta):
            body = {"delta": {"content": delta.text} if delta.text else {}}
            out.append(self._chunk(body, delta))
        return out

    def _choice_body(self) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": self.text}}

    def _logprobs_formatter(self) -> ChatLogprobs | None:
        return ChatLogprobs(self.texts) if self.request.logprobs else None


def response_builder(
    request: CompletionRequest | ChatCompletionRequest,
    tokenizer,
    prompt_token_ids: list[int],
    model: str,
    *,
    prompt_text: str | None = None,
    request_id: str | None = None,
    created: int | None = None,
) -> CompletionResponseBuilder | ChatResponseBuilder:
    """The builder for the request's endpoint (``prompt_text`` matters only for echo)."""
    if isinstance(request, ChatCompletionRequest):
        return ChatResponseBuilder(
            request, tokenizer, prompt_token_ids, model, request_id=request_id, created=created
        )
    return CompletionResponseBuilder(
        request,
        tokenizer,
        prompt_token_ids,
        model,
        prompt_text=prompt_text,
        request_id=request_id,
        created=created,
    )


async def sse_stream(
    builder: CompletionResponseBuilder | ChatResponseBuilder,
    outputs: AsyncIterable[RequestOutput],
    cached_tokens: int | None = None,
) -> AsyncIterator[str]:
    """The SSE events of one streamed request, ending with ``data: [DONE]``."""
    try:
        async for output in outputs:
            for chunk in builder.chunks(output):
                yield sse_event(chunk)
        usage = builder.usage_chunk(cached_tokens)
        if usage is not None:
            yield sse_event(usage)
    except Exception as e:  # the stream has started: the error goes in it
        yield error_event(for_client(as_openai_error(e), builder.id))
    yield SSE_DONE
