"""Where a serving engine's loop time goes: its steps by kind and batch size.

The engine process times each turn of its loop that ran a step (the commands read,
the step, its outputs sent to the fronts), so a step's seconds are what a served
request waits for it: the device's work and the process's own. Counted by the
step's kind (``decode``: every request adds its next token, or verifies its drafts;
``prefill``: every request computes prompt tokens; ``mixed``: both) and its batch,
rounded up to a bucket (1, 2, 4, 8, then every 16: the decode graphs' sizes). Served
as ``splitserve_engine_steps_total``, ``splitserve_engine_step_requests_total``,
``splitserve_engine_step_context_tokens_total`` (the requests' tokens in the KV
cache after the step: what its attention read),
``splitserve_engine_step_seconds_total`` and
``splitserve_engine_step_wait_seconds_total`` (of those seconds, the loop's wait
for the device's tokens: with async scheduling, how long the device's step outlasted
the host's work beside it; the rest is the host's own) with labels pool, kind and
batch (the bucket's upper edge): a pool's decode rate at a batch is requests over
seconds, the figure SGLang's decode log calls "gen throughput".
"""

from __future__ import annotations

from collections import defaultdict


def step_kind(num_requests: int, num_prompt_requests: int) -> str:
    """``decode`` when no request computes prompt tokens, ``prefill`` when all do."""
    if num_prompt_requests == 0:
        return "decode"
    return "prefill" if num_prompt_requests == num_requests else "mixed"


def batch_bucket(num_requests: int) -> int:
    """The bucket's upper edge: 1, 2, 4, 8, then the next multiple of 16."""
    for edge in (1, 2, 4, 8):
        if num_requests <= edge:
            return edge
    return -(-num_requests // 16) * 16


class StepTimes:
    """Steps, their requests, context tokens, seconds and seconds waiting for the device
    so far, by kind and batch bucket."""

    def __init__(self) -> None:
        self._totals: defaultdict[tuple[str, int], list] = defaultdict(lambda: [0, 0, 0, 0.0, 0.0])

    def record(
        self,
        num_requests: int,
        num_prompt_requests: int,
        num_context_tokens: int,
        seconds: float,
        wait_seconds: float = 0.0,
    ) -> None:
        """A step of ``num_requests``, ``num_prompt_requests`` of them computing prompt
        tokens, ``num_context_tokens`` in their KV once it is done (what attention reads),
        whose loop turn took ``seconds``, ``wait_seconds`` of them waiting for the
        device's tokens."""
        if num_requests < 1 or not 0 <= num_prompt_requests <= num_requests:
            raise ValueError(
                f"a step of {num_requests} requests, {num_prompt_requests} of them computing "
                "prompt tokens: needs at least one request and at most all of them"
            )
        kind = step_kind(num_requests, num_prompt_requests)
        totals = self._totals[kind, batch_bucket(num_requests)]
        totals[0] += 1
        totals[1] += num_requests
        totals[2] += num_context_tokens
        totals[3] += seconds
        totals[4] += wait_seconds

    def rows(self) -> list[list]:
        """``[[kind, batch bucket, steps, requests, context tokens, seconds, wait
        seconds], ...]`` (what ``WorkerStats`` carries), sorted."""
        return [[kind, edge, *totals] for (kind, edge), totals in sorted(self._totals.items())]
