"""Ray Serve autoscaling policies of the worker pools.

Workers report ``queued_prompt_tokens``, ``running_requests`` and ``kv_usage``
(``record_autoscaling_stats``); Serve averages each over its look-back window
per replica. The prefill pool wants ``ceil(total queued prompt tokens /
target)`` replicas; the decode and mixed pools want enough replicas for both
the running requests and the KV usage to sit at their targets. The result is
clamped to the pool's ``min_replicas .. max_replicas``.
"""

from __future__ import annotations

import math
from typing import Any


class PoolAutoscalingPolicy:
    def __init__(
        self,
        pool: str,
        target_queued_prompt_tokens: int,
        target_running_requests: int,
        target_kv_usage: float,
    ):
        self.pool = pool
        self.target_queued_prompt_tokens = target_queued_prompt_tokens
        self.target_running_requests = target_running_requests
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        current = max(ctx.current_num_replicas, 1)

        def total(name: str) -> float:
            return sum(metrics.get(name, {}).values())

        if self.pool == "prefill":
            wanted = math.ceil(total("queued_prompt_tokens") / self.target_queued_prompt_tokens)
        else:
            by_requests = math.ceil(total("running_requests") / self.target_running_requests)
            # KV usage is a per-replica share: the pool's total usage in replicas' worth.
            by_kv = math.ceil(total("kv_usage") / self.target_kv_usage)
            wanted = max(by_requests, by_kv)
        if not metrics:
            wanted = current  # nothing reported yet: hold
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        return min(max(wanted, low), high), {}
