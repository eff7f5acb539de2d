"""The goodput autoscaler's decision (``cluster/autoscaling.py``) as a function of time.

Each test drives ``decide`` tick by tick (one second a tick) with the loads a pool
would report, applies its targets the way Ray Serve does, and checks the replica
counts over time: sizing from the load, the delays, scaling to zero and back, the
latency objectives, and the shared budget that moves replicas between the pools.
"""

from __future__ import annotations

import pytest

from splitserve.cluster.autoscaling import (
    Pending,
    PoolLimits,
    PoolSignals,
    ScalingConfig,
    Signals,
    SloConfig,
    decide,
)
from splitserve.cluster.autoscaling_signals import SignalWindow, quantile_ms
from splitserve.cluster.serve_config import ServeConfig

DELAYS = ScalingConfig(upscale_delay_s=3, downscale_delay_s=10)
NO_SLO = SloConfig()


def simulate(limits, start, load, seconds, config=DELAYS, slo=NO_SLO):
    """Targets per second: ``load(t, targets)`` gives the Signals at second t; the
    replicas asked for start at once (Ray Serve), so running == target."""
    targets, pending, history = dict(start), {}, []
    for t in range(seconds):
        signals = load(t, targets)
        for pool, n in targets.items():
            signals.pools.setdefault(pool, PoolSignals()).replicas = n
        decisions, pending = decide(limits, targets, signals, config, slo, pending, float(t))
        targets = {p: d.target for p, d in decisions.items()}
        history.append(targets)
    return history


def series(history, pool):
    return [h[pool] for h in history]


def changes(values):
    return sum(a != b for a, b in zip(values, values[1:]))


def test_prefill_is_sized_by_queued_prompt_tokens_after_the_upscale_delay():
    limits = {"prefill": PoolLimits(1, 4, target_queued_prompt_tokens=1000)}
    load = lambda t, _: Signals({"prefill": PoolSignals(queued_prompt_tokens=2500)})
    prefill = series(simulate(limits, {"prefill": 1}, load, 6), "prefill")
    assert prefill == [1, 1, 1, 3, 3, 3]  # ceil(2500 / 1000), once it wanted it for 3 s


def test_decode_is_sized_by_running_requests_or_kv_usage_whichever_needs_more():
    limits = {"decode": PoolLimits(1, 8, target_running_requests=10, target_kv_usage=0.5)}
    zero = ScalingConfig(upscale_delay_s=0, downscale_delay_s=0)
    by_requests = lambda t, _: Signals({"decode": PoolSignals(running_requests=35, kv_usage=0.4)})
    by_kv = lambda t, _: Signals({"decode": PoolSignals(running_requests=5, kv_usage=2.2)})
    assert simulate(limits, {"decode": 1}, by_requests, 1, zero)[-1]["decode"] == 4
    assert simulate(limits, {"decode": 1}, by_kv, 1, zero)[-1]["decode"] == 5


def test_bursts_shorter_than_the_delays_do_not_move_a_pool():
    limits = {"decode": PoolLimits(1, 4, target_running_requests=10)}

    def bursty(t, _):  # 25 requests for 2 s, 0 for 2 s, ...
        return Signals({"decode": PoolSignals(running_requests=25 if t % 4 < 2 else 0)})

    assert set(series(simulate(limits, {"decode": 1}, bursty, 60), "decode")) == {1}
    # Held 2 replicas; dips of a few seconds do not take one away (downscale delay 10 s).
    assert set(series(simulate(limits, {"decode": 2}, bursty, 60), "decode")) == {2}


def test_a_pool_shrinks_after_the_downscale_delay_and_then_holds():
    limits = {"decode": PoolLimits(1, 4, target_running_requests=10)}
    load = lambda t, _: Signals({"decode": PoolSignals(running_requests=30 if t < 5 else 8)})
    decode = series(simulate(limits, {"decode": 3}, load, 40), "decode")
    assert decode[:15] == [3] * 15 and decode[15:] == [1] * 25  # 10 s after the load fell
    assert changes(decode) == 1


