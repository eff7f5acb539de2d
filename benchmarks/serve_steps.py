"""The served engines' steps, for ``serve_bench.py``: the decode GPU's rate, served
against the engine alone, read from the engines themselves.

A served request's TPOT mixes the decode steps with whatever else shares its GPU
(a prompt computed there, a batch that has not filled yet). The engines count their
loop's turns by step kind and batch (``splitserve_engine_steps_total``,
``..._step_requests_total``, ``..._step_seconds_total`` on ``/metrics``,
``workers/engine/step_times.py``); a load point's difference of two reads gives the
decode-only steps at each batch with their mean context and the part of their time the
loop waited for the device (``..._step_wait_seconds_total``), and the engine alone's
decode step timed at several batches and two contexts (``serve_engine.decode_step``)
gives what the same steps take alone.
"""

from __future__ import annotations

import re

STEP_METRIC = re.compile(
    r"splitserve_engine_(steps|step_requests|step_context_tokens|step_seconds|step_wait_seconds)"
    r"_total"
    r'\{batch="(\d+)",kind="(\w+)",pool="(\w+)"\}'
)
FIELDS = {
    "steps": "steps",
    "step_requests": "requests",
    "step_context_tokens": "context_tokens",
    "step_seconds": "seconds",
    "step_wait_seconds": "wait_seconds",
}
DECODE_POOLS = ("decode", "mixed")


def step_times(metrics: dict[str, float]) -> list[dict]:
    """The engines' step counters of a server's ``/metrics``, one dict a pool, kind and
    batch bucket: ``{pool, kind, batch, steps, requests, context_tokens, seconds,
    wait_seconds}``."""
    rows: dict[tuple[str, str, int], dict] = {}
    for name, value in metrics.items():
        m = STEP_METRIC.fullmatch(name)
        if m is None:
            continue
        field, batch, kind, pool = m[1], int(m[2]), m[3], m[4]
        row = rows.setdefault((pool, kind, batch), {"pool": pool, "kind": kind, "batch": batch})
        row[FIELDS[field]] = value
    return [rows[key] for key in sorted(rows)]


def difference(before: list[dict], after: list[dict]) -> list[dict]:
    """What ran between two reads: the rows whose steps grew, less the earlier counts."""
    earlier = {(r["pool"], r["kind"], r["batch"]): r for r in before}
    out = []
    for row in after:
        old = earlier.get((row["pool"], row["kind"], row["batch"]), {})
        delta = {k: row[k] - old.get(k, 0) for k in FIELDS.values() if k in row}
        if delta["steps"] > 0:
            out.append({"pool": row["pool"], "kind": row["kind"], "batch": row["batch"], **delta})
    return out


def engine_step_ms(engine: dict, batch: float, context: float) -> float:
    """The engine alone's decode step at ``batch`` requests of ``context`` tokens each:
    each batch it was timed at, moved to that context by its time a context token
    (``decode_ms_per_context_token``), then linear between those batches (the nearest
    one's beyond them)."""
    slope = engine.get("decode_ms_per_context_token", 0.0)
    contexts = engine.get("decode_context_by_batch", {})
    points = sorted(
        (int(b), ms + slope * int(b) * (context - contexts.get(b, context)))
        for b, ms in engine["decode_step_ms_by_batch"].items()
    )
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, ms0), (b1, ms1) in zip(points, points[1:]):
        if batch <= b1:
            return ms0 + (ms1 - ms0) * (batch - b0) / (b1 - b0)
    return points[-1][1]


def decode_against_engine(steps: list[dict], engine: dict | None) -> dict | None:
    """The served decode-only steps of the decode pool (else the mixed pool), batch
    bucket by bucket, against the engine alone's step at each bucket's mean batch and
    context (``engine_step_ms``; ``wait_ms``, ``wait_s``: of the served time, the
    loop's wait for the device's tokens): ``served_vs_engine`` is alone's time over served's
    for the same steps (the decode GPU's served rate over its rate alone on the same
    batches); ``at_batch``: the bucket that holds the engine's own batch, when one ran.
    Without the engine's timings by batch the served buckets come alone (the engine's
    fields None). None without decode steps."""
    for pool in DECODE_POOLS:
        rows = [r for r in steps if (r["pool"], r["kind"]) == (pool, "decode") and r["steps"]]
        if rows:
            break
    else:
        return None
    timed = bool((engine or {}).get("decode_step_ms_by_batch"))
    buckets = [_bucket(r, engine if timed else None) for r in rows]
    served_s = sum(r["seconds"] for r in rows)
    waits = [r.get("wait_seconds") for r in rows]
    wait_s = None if None in waits else sum(waits)  # None: a server without the counter
    alone_s = sum(b["engine_step_ms"] * b["steps"] for b in buckets) / 1e3 if timed else None
    top = engine["decode_batch"] if timed else None
    at_batch = next((b for b in buckets if b["batch_bucket"] >= top), None) if timed else None
    return {
        "pool": pool,
        "steps": sum(b["steps"] for b in buckets),
        "served_s": served_s,
        "wait_s": wait_s,
        "engine_s": alone_s,
        "served_vs_engine": alone_s / served_s if timed else None,
        "at_batch": at_batch,
        "buckets": buckets,
    }


def _bucket(row: dict, engine: dict | None) -> dict:
    mean = row["requests"] / row["steps"]
    context = row.get("context_tokens", 0) / row["requests"]
    served_ms = row["seconds"] / row["steps"] * 1e3
    wait = row.get("wait_seconds")
    wait_ms = None if wait is None else wait / row["steps"] * 1e3
    alone_ms = engine_step_ms(engine, mean, context) if engine else None
    return {
        "batch_bucket": row["batch"],
        "steps": int(row["steps"]),
        "mean_batch": mean,
        "mean_context": context,
        "step_ms": served_ms,
        "wait_ms": wait_ms,  # of it, the loop waiting for the device; the rest the host's
        "engine_step_ms": alone_ms,
        "served_vs_engine": alone_ms / served_ms if engine else None,
    }


def loop_time_by_kind(steps: list[dict], pool: str) -> dict:
    """A pool's loop time by step kind over a run: seconds, and each kind's share."""
    seconds: dict[str, float] = {}
    for r in steps:
        if r["pool"] == pool:
            seconds[r["kind"]] = seconds.get(r["kind"], 0.0) + r["seconds"]
    total = sum(seconds.values())
    return {k: {"seconds": s, "share": s / total if total else 0.0} for k, s in seconds.items()}
