"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI plus vLLM extras).

Types are checked strictly (``"5"`` is not an integer). Value ranges that ``SamplingParams``
already checks (what the engine can represent) and the list sizes of ``RequestLimits`` are
left to it, so one message describes each range; ``to_sampling_params`` turns its
``ValueError`` into a 400 naming the field. A string anywhere in the body must be valid
Unicode (no lone UTF-16 surrogate). Fields that OpenAI clients may send but this server does
not implement (``tools``, ``response_format``, ``logit_bias``, ...) are ignored when null or
empty and rejected otherwise. ``parse_request`` turns any bad body into an ``OpenAIError``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from splitserve.cluster.openai_api.errors import invalid_request
from splitserve.config import RequestLimits
from splitserve.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 16  # the deepest a valid body nests is 4 (messages[i].content[j].text)
CHAT_ROLES = ("system", "developer", "user", "assistant")
UNSUPPORTED_FIELDS = (
    "logit_bias",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "suffix",
    "best_of",
    "service_tier",
    "store",
    "metadata",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
)
# Values of unsupported fields that ask for nothing beyond the default behaviour.
_HARMLESS: dict[str, list[Any]] = {
    "response_format": [{"type": "text"}],
    "tool_choice": ["none", "auto"],
    "best_of": [1],
    "parallel_tool_calls": [True, False],
    "store": [False],
}


def _is_harmless(name: str, value: Any) -> bool:
    return value is None or value == {} or value == [] or value in _HARMLESS.get(name, [])


# Request fields that SamplingParams takes under the same name.
_PASSED_THROUGH = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class ChatMessage(_Strict):
    role: str
    content: str | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role {role!r} is not supported; accepted: {', '.join(CHAT_ROLES)}")
        return role

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"part {i} must be {{'type': 'text', 'text': <string>}}, got {part!r:.80}; "
                    "only text parts are supported"
                )
            texts.append(part["text"])
        return "\n".join(texts)


class _RequestBase(_Strict):
    model: str | None = None  # None: the served model
    max_tokens: int | None = None  # None: up to the context length
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = True
    return_token_ids: bool | None = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        if stop is None or isinstance(stop, str):
            return stop
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return stop
        raise ValueError(f"must be a string or a list of strings, got {stop!r:.80}")

    @model_validator(mode="before")
    @classmethod
    def _drop_harmless_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            k: v for k, v in data.items() if not (k in UNSUPPORTED_FIELDS and _is_harmless(k, v))
        }

    @model_validator(mode="after")
    def _check_common(self) -> _RequestBase:
        if self.n not in (None, 1):
            raise invalid_request(
                "invalid 'n': must be 1 (this server returns one choice per request)", "n"
            )
        if self.skip_special_tokens is False:
            raise invalid_request(
                "skip_special_tokens=false is not supported: outputs always skip special tokens",
                "skip_special_tokens",
            )
        if self.stream_options is not None and not self.stream:
            raise invalid_request(
                "stream_options is only allowed with stream=true", "stream_options"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        default_max_tokens: int,
        renames: dict,
        limits: RequestLimits | None,
    ) -> SamplingParams:
        if max_tokens is None:
            if default_max_tokens < 1:
                raise invalid_request(
                    "the prompt fills the whole context: no room for a generated token",
                    renames.get("max_tokens", "max_tokens"),
                    "context_length_exceeded",
                )
            max_tokens = default_max_tokens
        fields = {
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            **{name: getattr(self, name) for name in _PASSED_THROUGH},
        }
        try:
            params = SamplingParams(**{k: v for k, v in fields.items() if v is not None})
            params.check(limits or RequestLimits())
            return params
        except ValueError as e:
            match = re.match(r"invalid (\w+)=", str(e))
            param = match and renames.get(match.group(1), match.group(1))
            raise invalid_request(str(e), param) from e


