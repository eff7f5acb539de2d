"""What the autoscaler sees: stats-board snapshots turned into ``Signals`` over a window.

Each snapshot holds every worker's latest load (pool, stats) and every ingress
replica's request metrics (pool ``ingress``: its histogram samples and requests in
flight). A pool's load is the sum over its replicas, averaged over the snapshots of
the last ``window_s``; TTFT and TPOT are quantiles of the requests observed in that
window: the difference of the ingresses' cumulative histograms between the oldest
snapshot in the window and the newest (an ingress replica that appeared meanwhile
counts from zero).
"""

from __future__ import annotations

from collections import deque

from splitserve.cluster.autoscaling import POOLS, PoolSignals, Signals
from splitserve.cluster.metrics import INGRESS

TTFT_FAMILY = "splitserve_time_to_first_token_seconds"
ITL_FAMILY = "splitserve_inter_token_latency_seconds"
AUTOSCALER = "autoscaler"  # the board entry (pool ``ingress``) of the autoscaler's samples

Snapshot = dict[str, tuple[str, dict]]  # worker id -> (pool, stats)


class SignalWindow:
    """The snapshots of the last ``window_s`` seconds, and the signals they give."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._snapshots: deque[tuple[float, Snapshot]] = deque()

    def add(self, now: float, snapshot: Snapshot) -> None:
        self._snapshots.append((now, snapshot))
        while self._snapshots and now - self._snapshots[0][0] > self.window_s:
            self._snapshots.popleft()

    def signals(self, running: dict[str, int], quantile: float) -> Signals:
        """``running``: each pool's running replicas (from Ray Serve)."""
        if not self._snapshots:
            return Signals(pools={p: PoolSignals(replicas=running.get(p, 0)) for p in POOLS})
        loads = [pool_loads(s) for _, s in self._snapshots]
        pools = {}
        for pool in POOLS:
            fields = [load.get(pool, PoolSignals()) for load in loads]
            pools[pool] = _mean(fields, running.get(pool, 0))
        in_flight = sum(_in_flight(s) for _, s in self._snapshots) / len(self._snapshots)
        first, last = self._snapshots[0][1], self._snapshots[-1][1]
        return Signals(
            pools=pools,
            in_flight=in_flight,
            ttft_ms=_window_quantile(first, last, TTFT_FAMILY, quantile),
            tpot_ms=_window_quantile(first, last, ITL_FAMILY, quantile),
        )


def pool_loads(snapshot: Snapshot) -> dict[str, PoolSignals]:
    """Per pool, its workers' current load summed."""
    out: dict[str, PoolSignals] = {}
    for pool, stats in snapshot.values():
        if pool not in POOLS:
            continue
        s = out.setdefault(pool, PoolSignals())
        s.replicas += 1
        s.queued_prompt_tokens += stats["queued_prompt_tokens"]
        # A request waiting for its prompt's KV loads the prefill pool, not this one yet.
        s.running_requests += stats["num_running"]
        s.waiting_for_kv += stats["num_waiting_for_kv"]
        s.requests += sum(
            stats[k] for k in ("num_running", "num_waiting", "num_waiting_for_kv", "num_sending_kv")
        )
        s.kv_usage += stats["kv_usage"]
    return out


def _mean(samples: list[PoolSignals], replicas: int) -> PoolSignals:
    n = len(samples)
    return PoolSignals(
        replicas=replicas,
        queued_prompt_tokens=sum(s.queued_prompt_tokens for s in samples) / n,
        running_requests=sum(s.running_requests for s in samples) / n,
        waiting_for_kv=sum(s.waiting_for_kv for s in samples) / n,
        requests=sum(s.requests for s in samples) / n,
        kv_usage=sum(s.kv_usage for s in samples) / n,
    )


def _ingresses(snapshot: Snapshot) -> dict[str, dict]:
    return {k: s for k, (p, s) in snapshot.items() if p == INGRESS and k != AUTOSCALER}


def _in_flight(snapshot: Snapshot) -> float:
    return sum(s.get("in_flight", 0) for s in _ingresses(snapshot).values())


def histogram_buckets(snapshot: Snapshot, family: str) -> dict[str, dict[float, float]]:
    """Per ingress replica: upper bound -> cumulative count, summed over routes."""
    out: dict[str, dict[float, float]] = {}
    for replica, stats in _ingresses(snapshot).items():
        buckets = out.setdefault(replica, {})
        for fam, _doc, _kind, name, labels, value in stats.get("samples", []):
            if fam == family and name == f"{family}_bucket":
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + value
    return out


def _window_quantile(first: Snapshot, last: Snapshot, family: str, q: float) -> float | None:
    """The ``q`` quantile in milliseconds of what ``family`` observed between the two
    snapshots (linear within a bucket); None when it observed nothing."""
    before = histogram_buckets(first, family)
    counts: dict[float, float] = {}
    for replica, buckets in histogram_buckets(last, family).items():
        old = before.get(replica, {})
        for le, count in buckets.items():
            counts[le] = counts.get(le, 0.0) + max(0.0, count - old.get(le, 0.0))
    return quantile_ms(counts, q)


def quantile_ms(cumulative: dict[float, float], q: float) -> float | None:
    """A quantile in milliseconds from cumulative bucket counts (upper bound in seconds
    -> count); past the last finite bound it reads as that bound."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if le == float("inf"):
                return 1e3 * lower
            share = (rank - below) / (count - below) if count > below else 1.0
            return 1e3 * (lower + share * (le - lower))
        lower, below = le, count
    return 1e3 * lower
