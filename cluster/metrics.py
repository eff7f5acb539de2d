"""Prometheus metrics of the ingress (``/metrics``).

Request metrics are measured at the ingress, as a client sees them: time to
first token, inter-token latency and end-to-end latency per route, requests
per route and outcome; the time to first token is also split into the queue
and prefill time the engine that sampled the token reports, and the rest (the
serving path's share). Every ingress replica posts its request metrics to the
stats board (pool ``ingress``), and ``/metrics`` on any of them sums them all.
Pool metrics come from the workers' latest reports on the stats board
(speculative decoding's drafts and acceptance among them): queue
lengths and KV blocks per pool and replica, and KV transfer counts, bytes and
seconds.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from splitserve.workers.runner.forward_counts import merge_rows

INGRESS = "ingress"  # the stats-board pool under which ingress replicas post their samples

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# the serving path's share of a TTFT: fractions of a millisecond up
PATH_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# metric name -> (stats key, help) for per-pool sums
_POOL_GAUGES = {
    "splitserve_requests_running": ("num_running", "Requests decoding, per pool"),
    "splitserve_requests_waiting": ("num_waiting", "Requests waiting to be scheduled, per pool"),
    "splitserve_requests_waiting_for_kv": (
        "num_waiting_for_kv",
        "Decode requests waiting for their KV, per pool",
    ),
    "splitserve_requests_sending_kv": (
        "num_sending_kv",
        "Prefill requests waiting for the decode worker's ack, per pool",
    ),
    "splitserve_queued_prompt_tokens": ("queued_prompt_tokens", "Prompt tokens not computed yet"),
}
_REPLICA_GAUGES = {
    "splitserve_kv_free_blocks": ("num_free_blocks", "Free KV blocks (cached prefixes included)"),
    "splitserve_kv_blocks": ("num_blocks", "Usable KV blocks"),
    "splitserve_kv_usage": ("kv_usage", "Share of KV blocks in use"),
    "splitserve_worker_pid": ("pid", "Process id of the worker replica"),
    "splitserve_engine_pid": ("engine_pid", "Process id of the worker replica's engine process"),
}
_POOL_COUNTERS = {
    "splitserve_kv_transfers": ("kv_transfers", "KV hand-offs acked by a decode worker"),
    "splitserve_kv_late_tickets": (
        "kv_late_tickets",
        "Prompts a prefill worker got before their KV ticket, then the ticket",
    ),
    "splitserve_kv_transfer_bytes": ("kv_transfer_bytes", "Bytes of KV handed off"),
    "splitserve_kv_transfer_seconds": (
        "kv_transfer_seconds",
        "Seconds from the first layer sent to the ack, summed",
    ),
    "splitserve_spec_decode_num_draft_tokens": (
        "spec_num_draft_tokens",
        "Draft tokens verified (MTP speculative decoding)",
    ),
    "splitserve_spec_decode_num_accepted_tokens": (
        "spec_num_accepted_tokens",
        "Draft tokens accepted (MTP speculative decoding)",
    ),
}


class PoolCollector:
    """Renders the workers of a stats-board snapshot (worker -> (pool, stats))."""

    def __init__(self, snapshot: dict[str, tuple[str, dict]]):
        self.snapshot = {k: v for k, v in snapshot.items() if v[0] != INGRESS}

    def collect(self):
        pools = sorted({pool for pool, _ in self.snapshot.values()})
        replicas = GaugeMetricFamily(
            "splitserve_pool_replicas", "Live worker replicas per pool", labels=["pool"]
        )
        for pool in pools:
            replicas.add_metric([pool], sum(p == pool for p, _ in self.snapshot.values()))
        yield replicas
        for name, (key, help_text) in _POOL_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["pool"])
            for pool in pools:
                family.add_metric([pool], self._sum(pool, key))
            yield family
        for name, (key, help_text) in _REPLICA_GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["pool", "replica"])
            for worker, (pool, stats) in sorted(self.snapshot.items()):
                family.add_metric([pool, worker], stats[key])
            yield family
        yield self._expert_tokens()  # expert parallelism: the load balance
        yield self._rank_free_blocks()
        for name, (key, help_text) in _POOL_COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["pool"])
            for pool in pools:
                family.add_metric([pool], self._sum(pool, key))
            yield family
        yield self._acceptance_lengths(pools)
        yield self._forwards()
        yield from self._step_times()

    def _forwards(self) -> CounterMetricFamily:
        """Per pool, step kind and how it ran: the engines' forwards (graph hit rates)."""
        family = CounterMetricFamily(
            "splitserve_forwards",
            "Forwards of engine steps by kind (prefill, mixed, decode, verify, MTP draft) "
            "and how they ran (a CUDA graph replayed, piecewise graphs, eager); an "
            "expert-parallel group's ranks summed",
            labels=["pool", "kind", "how"],
        )
        rows = [(pool, stats.get("forward_counts") or []) for pool, stats in self.snapshot.values()]
        for pool in sorted({pool for pool, _ in rows}):
            for kind, how, n in merge_rows(*(r for p, r in rows if p == pool)):
                family.add_metric([pool, kind, how], n)
        return family

    def _step_times(self) -> list[CounterMetricFamily]:
        """Per pool, step kind and batch bucket: the engine loops' steps, the requests in
        them, their context tokens, their seconds and those of them waiting for the
        device (``workers/engine/step_times.py``):
        a pool's decode rate at a batch is requests over seconds."""
        labels = ["pool", "kind", "batch"]
        families = [
            CounterMetricFamily(
                "splitserve_engine_steps",
                "Engine loop turns that ran a step, by step kind and batch bucket",
                labels=labels,
            ),
            CounterMetricFamily(
                "splitserve_engine_step_requests",
                "Requests in those steps (a decode step: the tokens it made, one a request)",
                labels=labels,
            ),
            CounterMetricFamily(
                "splitserve_engine_step_context_tokens",
                "The requests' tokens in the KV cache after those steps (what attention read)",
                labels=labels,
            ),
            CounterMetricFamily(
                "splitserve_engine_step_seconds",
                "Seconds of those loop turns (the step and its outputs sent)",
                labels=labels,
            ),
            CounterMetricFamily(
                "splitserve_engine_step_wait_seconds",
                "Of those seconds, the loop's wait for the device's tokens (the rest: the host's)",
                labels=labels,
            ),
        ]
        totals: defaultdict[tuple[str, str, int], list[float]] = defaultdict(
            lambda: [0.0] * len(families)
        )
        for pool, stats in self.snapshot.values():
            for kind, batch, *counts in stats.get("step_times") or []:
                total = totals[pool, kind, batch]
                for i, value in enumerate(counts):
                    total[i] += value
        for (pool, kind, batch), counts in sorted(totals.items()):
            for family, value in zip(families, counts):
                family.add_metric([pool, kind, str(batch)], value)
        return families

    def _acceptance_lengths(self, pools: list[str]) -> HistogramMetricFamily:
        """Per pool: how many drafts each verify step of a request accepted."""
        family = HistogramMetricFamily(
            "splitserve_spec_decode_acceptance_length",
            "Drafts accepted per verify step of a request (MTP speculative decoding)",
            labels=["pool"],
        )
        for pool in pools:
            counts: list[int] = []
            for p, stats in self.snapshot.values():
                lengths = stats.get("spec_acceptance_lengths") if p == pool else None
                for n, count in enumerate(lengths or []):
                    counts += [0] * (n + 1 - len(counts))
                    counts[n] += count
            if not counts:
                continue
            cumulative = [sum(counts[: n + 1]) for n in range(len(counts))]
            buckets = [(str(float(n)), c) for n, c in enumerate(cumulative)]
            total = sum(n * c for n, c in enumerate(counts))
            family.add_metric([pool], buckets + [("+Inf", cumulative[-1])], total)
        return family

    def _sum(self, pool: str, key: str) -> float:
        return sum(stats[key] for p, stats in self.snapshot.values() if p == pool)

    def _rank_free_blocks(self) -> GaugeMetricFamily:
        """Per replica and expert-parallel rank: free KV blocks (each rank its own cache)."""
        family = GaugeMetricFamily(
            "splitserve_kv_free_blocks_per_rank",
            "Free KV blocks of each expert-parallel rank (splitserve_kv_free_blocks: the sum)",
            labels=["pool", "replica", "rank"],
        )
        for worker, (pool, stats) in sorted(self.snapshot.items()):
            for rank, free in enumerate(stats.get("rank_free_blocks") or []):
                family.add_metric([pool, worker, str(rank)], free)
        return family

    def _expert_tokens(self) -> CounterMetricFamily:
        """Per replica, expert-parallel rank and routed expert: (token, expert) pairs."""
        family = CounterMetricFamily(
            "splitserve_expert_tokens",
            "Tokens each routed expert computed (summed over MoE layers), per replica and "
            "expert-parallel rank: the load balance",
            labels=["pool", "replica", "rank", "expert"],
        )
        for worker, (pool, stats) in sorted(self.snapshot.items()):
            for rank, counts in enumerate(stats.get("expert_tokens") or []):
                for i, count in enumerate(counts):
                    expert = str(rank * len(counts) + i)
                    family.add_metric([pool, worker, str(rank), expert], count)
        return family


