"""The report of ``serve_bench.py``: Markdown tables, the JSON file, the plot.

The report is a dict: ``workload``, ``arguments``, ``environment`` and one entry a
config with its ``points`` (each with ``summary``, the median run's figures, and
``runs``), ``engine_baseline`` and ``low_load_ttft``. ``write_json`` puts each
request's record on one line, ``read_json`` reads it back; ``plot`` needs matplotlib
and is skipped without it. ``slo_grid``: the SLO attainment map (``slo_grid.py``).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
from pathlib import Path

try:
    import roofline
    import serve_load
except ImportError:  # imported as benchmarks.serve_report (the tests)
    from benchmarks import roofline, serve_load

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def print_tables(report: dict) -> None:
    args = report["arguments"]
    print(f"\nPrompts: {report['workload']}; {args['num_prompts']} requests a load point.")
    slo = f"TTFT <= {args['slo_ttft_ms']} ms, TPOT <= {args['slo_tpot_ms']} ms (None: no SLO)"
    print(f"Goodput: completed requests meeting {slo}.\n")
    rows, latency, low, decode, steps = [], [], [], [], []
    for c in report["configs"]:
        for p in c["points"]:
            s = p["summary"]
            engine = (p.get("engine") or {}).get("output_throughput")
            runs = p["output_throughput_runs"]
            rows.append(
                [c["label"], p["label"], len(runs), f"{min(runs):.0f}-{max(runs):.0f}"]
                + [s["completed"], s["failed"], s["duration_s"]]
                + [s["request_throughput"], s["output_throughput"], s["total_token_throughput"]]
                + [s["goodput"], s["goodput_fraction"], engine, p.get("served_vs_engine")]
            )
            for m in LATENCIES:
                latency.append([c["label"], p["label"], m[:-3].upper(), *s[m].values()])
            if "decode_step_vs_tpot" in p:
                e = p["engine"]
                row = [c["label"], p["label"], e["decode_batch"], e["decode_step_ms"]]
                row += [e.get("decode_tokens_per_step", 1.0), s["tpot_ms"]["p50"]]
                decode.append([*row, p["decode_step_vs_tpot"]])
            if p.get("decode_steps"):
                steps += [[c["label"], p["label"], *row] for row in decode_step_rows(p)]
        if "low_load_ttft" in c:
            t = c["low_load_ttft"]
            served, engine = t["served_ttft_ms"], t.get("engine_ttft_ms") or {}
            idle = t.get("engine_idle_ttft_ms") or {}
            low.append([c["label"], t["requests"], served["p50"], engine.get("p50")])
            low[-1] += [t.get("added_p50_ms"), idle.get("p50"), t.get("added_p50_idle_ms")]
            low[-1] += [served["p90"], engine.get("p90")]
            floor = (t.get("http_floor") or {}).get("floor_ms") or {}
            low[-1] += [floor.get("p50"), t.get("added_over_floor_p50_ms")]
    columns = ["config", "load", "runs", "out tok/s range", "done", "failed", "s", "req/s"]
    columns += ["out tok/s", "total tok/s"]
    columns += ["good req/s", "good frac", "engine out tok/s", "served/eng"]
    roofline.print_table(columns, rows)
    print("\nLatency (ms):")
    roofline.print_table(["config", "load", "metric", "mean", "p50", "p90", "p99"], latency)
    if decode:
        print("\nDecoding: the engine's decode step at the point's batch, alone, a token each")
        print("(the step over a request's tokens a step: above 1 with speculative decoding),")
        print("against the served TPOT p50 (step/TPOT: the decode GPU's served rate over its")
        print("rate alone):")
        columns = ["config", "load", "batch", "engine step ms", "tokens a step"]
        columns += ["served TPOT p50", "step/TPOT"]
        roofline.print_table(columns, decode)
    if steps:
        print("\nThe decode GPU's decode-only steps as its engine loop timed them (the step and")
        print("its outputs sent; 'wait ms': of it, the loop waiting for the device's tokens,")
        print("the rest is the host's own), by batch bucket, against the engine alone's step")
        print("at the same mean batch and context (timed at several batches and two contexts,")
        print("linear between them; '-' where the run had no engine alone); 'all': the time")
        print("over every decode step (ms), and the loop's time by step kind (p/m/d):")
        columns = ["config", "load", "pool", "batch", "steps", "mean batch", "context"]
        columns += ["served ms", "wait ms"]
        roofline.print_table(columns + ["alone ms", "alone/served", "loop time p/m/d"], steps)
    has_slo = args["slo_ttft_ms"] is not None or args["slo_tpot_ms"] is not None
    attained = [slo_rate(c) for c in report["configs"]] if has_slo else []
    if any(r is not None for r in attained):
        print(f"\nHighest request rate with >= {GOOD_SHARE:.0%} of requests within the SLO:")
        rows = [[c["label"], r] for c, r in zip(report["configs"], attained)]
        roofline.print_table(["config", "req/s"], rows)
    if low:
        print("\nTTFT at low load, one request at a time (ms); the engine alone back to back,")
        print("and idle as a prefill worker is while the request decodes elsewhere (idle);")
        print("with --http-floor, an echo app's TTFT less its wait behind the same HTTP stack")
        print("(HTTP floor) and what the serving path adds over it (added over floor):")
        columns = ["config", "requests", "served p50", "engine p50", "added p50"]
        columns += ["engine idle p50", "added vs idle p50", "served p90", "engine p90"]
        roofline.print_table(columns + ["HTTP floor p50", "added over floor"], low)
    split = [
        [c["label"], route, t["requests"], c["low_load_ttft"]["served"]["ttft_ms"]["mean"]]
        + [t.get(part) for part in TTFT_PARTS]
        for c in report["configs"]
        for route, t in (c.get("low_load_ttft") or {}).get("split", {}).items()
    ]
    if split:
        print("\nWhere the low-load TTFT went, means (ms): the client's TTFT, the ingress's, and")
        print("the ingress's split into the engine's queue and prefill and the serving path:")
        columns = ["config", "route", "requests", "client TTFT", *TTFT_PARTS]
        roofline.print_table(columns, split)
    cpu = [
        [c["label"], p["label"], *row]
        for c in report["configs"]
        for p in c["points"]
        for row in cpu_rows(p)
    ]
    if cpu:
        print("\nWhere the CPU went over the point's median run, by process (this process's")
        print("tree: a server the benchmark started), seconds and microseconds a streamed token:")
        roofline.print_table(["config", "load", "process", "CPU s", "us a token"], cpu)
    forwards = [[c["label"], *row] for c in report["configs"] for row in forward_rows(c)]
    if forwards:
        print("\nForwards by step kind over the whole run, warm-up included (/metrics):")
        columns = ["config", "pool", "kind", "graph", "piecewise", "eager", "graphed share"]
        roofline.print_table(columns, forwards)


def cpu_rows(point: dict) -> list[list]:
    """A load point's CPU seconds by process role (``process_cpu``), and per output
    token; none when its server was not in the benchmark's process tree."""
    processes = (point.get("cpu") or {}).get("processes") or {}
    tokens = point["summary"].get("output_tokens") or 0
    if set(processes) <= {"client"}:
        return []
    return [
        [role, seconds, seconds / tokens * 1e6 if tokens else None]
        for role, seconds in processes.items()
    ]