def test_min_zero_goes_to_zero_and_stays_there_through_a_quiet_period():
    """The issue's flap: an idle pool at zero reports nothing and must not be asked back."""
    config = ScalingConfig(upscale_delay_s=3, downscale_delay_s=10, downscale_to_zero_delay_s=5)
    limits = {"prefill": PoolLimits(0, 2), "decode": PoolLimits(0, 2)}
    quiet = lambda t, _: Signals()
    history = simulate(limits, {"prefill": 1, "decode": 1}, quiet, 300, config)
    for pool in ("prefill", "decode"):
        assert series(history, pool) == [1] * 5 + [0] * 295


def test_a_pool_at_zero_starts_at_once_when_requests_wait_for_it():
    limits = {"prefill": PoolLimits(0, 2), "decode": PoolLimits(0, 2)}

    def arrival(t, targets):  # one request from t = 3 s: it waits for a decode worker,
        if t < 3:  # then (reserved there) for a prefill worker's KV
            return Signals()
        decode = PoolSignals(requests=1, waiting_for_kv=1) if targets["decode"] else PoolSignals()
        return Signals({"decode": decode}, in_flight=1)

    history = simulate(limits, {"prefill": 0, "decode": 0}, arrival, 6)
    assert series(history, "decode") == [0, 0, 0, 1, 1, 1]
    assert series(history, "prefill") == [0, 0, 0, 0, 1, 1]


def test_a_starting_replica_is_not_taken_for_an_idle_one():
    limits = {"decode": PoolLimits(0, 2)}
    signals = Signals({"decode": PoolSignals(replicas=0)})  # asked for 1, not running yet
    config = ScalingConfig(downscale_to_zero_delay_s=0)
    decisions, _ = decide(limits, {"decode": 1}, signals, config, SloConfig(), {}, 100.0)
    assert decisions["decode"].target == 1 and decisions["decode"].reason == "starting"


def test_ttft_over_its_objective_adds_prefill_replicas_and_near_it_holds_them():
    limits = {"prefill": PoolLimits(1, 4, target_queued_prompt_tokens=10_000)}
    slo = SloConfig(ttft_ms=200)

    def ttft(t, _):  # 400 ms for 8 s, then 180 ms (within the 0.8 hold band), then 50 ms
        value = 400 if t < 8 else 180 if t < 30 else 50
        return Signals({"prefill": PoolSignals(queued_prompt_tokens=100)}, ttft_ms=value)

    history = simulate(limits, {"prefill": 1}, ttft, 60, slo=slo)
    prefill = series(history, "prefill")
    assert prefill[:3] == [1, 1, 1] and prefill[3] == 2 and prefill[7] == 3  # +1 per delay
    assert set(prefill[8:40]) == {3}  # held near the objective, then 10 s more
    assert prefill[-1] == 1


def test_tpot_over_its_objective_adds_decode_replicas_not_prefill():
    limits = {"prefill": PoolLimits(1, 4), "decode": PoolLimits(1, 4)}
    load = lambda t, _: Signals(tpot_ms=80)
    history = simulate(limits, {"prefill": 1, "decode": 1}, load, 5, slo=SloConfig(tpot_ms=50))
    assert history[-1] == {"prefill": 1, "decode": 2}


def test_a_shift_from_long_prompts_to_long_outputs_moves_replicas_within_the_budget():
    """Four replicas between the pools: prompt-heavy load takes three prefill; when the
    load turns to long outputs, decode takes them as prefill gives them up (after its
    downscale delay), never more than four in all; then back."""
    config = ScalingConfig(upscale_delay_s=3, downscale_delay_s=10, max_total_replicas=4)
    limits = {
        "prefill": PoolLimits(1, 3, target_queued_prompt_tokens=1000),
        "decode": PoolLimits(1, 3, target_running_requests=10),
    }

    def shifting(t, _):
        prompts = t < 30 or t >= 80
        prefill = PoolSignals(queued_prompt_tokens=3000 if prompts else 100)
        decode = PoolSignals(running_requests=8 if prompts else 30)
        return Signals({"prefill": prefill, "decode": decode})

    history = simulate(limits, {"prefill": 1, "decode": 1}, shifting, 130, config)
    prefill, decode = series(history, "prefill"), series(history, "decode")
    assert all(p + d <= 4 for p, d in zip(prefill, decode))
    assert prefill[29] == 3 and decode[29] == 1
    assert decode[39] == 1  # it wanted 3 from 33 s but prefill held them until 40 s
    assert prefill[40] == 1 and decode[40] == 3  # then decode took them in the same tick
    assert prefill[-1] == 3 and decode[-1] == 1  # and back
    assert changes(prefill) <= 3 and changes(decode) <= 3


