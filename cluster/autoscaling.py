"""Goodput autoscaling of the worker pools: one decision over every pool.

``decide`` is a pure function of what the pools report (``Signals``), their limits
and the replicas each is asked for now; Ray Serve's application-level policy
(``autoscaling_policy.py``) feeds it every control-loop tick and applies its answer.

Per pool, the *need* in replicas (fractional):

- prefill: queued prompt tokens / ``target_queued_prompt_tokens``;
- decode: the larger of running requests / ``target_running_requests`` and the
  pool's summed KV usage / ``target_kv_usage``;
- mixed: the larger of the two.

The latency objectives (``slo``) move it further: TTFT over ``slo.ttft_ms`` asks
the pools that compute prompts (prefill, mixed) for one replica more than now,
TPOT over ``slo.tpot_ms`` asks the same of the pools that decode (decode, mixed);
a latency above ``hold_ratio`` of its objective holds the pool (no scale-down).

A pool at zero replicas reports nothing, so nothing wakes it but requests that
wait for it: requests open at the ingresses that no decode or mixed worker holds
(the decode and mixed pools), requests on decode workers waiting for a prompt's KV
(the prefill pool). A pool whose replicas are still starting is held at its
target, so a slow start is not taken for an idle pool.

The desired size is clamped to ``min_replicas .. max_replicas``, then to the
shared budget ``max_total_replicas`` (the pools with the most spare capacity give
way). A pool moves to its desired size once it has wanted to move that way for
``upscale_delay_s`` (growing) or ``downscale_delay_s`` (shrinking;
``downscale_to_zero_delay_s`` for the last replica) without a break; a pool at
zero with requests waiting for it starts at once. A pool grows only into budget
that the others have already given up, so replicas move from one pool to the
other within the delays.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

POOLS = ("prefill", "decode", "mixed")
_PROMPT_POOLS = ("prefill", "mixed")  # pools whose replicas compute prompts (TTFT)
_DECODE_POOLS = ("decode", "mixed")  # pools whose replicas generate (TPOT)


@dataclass
class SloConfig:
    """Latency objectives the autoscaler holds the pools to (None: none)."""

    ttft_ms: float | None = None  # time to first token, p90 over the window
    tpot_ms: float | None = None  # time per output token, p90 over the window
    quantile: float = 0.9

    def check(self) -> None:
        for key in ("ttft_ms", "tpot_ms"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"invalid slo.{key}={value!r}: must be a number > 0 or null")
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"invalid slo.quantile={self.quantile!r}: must be in (0, 1)")


@dataclass
class ScalingConfig:
    """The application's autoscaling (``autoscaling:`` in the serve config)."""

    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    downscale_to_zero_delay_s: float | None = None  # None: downscale_delay_s
    window_s: float = 10.0  # loads are averaged, latencies' quantiles taken, over this
    hold_ratio: float = 0.8  # a latency over this share of its objective holds its pools
    max_total_replicas: int | None = None  # of the autoscaled worker pools together

    def check(self) -> None:
        def bad(key: str, accepted: str) -> ValueError:
            value = getattr(self, key)
            return ValueError(f"invalid autoscaling.{key}={value!r}: must be {accepted}")

        for key in ("upscale_delay_s", "downscale_delay_s"):
            if not getattr(self, key) >= 0:
                raise bad(key, ">= 0")
        zero = self.downscale_to_zero_delay_s
        if zero is not None and not zero >= 0:
            raise bad("downscale_to_zero_delay_s", ">= 0 or null")
        if not self.window_s > 0:
            raise bad("window_s", "> 0")
        if not 0.0 < self.hold_ratio <= 1.0:
            raise bad("hold_ratio", "in (0, 1]")
        budget = self.max_total_replicas
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise bad("max_total_replicas", "an integer >= 1 or null")

    @property
    def to_zero_delay_s(self) -> float:
        zero = self.downscale_to_zero_delay_s
        return self.downscale_delay_s if zero is None else zero


@dataclass
class PoolLimits:
    """What the policy knows of an autoscaled pool's config."""

    min_replicas: int
    max_replicas: int
    target_queued_prompt_tokens: int = 8192
    target_running_requests: int = 48
    target_kv_usage: float = 0.8


@dataclass
class PoolSignals:
    """One pool's load, summed over its replicas (averaged over the window)."""

    replicas: int = 0  # running replicas
    queued_prompt_tokens: float = 0.0
    running_requests: float = 0.0  # decoding (not those still waiting for their KV)
    waiting_for_kv: float = 0.0  # decode side: reserved, the prompt not computed yet
    requests: float = 0.0  # every request the pool's workers hold
    kv_usage: float = 0.0  # the replicas' shares summed: 1.5 is one and a half full


@dataclass
class Signals:
    pools: dict[str, PoolSignals] = field(default_factory=dict)
    in_flight: float = 0.0  # requests open at the ingresses
    ttft_ms: float | None = None  # None: no first token in the window
    tpot_ms: float | None = None

    def pool(self, name: str) -> PoolSignals:
        return self.pools.get(name) or PoolSignals()

    @property
    def unplaced(self) -> float:
        """Requests at the ingresses that no decode or mixed worker holds."""
        held = sum(self.pool(p).requests for p in _DECODE_POOLS)
        return max(0.0, self.in_flight - held)


@dataclass
class Pending:
    """A pool's wish to move: its direction (+1 up, -1 down) and since when."""

    direction: int = 0
    since: float = 0.0


@dataclass
class Decision:
    pool: str
    target: int  # replicas asked for from now on
    desired: int  # what the load asks for, before the delays
    need: float  # the load in replicas, before bounds and rounding
    reason: str  # what set ``desired``


