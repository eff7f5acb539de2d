"""Turn sampled tokens into text and decide when a request stops.

Stop order per new token: EOS (unless ``ignore_eos``) and ``stop_token_ids``
(both only after ``min_tokens``), then stop strings in the detokenized text
(removed from the output unless ``include_stop_str_in_output``), then
``max_tokens`` and the context length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from splitserve.scheduler.request import Request, RequestStatus
from splitserve.workers.output.detokenizer import IncrementalDetokenizer
from splitserve.workers.output.request_output import (
    CompletionOutput,
    FirstTokenTimes,
    RequestOutput,
)
from splitserve.workers.output.stop_checker import find_stop_string
from splitserve.workers.sampling.sampler import TokenLogprobs


@dataclass
class RequestState:
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    sent_text_len: int = 0
    sent_token_len: int = 0
    num_tokens: int = 0  # output tokens recorded by ``append``


class OutputProcessor:
    def __init__(
        self, tokenizer, max_model_len: int, delta: bool = False, stream_interval: int = 1
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.delta = delta  # outputs carry only what is new (see make_output)
        self.stream_interval = stream_interval  # delta outputs: tokens a stream's output holds

    def start(self, request: Request, prompt: str | None) -> None:
        request.output = RequestState(
            prompt=prompt,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            logprobs=[] if request.sampling_params.logprobs is not None else None,
        )

    def append(
        self, request: Request, token_id: int, logprobs: TokenLogprobs | None
    ) -> RequestStatus | None:
        """Record a token the scheduler already appended (a verify step appends a run, and
        each of its tokens is recorded in turn); return a finish status when due."""
        state: RequestState = request.output
        params = request.sampling_params
        new_text = state.detokenizer.add_token(token_id)
        if state.logprobs is not None:
            state.logprobs.append(logprobs)
        state.num_tokens += 1
        num_out = state.num_tokens
        stop_token = (token_id in request.eos_token_ids and not params.ignore_eos) or (
            token_id in params.stop_token_ids
        )
        if stop_token and num_out >= params.min_tokens:
            request.stop_reason = token_id
            state.text += state.detokenizer.flush()
            return RequestStatus.FINISHED_STOPPED
        state.text += new_text
        if params.stop and num_out >= params.min_tokens:
            hit = find_stop_string(
                state.text, len(new_text), params.stop, params.include_stop_str_in_output
            )
            if hit is not None:
                state.text, request.stop_reason = hit
                return RequestStatus.FINISHED_STOPPED
        if (
            num_out >= params.max_tokens
            or request.num_prompt_tokens + num_out >= self.max_model_len
        ):
            state.text += state.detokenizer.flush()
            return RequestStatus.FINISHED_LENGTH
        return None

    def due(self, request: Request) -> bool:
        """Whether the request's output goes out this step: always for whole outputs; a
        delta output with its first token, its last, or ``stream_interval`` new tokens."""
        if not self.delta or self.stream_interval == 1 or request.is_finished:
            return True
        sent = request.output.sent_token_len
        return sent == 0 or len(request.output_token_ids) - sent >= self.stream_interval

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output so far; with ``delta`` only what is new since the last one.

        A delta output's ``outputs[0]`` holds the new text, token ids and logprobs
        and leaves the prompt out (the caller has it): what a stream sends per step.
        """
        state: RequestState = request.output
        new_text = state.text[state.sent_text_len :]
        new_tokens = request.output_token_ids[state.sent_token_len :]
        times = first_token_times(request) if new_tokens and not state.sent_token_len else None
        state.sent_text_len, state.sent_token_len = len(state.text), len(request.output_token_ids)
        logprobs = state.logprobs
        if self.delta and logprobs is not None:
            logprobs = logprobs[len(logprobs) - len(new_tokens) :]
        completion = CompletionOutput(
            index=0,
            text=new_text if self.delta else state.text,
            token_ids=new_tokens if self.delta else list(request.output_token_ids),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=None if self.delta else state.prompt,
            prompt_token_ids=[] if self.delta else request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens,
            new_text=new_text,
            new_token_ids=new_tokens,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            first_token_times=times,
        )


def first_token_times(request: Request) -> FirstTokenTimes | None:
    """Queue and prefill time of a request whose first token is on the host now (None
    for a decode worker's request, whose prompt another worker computed)."""
    scheduled = request.first_scheduled_time
    if scheduled is None:
        return None
    if request.first_token_time is None:
        request.first_token_time = time.monotonic()
    queued, prefill = scheduled - request.arrival_time, request.first_token_time - scheduled
    return FirstTokenTimes(queued, prefill)