def decode_step_rows(point: dict) -> list[list]:
    """A load point's served decode steps against the engine alone's (``serve_steps``):
    a row a batch bucket, then all of them."""
    d = point["decode_steps"]
    rows = [
        [d["pool"], f"<={b['batch_bucket']}", b["steps"], b["mean_batch"], b["mean_context"]]
        + [b["step_ms"], b.get("wait_ms"), b["engine_step_ms"], b["served_vs_engine"], ""]
        for b in d["buckets"]
    ]
    shares = (point.get("loop_time") or {}).get(d["pool"], {})
    split = "/".join(f"{shares.get(k, {}).get('share', 0.0):.0%}" for k in KINDS)
    alone_ms = d["engine_s"] * 1e3 if d["engine_s"] is not None else None
    wait_ms = d["wait_s"] * 1e3 if d.get("wait_s") is not None else None  # older reports: none
    total = [d["pool"], "all", d["steps"], "", "", d["served_s"] * 1e3, wait_ms, alone_ms]
    return [*rows, [*total, d["served_vs_engine"], split]]


KINDS = ("prefill", "mixed", "decode")  # the engines' step kinds
FORWARDS = re.compile(r'splitserve_forwards_total\{how="(\w+)",kind="(\w+)",pool="(\w+)"\}')