def decide(
    limits: dict[str, PoolLimits],
    targets: dict[str, int],
    signals: Signals,
    config: ScalingConfig,
    slo: SloConfig,
    pending: dict[str, Pending],
    now: float,
) -> tuple[dict[str, Decision], dict[str, Pending]]:
    """Every autoscaled pool's next target, and the delay state to pass next time."""
    needs = {p: pool_need(p, limits[p], targets[p], signals, config, slo) for p in limits}
    desired = {p: _clamp(math.ceil(needs[p][0] - 1e-9), limits[p]) for p in limits}
    desired = _within_budget(desired, needs, limits, config.max_total_replicas)
    moved, pending = _apply_delays(desired, targets, config, pending, now)
    moved = _grow_into_free_budget(moved, targets, config.max_total_replicas)
    for pool, wish in pending.items():  # grown as far as it wished: the next growth waits
        if wish.direction > 0 and moved[pool] >= desired[pool]:
            pending[pool] = Pending()
    decisions = {
        p: Decision(p, moved[p], desired[p], round(needs[p][0], 3), needs[p][1]) for p in limits
    }
    return decisions, pending


def pool_need(
    pool: str,
    limits: PoolLimits,
    target: int,
    signals: Signals,
    config: ScalingConfig,
    slo: SloConfig,
) -> tuple[float, str]:
    """The replicas ``pool`` needs for its load and latencies, and the signal that set it."""
    s = signals.pool(pool)
    candidates = [(0.0, "idle")]
    if pool in _PROMPT_POOLS:
        tokens = s.queued_prompt_tokens / limits.target_queued_prompt_tokens
        candidates.append((tokens, "queued_prompt_tokens"))
    if pool in _DECODE_POOLS:
        candidates.append((s.running_requests / limits.target_running_requests, "running_requests"))
        candidates.append((s.kv_usage / limits.target_kv_usage, "kv_usage"))
    if target == 0 and _waits_for(pool, signals):
        candidates.append((1.0, "requests_waiting"))
    need, reason = max(candidates, key=lambda c: c[0])
    for key, pools in (("ttft_ms", _PROMPT_POOLS), ("tpot_ms", _DECODE_POOLS)):
        if pool not in pools:
            continue
        value, objective = getattr(signals, key), getattr(slo, key)
        if value is None or objective is None:
            continue
        if value > objective and need < target + 1:
            need, reason = target + 1, f"{key}_over_slo"
        elif value > config.hold_ratio * objective and need < target:
            need, reason = target, f"{key}_near_slo"
    if s.replicas < target and need < target:
        need, reason = target, "starting"
    return need, reason


def _waits_for(pool: str, signals: Signals) -> bool:
    if pool == "prefill":
        return signals.pool("decode").waiting_for_kv > 0
    return signals.unplaced > 0


def _clamp(n: int, limits: PoolLimits) -> int:
    return min(max(n, limits.min_replicas), limits.max_replicas)


def _within_budget(
    desired: dict[str, int],
    needs: dict[str, tuple[float, str]],
    limits: dict[str, PoolLimits],
    budget: int | None,
) -> dict[str, int]:
    """Desired sizes summing to at most ``budget``: replicas come off the pool with the
    most spare capacity (desired minus need) first, never below its min_replicas."""
    desired = dict(desired)
    while budget is not None and sum(desired.values()) > budget:
        shrinkable = [p for p in desired if desired[p] > limits[p].min_replicas]
        if not shrinkable:
            break
        pool = max(shrinkable, key=lambda p: (desired[p] - needs[p][0], desired[p]))
        desired[pool] -= 1
    return desired


def _apply_delays(
    desired: dict[str, int],
    targets: dict[str, int],
    config: ScalingConfig,
    pending: dict[str, Pending],
    now: float,
) -> tuple[dict[str, int], dict[str, Pending]]:
    moved, after = {}, {}
    for pool, want in desired.items():
        target = targets[pool]
        direction = (want > target) - (want < target)
        wish = pending.get(pool) or Pending()
        if direction == 0:
            moved[pool], after[pool] = target, Pending()
            continue
        if wish.direction != direction:
            wish = Pending(direction, now)
        if direction > 0:
            delay = 0.0 if target == 0 else config.upscale_delay_s
        else:
            delay = config.to_zero_delay_s if want == 0 else config.downscale_delay_s
        # A pool that shrank may shrink on at once while it keeps asking for less (Ray
        # Serve takes a pool to zero through one replica); growth waits anew (``decide``).
        moved[pool], after[pool] = (want if now - wish.since >= delay else target), wish
    return moved, after


def _grow_into_free_budget(
    moved: dict[str, int], targets: dict[str, int], budget: int | None
) -> dict[str, int]:
    """Growth limited to the budget the pools hold after this tick's shrinking: a pool
    takes a replica another gives up only once that one's delay has passed."""
    if budget is None:
        return moved
    moved = dict(moved)
    free = budget - sum(min(moved[p], targets[p]) for p in moved)
    for pool in sorted(moved, key=lambda p: moved[p] - targets[p], reverse=True):
        growth = moved[pool] - targets[pool]
        if growth > 0:
            granted = min(growth, max(free, 0))
            moved[pool] = targets[pool] + granted
            free -= granted
    return moved


def limits_of(pool_config) -> PoolLimits:
    """``PoolLimits`` from a pool's config (any object with its fields)."""
    names = [f.name for f in dataclasses.fields(PoolLimits)]
    return PoolLimits(**{name: getattr(pool_config, name) for name in names})
