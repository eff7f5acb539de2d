"""A named Ray actor where every worker posts its load; ``/metrics`` reads it.

Entries not refreshed within ``ttl_s`` are dropped, so a dead replica leaves
the board (and the metrics) on its own. ``serve`` shutting down sets the drain
deadline here (``drain``); the ingress replicas read it (``drain_deadline``).
"""

from __future__ import annotations

import time

import ray

BOARD_NAME = "splitserve-stats"


@ray.remote(num_cpus=0)
class StatsBoard:
    def __init__(self, ttl_s: float = 5.0):
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, str, dict]] = {}  # worker -> (time, pool, stats)
        self._drain_deadline: float | None = None  # time.time() when draining ends

    def drain(self, deadline: float) -> None:
        """The app is shutting down: admit nothing new; in-flight requests end by
        ``deadline`` (``time.time()``)."""
        self._drain_deadline = deadline

    def drain_deadline(self) -> float | None:
        return self._drain_deadline

    def post(self, worker_id: str, pool: str, stats: dict) -> None:
        self._entries[worker_id] = (time.monotonic(), pool, stats)

    def remove(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)

    def snapshot(self) -> dict[str, tuple[str, dict]]:
        """worker id -> (pool, stats) for every live worker."""
        now = time.monotonic()
        self._entries = {k: v for k, v in self._entries.items() if now - v[0] < self.ttl_s}
        return {k: (pool, stats) for k, (_, pool, stats) in self._entries.items()}


def get_or_create_board(namespace: str) -> ray.actor.ActorHandle:
    return StatsBoard.options(
        name=BOARD_NAME, namespace=namespace, get_if_exists=True, lifetime="detached"
    ).remote()
