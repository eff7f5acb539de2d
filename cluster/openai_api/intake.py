"""A request body's bytes to what the engine takes, or an ``OpenAIError`` saying why not.

``RequestIntake.parse`` is plain CPU work in two parts: ``read`` (JSON, the
fields, the model name) and ``accept`` (the chat template, tokenization, the
context). ``parse_async`` (the ingress's) runs a part in a thread when it is long
(a body over ``INLINE_READ_BYTES``, more than ``INLINE_TOKENIZE_CHARS`` of text to
tokenize), so one large prompt does not hold up every stream on the event loop,
and on the loop otherwise, where it costs less than the hand-off to a thread
(0.3-0.6 ms). Cheap checks come first: the JSON shape, the
fields, then the prompt's character count against what the context could hold,
and only then the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from splitserve.cluster.openai_api.errors import (
    context_length_exceeded,
    invalid_request,
    model_not_found,
)
from splitserve.cluster.openai_api.prompts import chat_prompt, completion_prompt, max_prompt_chars
from splitserve.cluster.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from splitserve.config import RequestLimits
from splitserve.sampling_params import SamplingParams

# Parsed on the event loop: bodies up to this (a 2048-token prompt's ids are about 13 KB,
# read and checked in 0.2 ms), and tokenizing up to this much text (about 0.4 ms).
INLINE_READ_BYTES = 32 * 1024
INLINE_TOKENIZE_CHARS = 1024


@dataclass
class Intake:
    """One accepted request: the validated body, the prompt and the sampling params."""

    request: CompletionRequest | ChatCompletionRequest
    prompt_text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestIntake:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        model_names: tuple[str, ...],
        limits: RequestLimits,
    ):
        """``model_names``: what a request's ``model`` may say (the first is the served name)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_names = model_names
        self.limits = limits
        self.max_chars = max_prompt_chars(tokenizer, max_model_len)

    def parse(self, kind: str, body: bytes) -> Intake:
        """``kind`` is "completions" or "chat"; raises OpenAIError (400, 404)."""
        return self.accept(kind, self.read(kind, body))

    async def parse_async(self, kind: str, body: bytes) -> Intake:
        """``parse``, each part in a thread only when it is long."""
        if len(body) > INLINE_READ_BYTES:
            return await asyncio.to_thread(self.parse, kind, body)
        req = self.read(kind, body)
        if text_to_tokenize(req) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.accept, kind, req)
        return self.accept(kind, req)

    def read(self, kind: str, body: bytes) -> CompletionRequest | ChatCompletionRequest:
        """The body as the endpoint's request (JSON, fields, model name), not yet tokenized."""
        req = parse_request(kind, parse_json(body))
        if req.model is not None and req.model not in self.model_names:
            raise model_not_found(req.model, [self.model_names[0]])
        return req

    def accept(self, kind: str, req: CompletionRequest | ChatCompletionRequest) -> Intake:
        """The prompt tokenized and checked against the context, and the sampling params."""
        if kind == "completions":
            text, ids = completion_prompt(req, self.tokenizer, self.vocab_size, self.max_chars)
        else:
            text, ids = chat_prompt(req, self.tokenizer, self.vocab_size, self.max_chars)
        if len(ids) >= self.max_model_len:
            raise context_length_exceeded(len(ids), self.max_model_len)
        params = req.to_sampling_params(self.max_model_len - len(ids), self.limits)
        return Intake(req, text, ids, params)


def text_to_tokenize(req: CompletionRequest | ChatCompletionRequest) -> int:
    """The characters of text the prompt's tokenization reads (0 for token ids)."""
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.content or "") for m in req.messages)
    return len(req.prompt) if isinstance(req.prompt, str) else 0


def parse_json(body: bytes):
    """The body as JSON (strict: no NaN or Infinity); 400 for anything Python's parser
    refuses, integers longer than it converts and nesting deeper than it recurses too."""
    try:
        return json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise invalid_request("the request body nests too deeply to parse") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits
        message = str(e)
        if "integer string conversion" in message:
            message = "a number has more digits than this server reads"
        message = message if len(message) <= 200 else message[:197] + "..."
        raise invalid_request(f"the request body is not valid JSON: {message}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")
