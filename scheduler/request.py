"""Request state as the scheduler and the engine loop see it.

Lifecycle::

    WAITING --schedule--> RUNNING --finish--> FINISHED_{STOPPED,LENGTH,ABORTED,ERROR}
       ^                     |
       +----- PREEMPTED <----+   (KV freed; recomputed from all tokens when rescheduled)

Disaggregated (the KV of the prompt moves from a prefill to a decode worker)::

    prefill worker: WAITING -> RUNNING -> SENDING_KV (first token sampled, blocks held
                    until the decode worker acks) -> FINISHED_TRANSFERRED
                    (``ticket_follows``: computed before its ticket came; it waits in
                    SENDING_KV for the ticket too, then its KV goes out at once)
    decode worker:  WAITING_FOR_KV (blocks reserved, ticket issued) -> RUNNING (KV and
                    first token arrived) -> FINISHED_*

``num_computed_tokens`` counts tokens whose KV is in the cache. A step computes
tokens ``num_computed_tokens .. num_tokens - 1`` (or a chunk of them); when a
step reaches ``num_tokens`` the request samples its next token.

Speculative decoding (MTP): ``spec_token_ids`` are the drafts proposed for the
request's next tokens. A verify step computes the last known token and the
drafts; ``num_tokens_with_spec`` counts them, so ``will_sample`` waits for them
too. Once verified, the accepted run joins ``output_token_ids`` and the KV of
the rejected positions is rolled back (``num_computed_tokens`` drops past them).

With async scheduling a sampled token may still be on the device while the
next step is scheduled: it counts in ``num_tokens`` as a pending token, reads
as ``PLACEHOLDER`` in ``token_ids_between`` (the model runner feeds the real id
on the device) and joins ``output_token_ids`` once the host has it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from splitserve.sampling_params import SamplingParams

PLACEHOLDER = -1  # the id of a sampled token the host has not read back yet


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_KV = "waiting_for_kv"
    SENDING_KV = "sending_kv"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a KV hand-off failed
    FINISHED_TRANSFERRED = "transferred"  # prefill side: the decode worker has the KV

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error", "transferred")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # its prompt's first step (time.monotonic)
    first_token_time: float | None = None  # its first token on the host
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # known on the host
    num_pending_tokens: int = 0  # sampled on the device, not read back yet (at most 1)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts the next step verifies
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0  # of those, accepted
    stop_reason: int | str | None = None
    kv_ticket: Any = None  # prefill side: the TransferTicket the prompt's KV goes to
    ticket_follows: bool = False  # prefill side: computed before its ticket came (not yet)
    error: str | None = None  # why a FINISHED_ERROR request failed
    # Filled by the output processor: detokenizer state, text, logprobs.
    output: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, pending ones included."""
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        """Known and pending tokens, then the drafts the next step verifies."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a decode reads one);
        pending tokens read as ``PLACEHOLDER``."""
        n = len(self.prompt_token_ids)
        if start >= n:
            ids = self.output_token_ids[start - n : end - n]
        else:
            ids = self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - n)]
        missing = min(end, self.num_tokens) - max(start, n + len(self.output_token_ids))
        if missing > 0:
            ids = ids + [PLACEHOLDER] * missing
        if end > self.num_tokens and self.spec_token_ids:  # drafts follow the known tokens
            first = max(start, self.num_tokens) - self.num_tokens
            ids = ids + self.spec_token_ids[first : end - self.num_tokens]
        return ids

    @property
    def sends_kv(self) -> bool:
        """Prefill side: the prompt's KV goes to a decode worker (its ticket is here, or
        follows)."""
        return self.kv_ticket is not None or self.ticket_follows

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