def forwards(metrics: dict[str, float]) -> list[dict]:
    """``splitserve_forwards_total`` of a server's ``/metrics``: one dict a sample."""
    found = [(FORWARDS.fullmatch(name), value) for name, value in metrics.items()]
    return [
        {"pool": m[3], "kind": m[2], "how": m[1], "forwards": int(value)}
        for m, value in found
        if m is not None
    ]


def forward_rows(config: dict) -> list[list]:
    """Per pool and kind: graph, piecewise and eager forwards, and the graph share."""
    by_kind: dict[tuple[str, str], dict[str, int]] = {}
    for f in config.get("forwards") or []:
        by_kind.setdefault((f["pool"], f["kind"]), {})[f["how"]] = f["forwards"]
    rows = []
    for (pool, kind), hows in sorted(by_kind.items()):
        graph, piecewise, eager = (hows.get(h, 0) for h in ("graph", "piecewise", "eager"))
        total = graph + piecewise + eager
        rows.append([pool, kind, graph, piecewise, eager, (graph + piecewise) / total])
    return rows


TTFT_PARTS = {  # the ingress's TTFT histograms (``cluster/metrics.py``), by their part
    "ingress TTFT": "splitserve_time_to_first_token_seconds",
    "engine queue": "splitserve_request_queue_time_seconds",
    "engine prefill": "splitserve_request_prefill_time_seconds",
    "serving path": "splitserve_time_to_first_token_serving_path_seconds",
}


def ttft_samples(metrics: dict[str, float]) -> dict[str, float]:
    """The samples of the TTFT histograms in a server's ``/metrics``."""
    return {k: v for k, v in metrics.items() if k.startswith(tuple(TTFT_PARTS.values()))}


def ttft_split(before: dict[str, float], after: dict[str, float]) -> dict[str, dict]:
    """Per route, the mean of each TTFT part (ms) over the requests between two reads of
    ``/metrics``, and how many there were."""
    out: dict[str, dict] = {}
    for name, value in after.items():
        route = re.fullmatch(r'splitserve_time_to_first_token_seconds_count\{route="(\w+)"\}', name)
        if route is None or value == before.get(name, 0):
            continue
        label = f'{{route="{route[1]}"}}'
        count = value - before.get(name, 0)
        split = {"requests": int(count)}
        for part, family in TTFT_PARTS.items():
            key = f"{family}_sum{label}"
            if key in after:
                split[part] = 1e3 * (after[key] - before.get(key, 0.0)) / count
        out[route[1]] = split
    return out


GOOD_SHARE = 0.9  # a rate is attained when this share of its requests meets the SLO


def slo_rate(config: dict) -> float | None:
    """The highest open-loop rate at which ``GOOD_SHARE`` of requests met the SLO
    (DistServe's SLO attainment), or None without rate points or SLOs."""
    rates = rate_points(config)
    if not rates:
        return None
    good = [p["value"] for p in rates if p["summary"]["goodput_fraction"] >= GOOD_SHARE]
    return max(good, default=0.0)


def rate_points(config: dict) -> list[dict]:
    """The open-loop points at a finite rate (``inf`` comes back from the JSON as None),
    by rate."""
    rates = [p for p in config["points"] if p["mode"] == "rate"]
    return sorted(
        (p for p in rates if p["value"] not in (None, math.inf)), key=lambda p: p["value"]
    )


def summary_run(point: dict) -> dict:
    """The run behind a point's ``summary``: its median run (``serve_bench.run_point``)."""
    for run in point["runs"]:
        if run["summary"] == point["summary"]:
            return run
    raise ValueError(
        f"point {point['label']}: none of its {len(point['runs'])} runs has its summary"
    )


REQUEST_FIELDS = {f.name for f in dataclasses.fields(serve_load.RequestResult)}


def request_results(records: list[dict]) -> list[serve_load.RequestResult]:
    """A run's request records back as ``RequestResult`` (fields it does not know dropped)."""
    return [
        serve_load.RequestResult(**{k: v for k, v in r.items() if k in REQUEST_FIELDS})
        for r in records
    ]


