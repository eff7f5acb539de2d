"""Splitwise role assignment: which worker computes a prompt, and which decodes it.

Per request the router picks a **route**:

- ``local_mixed``: a mixed worker does both (when there are mixed workers and
  the prompt is short, or when one of the disaggregated pools is missing);
- ``local_short``: a decode worker computes a short prompt itself; sending it
  to a prefill worker would cost more than it saves;
- ``local_backlog``: a decode worker computes a long prompt itself because the
  prefill pool is the bottleneck (conditional disaggregation): the least-loaded
  prefill worker has ``prefill_backlog_tokens`` prompt tokens queued or more, and
  the least-loaded decode worker fewer;
- ``disaggregated``: a prefill worker computes the prompt and hands the KV to a
  decode worker. The decode worker may still keep it local when most of the
  prompt is a hit in its prefix cache (``local_prefix_hit``: the rule is
  ``keeps_prefix_hit_local``, applied there because only it knows its cache).

Within a pool the router ranks replicas by live load (``WorkerLoad``, from
the workers' reported stats) plus the requests it sent them since the last
report, so a burst does not pile onto one replica.
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL_MIXED = "local_mixed"
LOCAL_SHORT = "local_short"
LOCAL_PREFIX_HIT = "local_prefix_hit"
LOCAL_BACKLOG = "local_backlog"
DISAGGREGATED = "disaggregated"
ROUTES = (LOCAL_MIXED, LOCAL_SHORT, LOCAL_PREFIX_HIT, LOCAL_BACKLOG, DISAGGREGATED)


@dataclass
class RouterConfig:
    # Prompts with at most this many tokens are computed where they decode.
    local_prompt_tokens: int = 32
    # A decode worker computes the prompt itself when its prefix cache holds this share.
    local_prefix_hit_ratio: float = 0.8
    # A decode worker over this KV usage is ranked after every other.
    max_kv_usage: float = 0.95
    # Past this many prompt tokens queued on every prefill worker, a long prompt is
    # computed by a decode worker with less queued (``local_backlog``); None: never.
    prefill_backlog_tokens: int | None = 32768
    # Send a disaggregated prompt to its prefill worker while the decode worker reserves
    # its blocks (the KV goes out once the ticket follows), not after: the reservation's
    # round trip leaves the TTFT. Only when the decode worker has the blocks free
    # (``reserves_at_once``) and a prefill worker has room; off for expert-parallel
    # workers (a group places the prompt by its ticket).
    prefill_before_ticket: bool = True

    def check(self) -> None:
        if not isinstance(self.prefill_before_ticket, bool):
            raise ValueError(
                f"invalid router.prefill_before_ticket={self.prefill_before_ticket!r}: "
                "must be true or false"
            )
        if self.local_prompt_tokens < 0:
            raise ValueError(
                f"invalid router.local_prompt_tokens={self.local_prompt_tokens}: must be >= 0"
            )
        if not 0.0 < self.local_prefix_hit_ratio <= 1.0:
            raise ValueError(
                f"invalid router.local_prefix_hit_ratio={self.local_prefix_hit_ratio}: "
                "must be in (0, 1]"
            )
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"invalid router.max_kv_usage={self.max_kv_usage}: must be in (0, 1]")
        backlog = self.prefill_backlog_tokens
        if backlog is not None and (not isinstance(backlog, int) or backlog < 1):
            raise ValueError(
                f"invalid router.prefill_backlog_tokens={backlog!r}: must be an integer >= 1 "
                "or null (never compute a long prompt on a decode worker)"
            )


@dataclass
class WorkerLoad:
    queued_prompt_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    num_sending_kv: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 1
    kv_usage: float = 0.0

    @property
    def num_requests(self) -> int:
        """Requests the worker holds, in any state."""
        return self.num_running + self.num_waiting + self.num_waiting_for_kv + self.num_sending_kv

    @classmethod
    def from_stats(cls, stats: object | None) -> WorkerLoad:
        """The load in a worker's ``WorkerStats`` (its attributes, no copy: a request
        ranks every engine of a pool); defaults without stats."""
        if stats is None:
            return cls()
        return cls(**{k: getattr(stats, k) for k in cls.__dataclass_fields__})


def choose_route(
    config: RouterConfig,
    num_prompt_tokens: int,
    has_prefill: bool,
    has_decode: bool,
    has_mixed: bool,
    prefill_backlog: int = 0,
    decode_backlog: int = 0,
) -> str:
    """The route of a new request, from its length, which pools exist, and the prompt
    tokens queued on the least-loaded prefill and decode workers (``*_backlog``)."""
    disaggregated_pools = has_prefill and has_decode
    short = num_prompt_tokens <= config.local_prompt_tokens
    if has_mixed and (short or not disaggregated_pools):
        return LOCAL_MIXED
    if not disaggregated_pools:
        raise ValueError("no worker can serve: deploy a mixed pool, or prefill and decode pools")
    if short:
        return LOCAL_SHORT
    threshold = config.prefill_backlog_tokens
    if threshold is not None and prefill_backlog >= threshold and decode_backlog < prefill_backlog:
        return LOCAL_BACKLOG
    return DISAGGREGATED


def reserves_at_once(
    num_free_blocks: int, num_prompt_tokens: int, pending_tokens: int, block_size: int
) -> bool:
    """Whether a decode worker's free blocks (its last report) hold this prompt and the
    prompt tokens sent to it since: its ticket should come at once, so a prefill worker
    may compute the prompt before the ticket (``prefill_before_ticket``). Not when blocks
    are short: prompts computed ahead would hold the prefill worker's blocks while the
    tickets that free the decode worker's wait for them."""
    needed = -(-(num_prompt_tokens + pending_tokens) // block_size)
    return num_free_blocks >= needed


def keeps_prefix_hit_local(num_cached_tokens: int, num_prompt_tokens: int, ratio: float) -> bool:
    """A decode worker's half of the route: it computes a disaggregated request's prompt
    itself (``local_prefix_hit``) when its prefix cache holds ``ratio`` of it."""
    return num_cached_tokens >= ratio * num_prompt_tokens


def prefill_cost(load: WorkerLoad, pending_tokens: int) -> tuple:
    """Rank prefill replicas: fewest prompt tokens ahead of the new one."""
    return (load.queued_prompt_tokens + pending_tokens, -load.num_free_blocks)


def decode_cost(config: RouterConfig, load: WorkerLoad, pending_requests: int) -> tuple:
    """Rank decode (and mixed) replicas: room in the KV cache first, then fewest sequences."""
    full = load.kv_usage >= config.max_kv_usage
    sequences = load.num_running + load.num_waiting + load.num_waiting_for_kv + pending_requests
    return (full, sequences, load.queued_prompt_tokens, -load.num_free_blocks)