def test_pending_resets_when_the_wish_changes_direction():
    limits = {"decode": PoolLimits(1, 4, target_running_requests=10)}
    up = Signals({"decode": PoolSignals(replicas=2, running_requests=35)})
    _, pending = decide(limits, {"decode": 2}, up, DELAYS, SloConfig(), {}, 0.0)
    assert pending["decode"] == Pending(1, 0.0)
    down = Signals({"decode": PoolSignals(replicas=2, running_requests=0)})
    _, pending = decide(limits, {"decode": 2}, down, DELAYS, SloConfig(), pending, 2.0)
    assert pending["decode"] == Pending(-1, 2.0)


def test_quantiles_come_from_the_histogram_counts_inside_the_window():
    assert quantile_ms({0.1: 0, 0.5: 10, float("inf"): 10}, 0.5) == pytest.approx(300)
    assert quantile_ms({0.1: 0, 0.5: 0, float("inf"): 4}, 0.9) == pytest.approx(500)
    assert quantile_ms({0.1: 0, float("inf"): 0}, 0.9) is None

    def snapshot(count_01: float, count_inf: float, running: int) -> dict:
        family = "splitserve_time_to_first_token_seconds"
        samples = [
            [family, "", "histogram", f"{family}_bucket", {"route": "x", "le": "0.1"}, count_01],
            [family, "", "histogram", f"{family}_bucket", {"route": "x", "le": "+Inf"}, count_inf],
        ]
        worker = {
            "queued_prompt_tokens": 0,
            "num_running": running,
            "num_waiting": 0,
            "num_waiting_for_kv": 0,
            "num_sending_kv": 0,
            "kv_usage": 0.5,
        }
        return {"i": ("ingress", {"samples": samples, "in_flight": 3}), "w": ("decode", worker)}

    window = SignalWindow(window_s=5)
    window.add(0.0, snapshot(100, 100, 2))  # 100 fast first tokens, gone from the window
    window.add(6.0, snapshot(100, 110, 4))
    window.add(8.0, snapshot(110, 130, 6))  # since 6 s: 10 more fast, 10 slow
    signals = window.signals({"decode": 1}, quantile=0.9)
    assert signals.ttft_ms == pytest.approx(100)  # 10 fast of 20: p90 is past 0.1 s
    assert signals.tpot_ms is None
    assert signals.pools["decode"].running_requests == pytest.approx(5)  # mean of 4 and 6
    assert signals.pools["decode"].kv_usage == pytest.approx(0.5)
    assert signals.in_flight == 3


@pytest.mark.parametrize(
    "section, message",
    [
        ({"slo": {"ttft_ms": -1}}, "invalid slo.ttft_ms=-1: must be a number > 0 or null"),
        ({"slo": {"ttft": 100}}, "unknown config key 'slo.ttft'"),
        ({"autoscaling": {"window_s": 0}}, "invalid autoscaling.window_s=0: must be > 0"),
        ({"autoscaling": {"max_total_replicas": 0}}, "autoscaling.max_total_replicas=0"),
        ({"autoscaling": {"upscale_delay": 1}}, "unknown config key 'autoscaling.upscale_delay'"),
    ],
)
def test_bad_autoscaling_keys_are_errors_naming_the_key(section, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServeConfig.from_dict(section)