def attainment(results: list, ttft_ms: float | None, tpot_ms: float | None) -> float:
    """The share of the sent requests that met both SLOs: ``summarize``'s goodput_fraction."""
    good = sum(serve_load.meets_slo(r, ttft_ms, tpot_ms) for r in results)
    return good / len(results) if results else 0.0


def slo_grid(
    report: dict,
    ttft_ms_values: list[float],
    tpot_ms_values: list[float],
    share=GOOD_SHARE,
    ratio_of: tuple[str, str] | None = None,
) -> dict:
    """The SLO attainment map: per config and (TTFT, TPOT) SLO pair, the highest rate
    swept at which ``share`` of the sent requests met both (the point's median run), like
    ``slo_rate``; None when no rate passed. ``capped``: it passed at the highest rate swept,
    so the figure is a lower bound. ``ratio``: the rate of ``ratio_of``'s first config label
    over its second's (the report's first two configs by default)."""
    pairs = [(ttft, tpot) for tpot in tpot_ms_values for ttft in ttft_ms_values]
    configs = [config_grid(c, pairs, share) for c in report["configs"]]
    grid = {"workload": report["workload"], "share": share, "ttft_ms": list(ttft_ms_values)}
    grid.update(tpot_ms=list(tpot_ms_values), configs=configs)
    by_label = {c["label"]: c for c in configs}
    if ratio_of is not None:
        missing = [label for label in ratio_of if label not in by_label]
        if missing:
            raise ValueError(
                f"no config labelled {missing[0]!r}: the reports have {list(by_label)}"
            )
        grid["ratio"] = ratio_grid(by_label[ratio_of[0]], by_label[ratio_of[1]])
    elif len(configs) >= 2:
        grid["ratio"] = ratio_grid(*configs[:2])
    return grid


def config_grid(config: dict, pairs: list[tuple[float, float]], share: float) -> dict:
    points = rate_points(config)
    results = [request_results(summary_run(p)["requests"]) for p in points]
    swept = [
        {"rate": p["value"], "sent": len(r), "source": p.get("source")}
        for p, r in zip(points, results)
    ]
    cells = []
    for ttft, tpot in pairs:
        passed = [p["value"] for p, r in zip(points, results) if attainment(r, ttft, tpot) >= share]
        rate = max(passed, default=None)
        capped = rate is not None and rate == points[-1]["value"]
        cells.append({"ttft_ms": ttft, "tpot_ms": tpot, "rate": rate, "capped": capped})
    return {"label": config["label"], "points": swept, "cells": cells}


RATIO_BOUNDS = {  # (first capped, second capped): what the ratio of the rates is
    (False, False): "exact",
    (True, False): "lower",  # the first config might pass at a higher rate
    (False, True): "upper",
    (True, True): "none",
}


def ratio_grid(first: dict, second: dict) -> dict:
    """Per SLO pair, the first config's rate over the second's, when both have one."""
    cells = []
    for a, b in zip(first["cells"], second["cells"]):
        cell = {"ttft_ms": a["ttft_ms"], "tpot_ms": a["tpot_ms"], "ratio": None, "bound": None}
        if a["rate"] is not None and b["rate"] is not None:
            cell.update(ratio=a["rate"] / b["rate"], bound=RATIO_BOUNDS[a["capped"], b["capped"]])
        cells.append(cell)
    return {"of": [first["label"], second["label"]], "cells": cells}


def print_slo_grid(grid: dict) -> None:
    """A table per config (rows: TPOT SLO, columns: TTFT SLO) and one of the ratio."""
    print(f"\nLoad: {grid['workload']}.")
    print(f"SLO attainment: the highest open-loop rate (req/s) at which >= {grid['share']:.0%} of")
    print("the sent requests met both the TTFT and the TPOT SLO (each point's median run);")
    print(">=R: it passed at the highest rate swept, R is a lower bound; -: no rate passed.")
    for c in grid["configs"]:
        print(f"\n{c['label']}: {sweep_text(c['points'])}")
        _print_cells(grid, c["cells"], lambda cell: _bounded(cell["rate"], ">=" * cell["capped"]))
    if "ratio" in grid:
        first, second = grid["ratio"]["of"]
        print(f"\n{first} over {second} (rate over rate; >=: {first} passed at its highest")
        print(f"rate swept, a lower bound; <=: {second} did, an upper bound; ?: both did):")
        marks = {"exact": "", "lower": ">=", "upper": "<=", "none": "?", None: ""}
        cells = grid["ratio"]["cells"]
        _print_cells(grid, cells, lambda cell: _bounded(cell["ratio"], marks[cell["bound"]], 2))


