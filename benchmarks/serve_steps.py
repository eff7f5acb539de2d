"""The served engines' steps, for ``serve_bench.py``: the decode GPU's rate, served
against the engine alone, read from the engines themselves.

A served request's TPOT mixes the decode steps with whatever else shares its GPU
(a prompt computed there, a batch that has not filled yet). The engines count their
loop's turns by step kind and batch (``splitserve_engine_steps_total``,
``..._step_requests_total``, ``..._step_seconds_total`` on ``/metrics``,
``workers/engine/step_times.py``); a load point's difference of two reads gives the
decode-only steps at each batch, and at the batch the engine alone was timed at
(``serve_engine.decode_step``) the two rates compare step for step.
"""

from __future__ import annotations

import re

STEP_METRIC = re.compile(
    r"splitserve_engine_(steps|step_requests|step_seconds)_total"
    r'\{batch="(\d+)",kind="(\w+)",pool="(\w+)"\}'
)
FIELDS = {"steps": "steps", "step_requests": "requests", "step_seconds": "seconds"}
DECODE_POOLS = ("decode", "mixed")


def step_times(metrics: dict[str, float]) -> list[dict]:
    """The engines' step counters of a server's ``/metrics``, one dict a pool, kind and
    batch bucket: ``{pool, kind, batch, steps, requests, seconds}``."""
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
        delta = {k: row.get(k, 0) - old.get(k, 0) for k in FIELDS.values()}
        if delta["steps"] > 0:
            out.append({"pool": row["pool"], "kind": row["kind"], "batch": row["batch"], **delta})
    return out


def decode_at_batch(steps: list[dict], engine: dict) -> dict | None:
    """The served decode-only steps in the batch bucket that holds the engine alone's
    decode batch, or the nearest above it (the decode pool's, else the mixed pool's),
    against the engine alone's step: tokens a second each (a request a step; with
    speculative decoding, a verify step's requests), and served over alone. None when
    no decode step of that batch or above ran."""
    batch = engine["decode_batch"]
    for pool in DECODE_POOLS:
        rows = [r for r in steps if (r["pool"], r["kind"]) == (pool, "decode")]
        rows = [r for r in rows if r["batch"] >= batch and r["seconds"] > 0]
        if rows:  # the bucket that holds the engine's batch: the smallest edge above it
            row = min(rows, key=lambda r: r["batch"])
            break
    else:
        return None
    served_tok_s = row["requests"] / row["seconds"]
    engine_tok_s = engine["decode_batch"] / (engine["decode_step_ms"] / 1e3)
    return {
        "pool": row["pool"],
        "batch_bucket": row["batch"],
        "steps": int(row["steps"]),
        "mean_batch": row["requests"] / row["steps"],
        "step_ms": row["seconds"] / row["steps"] * 1e3,
        "tok_s": served_tok_s,
        "engine_batch": engine["decode_batch"],
        "engine_step_ms": engine["decode_step_ms"],
        "engine_tok_s": engine_tok_s,
        "served_vs_engine": served_tok_s / engine_tok_s,
    }


def decode_share(steps: list[dict], pool: str) -> dict:
    """A pool's loop time by step kind over a run: seconds, and each kind's share."""
    seconds: dict[str, float] = {}
    for r in steps:
        if r["pool"] == pool:
            seconds[r["kind"]] = seconds.get(r["kind"], 0.0) + r["seconds"]
    total = sum(seconds.values())
    return {k: {"seconds": s, "share": s / total if total else 0.0} for k, s in seconds.items()}
