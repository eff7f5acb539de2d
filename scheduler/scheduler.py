"""Continuous batching with chunked prefill, in vLLM v1's "tokens to compute" model.

A request must compute its tokens ``num_computed_tokens .. num_tokens - 1``: a
decode is one token, a prefill chunk is many, and one step can mix both. A step:

1. The budget is ``max_num_batched_tokens`` tokens.
2. RUNNING requests, in order, each take ``min(tokens left, budget)``. When the
   KV cache has no room, the last running request is preempted by recompute
   (its blocks are freed, ``num_computed_tokens`` drops to 0 and it goes to the
   front of WAITING) until the allocation fits or the request preempted itself.
3. Only if nothing was preempted: WAITING requests are admitted in FIFO order
   while budget and ``max_num_seqs`` allow, each starting from its prefix-cache
   hit. The first one that does not fit stops admission.

The batch is the running requests first, then the newly admitted ones. Once the
step is queued, ``advance`` moves ``num_computed_tokens`` past it and counts a
pending token for each request that samples; once the tokens are on the host,
``resolve`` appends them and caches the blocks that became full
(``update_from_output`` does both, for a step that already ran). With async
scheduling the next step is scheduled in between, while the device computes. A request samples when
its scheduled tokens reach its end (``will_sample``); the model runner uses the
same rule to pick the rows that become logits.

Speculative decoding: a decoding request with drafts (``spec_token_ids``) takes
``1 + drafts`` tokens, trimmed to the budget, the context length and what
``max_tokens`` leaves. A step that samples also allocates
``num_lookahead_tokens`` slots past its tokens, where the drafter writes its
chained drafts' KV. ``resolve`` takes the verified run: the rejected drafts'
positions leave ``num_computed_tokens`` (their KV is rolled back: never hashed,
overwritten by the next step).

Disaggregation adds two holding areas outside the step. A decode worker's
remote requests wait in ``waiting_for_blocks`` until ``reserve_kv_blocks`` can
give them blocks for the whole prompt (FIFO, counted against ``max_num_seqs``),
then sit in ``reserved`` until ``kv_arrived`` makes them RUNNING with the
prompt computed and the first token appended. A prefill worker moves a request
out of RUNNING into ``SENDING_KV`` (``hold_for_transfer``) once its first token
is sampled; its blocks stay until the request is finished.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from splitserve.config import SchedulerConfig
from splitserve.scheduler.block_manager import BlockManager
from splitserve.scheduler.request import Request, RequestStatus


def will_sample(request: Request, num_scheduled_tokens: int) -> bool:
    """Whether a step that computes ``num_scheduled_tokens`` tokens samples a token.

    Read before ``update_from_output`` advances ``request.num_computed_tokens``. A
    verify step samples once it has computed the drafts too.
    """
    return request.num_computed_tokens + num_scheduled_tokens == request.num_tokens_with_spec


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)  # running first, then admitted
    num_scheduled_tokens: list[int] = field(default_factory=list)  # aligned with requests
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)

    def without_finished(self) -> SchedulerOutput:
        """The batch less the requests that finished since it was scheduled."""
        out = SchedulerOutput(preempted=self.preempted)
        for request, n in zip(self.requests, self.num_scheduled_tokens):
            if not request.is_finished:
                out.add(request, n)
        return out


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
    ):
        """``num_lookahead_tokens``: slots a sampling step keeps past its tokens for the
        drafter (speculative decoding: the number of draft tokens)."""
        config.check()
        if max_model_len < 1:
            raise ValueError(f"invalid max_model_len={max_model_len}: must be >= 1")
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting_for_blocks: deque[Request] = deque()  # remote, no blocks yet
        self.reserved: dict[str, Request] = {}  # remote, blocks reserved, KV in flight

    # ---- request bookkeeping ------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._admit(request, RequestStatus.WAITING)
        self.waiting.append(request)

    def add_remote_request(self, request: Request) -> None:
        """A request whose prompt KV a prefill worker will send (decode side)."""
        self._admit(request, RequestStatus.WAITING_FOR_KV)
        self.waiting_for_blocks.append(request)

    def _admit(self, request: Request, status: RequestStatus) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        self._check_fits(request)
        request.status = status
        self.requests[request.request_id] = request

    def _check_fits(self, request: Request) -> None:
        """Reject a request that could never be scheduled (it would wait forever)."""
        # The last sampled token is never fed back, so its KV is never computed.
        max_len = request.num_prompt_tokens + request.sampling_params.max_tokens - 1
        max_len = min(max_len + self.num_lookahead_tokens, self.max_model_len)
        capacity = self.block_manager.num_usable_blocks * self.block_manager.block_size
        if max_len > capacity:
            raise ValueError(
                f"request {request.request_id!r} may need KV for {max_len} tokens, but the "
                f"cache holds {capacity}; lower max_tokens or add KV blocks"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and max_len > budget:
            raise ValueError(
                f"request {request.request_id!r} may need {max_len} tokens in one step, over "
                f"max_num_batched_tokens={budget}; enable chunked prefill or raise the budget"
            )

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_request(self, request: str | Request, status: RequestStatus) -> bool:
        """Stop a request wherever it is and free its KV; False if unknown or finished."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request_id = request if isinstance(request, str) else request.request_id
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_KV:
            if self.reserved.pop(request_id, None) is None:
                self.waiting_for_blocks.remove(req)
        elif req.status != RequestStatus.SENDING_KV:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = status
        return True

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # ---- disaggregation -----------------------------------------------------

    def reserve_kv_blocks(self) -> list[Request]:
        """Give waiting remote requests blocks for their prompts; return those that got them."""
        reserved = []
        while self.waiting_for_blocks and self._num_seqs < self.config.max_num_seqs:
            req = self.waiting_for_blocks[0]
            computed_blocks, num_hit = self.block_manager.get_computed_blocks(req)
            if not self.block_manager.allocate_slots(
                req, req.num_prompt_tokens - num_hit, computed_blocks
            ):
                break
            self.waiting_for_blocks.popleft()
            req.num_cached_tokens = num_hit
            self.reserved[req.request_id] = req
            reserved.append(req)
        return reserved

    def kv_arrived(self, request_id: str, first_token: int) -> Request | None:
        """The prompt's KV and first token are in place: the request decodes from here."""
        req = self.reserved.pop(request_id, None)
        if req is None:
            return None
        req.num_computed_tokens = req.num_prompt_tokens
        self.block_manager.cache_full_blocks(req, req.num_computed_tokens)
        req.output_token_ids.append(first_token)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def hold_for_transfer(self, request: Request) -> None:
        """Prefill side: stop scheduling the request, keep its blocks until it finishes."""
        self.running.remove(request)
        request.status = RequestStatus.SENDING_KV

    @property
    def _num_seqs(self) -> int:
        return len(self.running) + len(self.reserved)

    def has_runnable_requests(self) -> bool:
        """Whether ``schedule`` may find work; remote requests wait on transfers or blocks,
        which free up only when a step finishes something, a transfer ends or a request
        is aborted."""
        return bool(self.waiting or self.running)

    # ---- the step -----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            self._trim_drafts(req, budget)
            remaining = req.num_tokens_with_spec - req.num_computed_tokens
            n = min(remaining, budget)
            whole = self.config.enable_chunked_prefill or n == remaining
            if n == 0 or not whole or self._ends_at_pending_token(req):
                i += 1
                continue
            while not self.block_manager.allocate_slots(req, n + self._lookahead(req, n)):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.add(req, n)
            budget -= n
            i += 1
        return budget

    def _trim_drafts(self, req: Request, budget: int) -> None:
        """Keep the drafts that fit the budget, the context length and ``max_tokens`` (an
        accepted run of ``k`` drafts yields ``k + 1`` tokens)."""
        if not req.spec_token_ids:
            return
        room = min(
            budget - (req.num_tokens - req.num_computed_tokens),
            self.max_model_len - req.num_tokens,
            req.sampling_params.max_tokens - req.num_output_tokens - 1,
        )
        del req.spec_token_ids[max(room, 0) :]

    def _lookahead(self, req: Request, n: int) -> int:
        """Slots past a sampling step's tokens for the drafter's chained KV, within the
        context length."""
        if not self.num_lookahead_tokens or not will_sample(req, n):
            return 0
        end = req.num_computed_tokens + n
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def _ends_at_pending_token(self, req: Request) -> bool:
        """The token still on the device is the request's last (max_tokens or the
        context length), so it needs no further step."""
        return req.num_pending_tokens > 0 and (
            req.num_output_tokens >= req.sampling_params.max_tokens
            or req.num_tokens >= self.max_model_len
        )

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.spec_token_ids.clear()  # drafted from KV that is gone; recomputed, not verified
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and self._num_seqs < self.config.max_num_seqs:
            req = self.waiting[0]
            computed_blocks, num_hit = [], 0
            if req.num_computed_tokens == 0:
                computed_blocks, num_hit = self.block_manager.get_computed_blocks(req)
            remaining = req.num_tokens - req.num_computed_tokens - num_hit
            n = min(remaining, budget)
            if not self.config.enable_chunked_prefill and n < remaining:
                break
            lookahead = self._lookahead(req, num_hit + n) if n == remaining else 0
            if not self.block_manager.allocate_slots(req, n + lookahead, computed_blocks):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.monotonic()
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.add(req, n)
            budget -= n

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int | list[int]]
    ) -> None:
        """Advance each scheduled request by its tokens and append its sampled token."""
        self.advance(output)
        self.resolve(output, sampled)

    def advance(self, output: SchedulerOutput) -> None:
        """The step is queued on the device: move each request past its scheduled
        tokens; one that samples gets a pending token, so the next ``schedule`` can
        already give it its decode step (async scheduling)."""
        for req, n in zip(output.requests, output.num_scheduled_tokens):
            if req.is_finished:  # aborted after it was scheduled; its KV is gone
                continue
            if will_sample(req, n):
                req.num_pending_tokens += 1
            req.num_computed_tokens += n

    def resolve(self, output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> None:
        """The step's tokens reached the host: they replace the pending tokens, and
        the blocks that are full of known tokens join the prefix cache.

        A verify step's tokens are the accepted drafts and one more token; the
        rejected drafts' positions are rolled back."""
        for req in output.requests:
            if req.is_finished:
                continue
            tokens = sampled.get(req.request_id)
            if tokens is not None:
                tokens = [tokens] if isinstance(tokens, int) else tokens
                req.num_pending_tokens -= 1
                self._settle_drafts(req, len(tokens) - 1)
                req.output_token_ids.extend(tokens)
            if req.status in (RequestStatus.RUNNING, RequestStatus.SENDING_KV):
                known = req.num_prompt_tokens + len(req.output_token_ids)
                self.block_manager.cache_full_blocks(req, min(req.num_computed_tokens, known))

    @staticmethod
    def _settle_drafts(req: Request, num_accepted: int) -> None:
        """Count the verified drafts and roll back the KV of the rejected ones."""
        num_drafts = len(req.spec_token_ids)
        if num_accepted > num_drafts:
            raise ValueError(
                f"request {req.request_id!r}: {num_accepted} drafts accepted of {num_drafts}"
            )
        req.num_computed_tokens -= num_drafts - num_accepted
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        req.spec_token_ids = []
