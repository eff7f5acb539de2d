"""The application-level autoscaling policy Ray Serve runs for a splitserve app.

Ray Serve's controller calls ``GoodputPolicy`` every control-loop tick with one
``AutoscalingContext`` per autoscaled deployment of the app and applies the
replica counts it returns. For the worker pools the counts come from
``autoscaling.decide`` (its delays are the policy's own: the pools' deployments
carry none of Ray Serve's); an autoscaled ingress gets Ray Serve's own rule
(ongoing requests per replica, ``target_ongoing_requests``), Ray Serve's delays
applied.

The inputs are read from the app's stats board, where workers post their load
and ingress replicas their request metrics; a thread reads it every stats period
so that the controller's loop never waits on it. The decision and its inputs go
back to the board as the ``autoscaler`` entry's metric samples, so ``/metrics``
shows them (``splitserve_autoscaler_*``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Any

from splitserve.cluster.autoscaling import (
    Decision,
    Pending,
    PoolLimits,
    ScalingConfig,
    Signals,
    SloConfig,
    decide,
)
from splitserve.cluster.autoscaling_signals import AUTOSCALER, SignalWindow

# Ray Serve's logger: the policy runs in its controller, whose log this lands in.
logger = logging.getLogger("ray.serve")


class GoodputPolicy:
    """``policy_kwargs``: ``pools`` (autoscaled pool -> ``PoolLimits`` fields),
    ``autoscaling`` and ``slo`` (their config sections), ``stats_period_s``."""

    def __init__(
        self,
        pools: dict[str, dict],
        autoscaling: dict[str, Any],
        slo: dict[str, Any],
        stats_period_s: float = 0.25,
    ):
        self.limits = {name: PoolLimits(**limits) for name, limits in pools.items()}
        self.scaling = ScalingConfig(**autoscaling)
        self.slo = SloConfig(**slo)
        self.window = SignalWindow(self.scaling.window_s)
        self.pending: dict[str, Pending] = {}
        self.stats_period_s = stats_period_s
        self._reader: BoardReader | None = None
        self._posted = 0.0

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        try:
            return self._decide(contexts), {}
        except Exception:  # keep the replicas as they are; the controller goes on
            logger.exception("the autoscaling policy failed; replicas unchanged")
            return {dep: ctx.target_num_replicas for dep, ctx in contexts.items()}, {}

    def _decide(self, contexts: dict) -> dict:
        pools = {dep: ctx for dep, ctx in contexts.items() if dep.name in self.limits}
        out = {dep: _ingress_replicas(ctx) for dep, ctx in contexts.items() if dep not in pools}
        if not pools:
            return out
        reader = self._board_reader(next(iter(pools.values())).app_name)
        for when, snapshot in reader.take():
            self.window.add(when, snapshot)
        now = time.monotonic()
        running = {dep.name: ctx.current_num_replicas for dep, ctx in pools.items()}
        targets = {dep.name: ctx.target_num_replicas for dep, ctx in pools.items()}
        limits = {name: self.limits[name] for name in targets}
        signals = self.window.signals(running, self.slo.quantile)
        decisions, self.pending = decide(
            limits, targets, signals, self.scaling, self.slo, self.pending, now
        )
        if now - self._posted >= 2 * self.stats_period_s:
            reader.post({"samples": samples(decisions, signals, self.slo), "in_flight": 0})
            self._posted = now
        for dep in pools:
            out[dep] = decisions[dep.name].target
        return out

    def _board_reader(self, app_name: str) -> BoardReader:
        if self._reader is None:
            self._reader = BoardReader(app_name, self.stats_period_s)
        return self._reader


def _ingress_replicas(ctx) -> float:
    """Ray Serve's default rule: ongoing requests over the target per replica."""
    target = ctx.config.get_target_ongoing_requests()
    return max(ctx.total_num_requests / target, ctx.capacity_adjusted_min_replicas)