def _print_cells(grid: dict, cells: list[dict], text) -> None:
    columns = ["TPOT SLO", *(f"TTFT {t:g} ms" for t in grid["ttft_ms"])]
    width = len(grid["ttft_ms"])
    rows = [
        [f"{tpot:g} ms", *(text(c) for c in cells[i * width : (i + 1) * width])]
        for i, tpot in enumerate(grid["tpot_ms"])
    ]
    roofline.print_table(columns, rows)


def _bounded(value: float | None, mark: str, digits: int | None = None) -> str:
    if value is None:
        return "-"
    return mark + (f"{value:.{digits}f}" if digits is not None else f"{value:g}")


def sweep_text(points: list[dict]) -> str:
    """The rates swept, grouped by the file they came from and the requests each sent."""
    groups: list[tuple[tuple, list[float]]] = []
    for p in points:
        key = (p["sent"], p["source"])
        if groups and groups[-1][0] == key:
            groups[-1][1].append(p["rate"])
        else:
            groups.append((key, [p["rate"]]))
    parts = [
        f"rates {', '.join(f'{r:g}' for r in rates)} ({sent} requests a point"
        + (f", {source})" if source else ")")
        for (sent, source), rates in groups
    ]
    return "; ".join(parts) or "no open-loop rates"


def read_json(path: Path) -> dict:
    """A report as ``write_json`` wrote it (gzipped when ``path`` ends in ``.gz``)."""
    path = Path(path)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def write_json(path: Path, report: dict) -> None:
    """Indented JSON with each request's record on one line; NaN and inf become null;
    gzipped when ``path`` ends in ``.gz`` (the per-request records run to megabytes)."""
    records: dict[str, str] = {}

    def shrink(value):
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, list):
            return [shrink(v) for v in value]
        if not isinstance(value, dict):
            return value
        value = {k: shrink(v) for k, v in value.items()}
        if "itl_s" in value:  # a request's record
            key = f"@request{len(records)}@"
            records[key] = json.dumps(value, separators=(",", ":"), allow_nan=False)
            return key
        return value

    text = json.dumps(shrink(report), indent=2, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = re.sub(r'"(@request\d+@)"', lambda m: records[m.group(1)], text) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


def plot(path: Path, report: dict) -> None:
    """p50 (solid) and p90 (dashed) TTFT, TPOT and E2E, and goodput, per load mode."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({p["mode"] for c in report["configs"] for p in c["points"]})
    panels = ["ttft_ms", "tpot_ms", "e2e_ms", "goodput"]
    fig, axes = plt.subplots(len(modes), 4, figsize=(16, 3.6 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        for i, c in enumerate(report["configs"]):
            points = sorted((p for p in c["points"] if p["mode"] == mode), key=lambda p: p["value"])
            x = list(range(len(points)))
            for ax, panel in zip(row, panels):
                ys = [p["summary"][panel] for p in points]
                if panel == "goodput":
                    ax.plot(x, ys, "o-", color=f"C{i}", label=c["label"])
                    continue
                ax.plot(x, [y["p50"] for y in ys], "o-", color=f"C{i}", label=f"{c['label']} p50")
                ax.plot(x, [y["p90"] for y in ys], "s--", color=f"C{i}", label=f"{c['label']} p90")
            for ax in row:
                ax.set_xticks(x, [p["label"].split("=")[1] for p in points])
        for ax, panel in zip(row, panels):
            ax.set_xlabel("request rate (req/s)" if mode == "rate" else "concurrency")
            ax.set_ylabel("goodput (req/s)" if panel == "goodput" else f"{panel[:-3].upper()} ms")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
        args = report["arguments"]
        row[3].set_title(
            f"SLO: TTFT {args['slo_ttft_ms']} ms, TPOT {args['slo_tpot_ms']} ms", fontsize=8
        )
    fig.suptitle(f"splitserve serve_bench: {report['workload']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
