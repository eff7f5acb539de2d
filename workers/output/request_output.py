"""What the engine hands back to callers, one RequestOutput per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[Any] | None = None  # TokenLogprobs per generated token, when asked for


@dataclass
class FirstTokenTimes:
    """Where a request's time to first token went inside the engine that sampled it
    (seconds, that process's clock): waiting to be scheduled, then from its prompt's
    first step to the token on the host (the prefill, chunks and other requests' steps
    in between included). A caller's TTFT less both is the serving path's share."""

    queued_s: float
    prefill_s: float


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    new_text: str = ""  # text added by this step (for streaming)
    new_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # set when the request was rejected or its KV hand-off failed
    kv_ticket: bytes | None = None  # decode side: where a prefill worker sends the KV
    num_draft_tokens: int = 0  # MTP drafts verified for the request so far
    num_accepted_tokens: int = 0  # of those, accepted
    first_token_times: FirstTokenTimes | None = None  # on the output with the first token