class BoardReader:
    """Snapshots of the app's stats board, read on a thread every ``period_s``. The
    thread ends when nobody took its snapshots for ``IDLE_S`` (the app was redeployed or
    deleted: Ray Serve made a new policy, or none) and starts again on the next take."""

    IDLE_S = 30.0

    def __init__(self, namespace: str, period_s: float):
        self.namespace = namespace
        self.period_s = period_s
        self._board = None
        self._lock = threading.Lock()
        self._new: list[tuple[float, dict]] = []
        self._taken = time.monotonic()
        self._thread: threading.Thread | None = None

    def take(self) -> list[tuple[float, dict]]:
        """The snapshots read since the last call, oldest first."""
        with self._lock:
            new, self._new = self._new, []
            self._taken = time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="splitserve-autoscaler", daemon=True
                )
                self._thread.start()
        return new

    def post(self, stats: dict) -> None:
        from splitserve.cluster.metrics import INGRESS

        if self._board is not None:
            self._board.post.remote(AUTOSCALER, INGRESS, stats)

    def _run(self) -> None:
        import ray

        from splitserve.cluster.stats_board import BOARD_NAME

        failing = None
        while time.monotonic() - self._taken < self.IDLE_S:
            try:
                if self._board is None:
                    self._board = ray.get_actor(BOARD_NAME, namespace=self.namespace)
                snapshot = ray.get(self._board.snapshot.remote(), timeout=10)
                with self._lock:
                    self._new.append((time.monotonic(), snapshot))
                if failing is not False:
                    logger.info("autoscaler: reading the %s stats board", self.namespace)
                failing = False
            except Exception as e:  # not created yet, or restarting with the app
                if failing is not True:
                    logger.warning("autoscaler: cannot read the stats board yet: %r", e)
                self._board, failing = None, True
            time.sleep(self.period_s)


def samples(decisions: dict[str, Decision], signals: Signals, slo: SloConfig) -> list[list]:
    """The decision and its inputs as metric samples for ``/metrics`` (the format of
    ``ServingMetrics.samples``)."""
    out: list[list] = []

    def gauge(family: str, doc: str, labels: dict, value: float | None) -> None:
        if value is not None:
            out.append([family, doc, "gauge", family, labels, float(value)])

    for pool, d in sorted(decisions.items()):
        s = signals.pool(pool)
        gauge(
            "splitserve_autoscaler_target_replicas", "Replicas asked for", {"pool": pool}, d.target
        )
        gauge(
            "splitserve_autoscaler_desired_replicas",
            "Replicas the load asks for, before the delays",
            {"pool": pool},
            d.desired,
        )
        gauge(
            "splitserve_autoscaler_need_replicas",
            "The load in replicas, before bounds and rounding",
            {"pool": pool},
            d.need,
        )
        gauge(
            "splitserve_autoscaler_decision",
            "The signal that set the desired replicas (1 for the one in force)",
            {"pool": pool, "reason": d.reason},
            1,
        )
        for name in ("replicas", "queued_prompt_tokens", "running_requests", "waiting_for_kv"):
            doc = "The autoscaler's inputs per pool, averaged over its window"
            gauge(
                "splitserve_autoscaler_pool_input",
                doc,
                {"pool": pool, "input": name},
                getattr(s, name),
            )
        gauge(
            "splitserve_autoscaler_pool_input",
            "The autoscaler's inputs per pool, averaged over its window",
            {"pool": pool, "input": "kv_usage"},
            s.kv_usage,
        )
    doc = "The autoscaler's inputs for the whole app (latencies: the SLO quantile, ms)"
    for name in ("in_flight", "unplaced", "ttft_ms", "tpot_ms"):
        gauge("splitserve_autoscaler_input", doc, {"input": name}, getattr(signals, name))
    for name in ("ttft_ms", "tpot_ms"):
        gauge(
            "splitserve_autoscaler_slo",
            "The latency objectives (ms)",
            {"objective": name},
            getattr(slo, name),
        )
    return out


def policy_kwargs(
    pools: dict[str, PoolLimits], scaling: ScalingConfig, slo: SloConfig, stats_period_s: float
) -> dict:
    """``GoodputPolicy``'s keyword arguments (JSON, as Ray Serve's config wants them)."""
    return {
        "pools": {name: asdict(limits) for name, limits in pools.items()},
        "autoscaling": asdict(scaling),
        "slo": asdict(slo),
        "stats_period_s": stats_period_s,
    }