class CompletionRequest(_RequestBase):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            if len(prompt) > 1:
                count = len(prompt)
                raise ValueError(
                    f"a batch of {count} prompts is not supported: send one per request"
                )
            prompt = prompt[0]
        if prompt == [] or prompt == "":
            raise ValueError("the prompt is empty: give some text or at least one token id")
        if isinstance(prompt, str) or (isinstance(prompt, list) and _all_ints(prompt)):
            return prompt
        raise ValueError(
            "must be a string, a list of token ids, or a list holding one of those; "
            f"got {prompt!r:.80}"
        )

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise invalid_request(
                "echo=true with logprobs is not supported: prompt logprobs are not computed",
                "echo",
            )
        return self

    def to_sampling_params(
        self, default_max_tokens: int, limits: RequestLimits | None = None
    ) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, default_max_tokens, {}, limits)


class ChatCompletionRequest(_RequestBase):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("give at least one message")
        return messages

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs needs logprobs=true", "top_logprobs")
        return self

    def to_sampling_params(
        self, default_max_tokens: int, limits: RequestLimits | None = None
    ) -> SamplingParams:
        use_completion = self.max_completion_tokens is not None
        max_tokens = self.max_completion_tokens if use_completion else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        renames = {"logprobs": "top_logprobs"}
        if use_completion:
            renames["max_tokens"] = "max_completion_tokens"
        return self._sampling_params(max_tokens, logprobs, default_max_tokens, renames, limits)


REQUEST_TYPES: dict[str, type[_RequestBase]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
}


def parse_request(kind: str, body: Any) -> CompletionRequest | ChatCompletionRequest:
    """Validate a parsed JSON body; ``kind`` is "completions" or "chat".

    Raises OpenAIError (400, "invalid_request_error", param = the first bad field).
    """
    if kind not in REQUEST_TYPES:
        raise ValueError(f"unknown request kind {kind!r}; accepted: {', '.join(REQUEST_TYPES)}")
    if not isinstance(body, dict):
        raise invalid_request(f"the request body must be a JSON object, got {_json_type(body)}")
    _check_body(body)
    try:
        return REQUEST_TYPES[kind].model_validate(body)
    except ValidationError as e:
        problems = [_describe(err) for err in e.errors()]
        raise invalid_request("; ".join(text for text, _ in problems), problems[0][1]) from None


def _check_body(body: dict) -> None:
    """Reject nesting deeper than ``MAX_JSON_DEPTH`` and strings (or object keys) that are
    not valid Unicode, naming where; iterative, so no body can exhaust the stack."""
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise invalid_request(
                f"the request body nests deeper than {MAX_JSON_DEPTH} levels", _location(path[:1])
            )
        if isinstance(value, str) and not _encodes(value):
            raise invalid_request(
                f"invalid '{_location(path)}': a string holds a lone UTF-16 surrogate, "
                "which is not valid Unicode",
                _location(path),
            )
        if isinstance(value, dict):
            if not all(_encodes(key) for key in value):
                where = _location(path)
                raise invalid_request(f"invalid '{where}': a key is not valid Unicode", where)
            stack += [(item, (*path, key)) for key, item in value.items()]
        elif isinstance(value, list) and not _all_ints(value):  # token ids: nothing inside
            nested = (str, dict, list)
            stack += [(v, (*path, i)) for i, v in enumerate(value) if isinstance(v, nested)]


def _all_ints(values: list) -> bool:
    """Whether every item is an int (not a bool): a C-speed pass over a prompt's ids."""
    return set(map(type, values)) <= {int}


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe(err: dict) -> tuple[str, str | None]:
    """One pydantic error as (readable text, param)."""
    where = _location(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        if err["loc"][-1] in UNSUPPORTED_FIELDS and len(err["loc"]) == 1:
            return f"'{where}' is not supported by this server (leave it out or send null)", where
        return f"unknown field '{where}'", where
    if kind == "missing":
        return f"'{where}' is required", where
    if kind in ("value_error", "assertion_error"):
        return f"invalid '{where}': {err['ctx']['error']}", where
    got = repr(err["input"])
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"invalid '{where}': {err['msg']}, got {got}", where


def _location(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "body"


def _json_type(value: Any) -> str:
    names = {type(None): "null", bool: "a boolean", str: "a string", list: "an array"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else "a value")
