"""A request body's bytes to what the engine takes, or an ``OpenAIError`` saying why not.

``RequestIntake.parse`` is plain CPU work (JSON, validation, the chat template,
tokenization); the ingress runs it off its event loop, so one large prompt does
not hold up every other request. Cheap checks come first: the JSON shape, the
fields, then the prompt's character count against what the context could hold,
and only then the tokenizer.
"""

from __future__ import annotations

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
        req = parse_request(kind, parse_json(body))
        if req.model is not None and req.model not in self.model_names:
            raise model_not_found(req.model, [self.model_names[0]])
        if kind == "completions":
            text, ids = completion_prompt(req, self.tokenizer, self.vocab_size, self.max_chars)
        else:
            text, ids = chat_prompt(req, self.tokenizer, self.vocab_size, self.max_chars)
        if len(ids) >= self.max_model_len:
            raise context_length_exceeded(len(ids), self.max_model_len)
        params = req.to_sampling_params(self.max_model_len - len(ids), self.limits)
        return Intake(req, text, ids, params)


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