class RequestCollector:
    """The request metrics of every ingress replica, summed sample by sample."""

    def __init__(self, posts: list[list]):
        self.posts = posts  # each replica's ``ServingMetrics.samples()``

    def collect(self):
        families: dict[str, Metric] = {}
        sums: dict[tuple, float] = defaultdict(float)
        for samples in self.posts:
            for family, doc, kind, name, labels, value in samples:
                if family not in families:
                    families[family] = Metric(family, doc, kind)
                sums[(family, name, tuple(sorted(labels.items())))] += value
        for (family, name, labels), value in sums.items():
            families[family].add_sample(name, dict(labels), value)
        yield from families.values()


class ServingMetrics:
    """One ingress replica's request metrics, and ``/metrics`` for the whole app."""

    def __init__(self):
        self.registry = CollectorRegistry()  # this replica's request metrics
        self.ttft = Histogram(
            "splitserve_time_to_first_token_seconds",
            "Time from request arrival to its first token, per route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # The TTFT split where it went: the engine that sampled the first token says how
        # long the request queued there and how long its prefill took; the rest is the
        # serving path (intake, routing, calls, a hand-off's reservation, frames back).
        self.queue_time = Histogram(
            "splitserve_request_queue_time_seconds",
            "Time a request waited in the engine that computed its prompt, per route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill_time = Histogram(
            "splitserve_request_prefill_time_seconds",
            "Time from a request's first engine step to its first token on the engine's "
            "host, per route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft_path = Histogram(
            "splitserve_time_to_first_token_serving_path_seconds",
            "Time to first token less the engine's queue and prefill time: the serving "
            "path's share (intake, routing, worker calls, frames), per route",
            ["route"],
            buckets=PATH_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Time between consecutive output tokens, per route",
            ["route"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "splitserve_request_latency_seconds",
            "Time from request arrival to its last token, per route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "splitserve_requests",
            "Requests served, per route and outcome (ok, error, cancelled)",
            ["route", "outcome"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "splitserve_requests_rejected",
            "Requests rejected before routing, per HTTP status",
            ["status"],
            registry=self.registry,
        )

    def samples(self) -> list[list]:
        """This replica's request metrics as plain samples, for the stats board:
        ``[family, help, type, sample name, labels, value]``."""
        return [
            [family.name, family.documentation, family.type, s.name, s.labels, s.value]
            for family in self.registry.collect()
            for s in family.samples
            if not s.name.endswith("_created")  # a time, not a count: it does not sum
        ]

    def render(self, snapshot: dict[str, tuple[str, dict]], replica: str) -> bytes:
        """The app's metrics: every ingress replica's request metrics (this one's fresh,
        ``replica`` on the board), summed, and the workers' pool metrics."""
        posts = [s["samples"] for k, (p, s) in snapshot.items() if p == INGRESS and k != replica]
        registry = CollectorRegistry()
        registry.register(RequestCollector([self.samples(), *posts]))
        registry.register(PoolCollector(snapshot))
        return generate_latest(registry)
