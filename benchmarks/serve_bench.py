"""The serving benchmark: streamed completions against ``splitserve serve``, under load.

    python benchmarks/serve_bench.py --config configs/serve/default.yaml [--config ...]
        [--input-len 64 --output-len 64 | --prompts-file F.jsonl] [--num-prompts 128]
        [--request-rate 1 4 inf] [--max-concurrency 1 16 64]
        [--slo-ttft-ms 200 --slo-tpot-ms 20] [--engine-baseline] [--low-load-ttft 20 [--http-floor]]
        [--torch-profiler-dir DIR] [--json PATH] [--plot PATH.png]
    python benchmarks/serve_bench.py --url http://host:8000 [--config ITS_CONFIG] ...

Each ``--config`` in turn: its ``splitserve serve`` is started on a free port (or
``--port``), waited for on ``/health``, and stopped with SIGINT at the end;
``--url`` measures a running server instead. A load point sends ``--num-prompts``
requests open-loop (``--request-rate``: Poisson arrivals, ``inf``: all at once)
or closed-loop (``--max-concurrency``); ``serve_load.py`` times every request,
``serve_report.py`` prints the tables and writes the JSON and the plot.
Prompts are random token ids (a simulated load shape), new ones each point (no
prefix-cache hits between points), the same across configs; ``--prompts-file``
gives real ones (the same every point: later points may hit the prefix cache,
counted as ``cached_prompt_tokens``).

``--json`` is also written after each stage (the engine alone, the low-load TTFT,
each load point), marked ``"partial": true``: a run cut short (a ``timeout`` around
it) keeps what it measured; the last write has no mark.

``--repeat N`` runs each point N times on new prompts; a point's figures are
its median run's (by output tokens/s), every run is in the JSON.

``--torch-profiler-dir DIR`` runs each point's first run under every engine's
torch.profiler (``POST /start_profile`` before it, ``/stop_profile`` after; a started
server writes into ``DIR/<config name>``): the traces' paths are in that run's JSON,
and ``trace_steps.py`` reads them. That run's figures carry the profiler's cost.

``--engine-baseline`` runs ``LLM`` built from the config's ``engine:`` section on
the same prompts, before the server starts (``serve_engine.py``): served over
engine output tokens/s for each closed-loop point (the engine's ``max_num_seqs``
lowered to the concurrency) and for the highest-rate point (``max_num_seqs`` as
configured). ``--low-load-ttft N`` sends N requests one at a time and reports
the served p50 TTFT minus the engine's p50 TTFT for the same prompts: what the
serving path adds at low load; the engine alone runs them back to back (as a mixed
worker sees them) and on a prefill worker's duty cycle (idle while the request
decodes elsewhere; "idle" columns): a disaggregated route's prefill worker computes
each prompt after idling, which on its own makes it slower. From the server's
``/metrics``, where the TTFT went per route: the engine's queue and prefill, the
serving path's share. ``--http-floor`` then times an echo app that does no model work
behind the same Ray Serve and HAProxy (``http_floor.py``), on the same prompts, its
first chunk after the engine's own TTFT: the HTTP stack's floor under the low-load
TTFT, and what the serving path adds over it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import functools
import time
from pathlib import Path

import yaml

from splitserve.cluster.serve_command import default_config_path

try:
    import http_floor
    import roofline
    import serve_engine
    import serve_load
    import serve_process as sp
    import serve_report
    import serve_steps
except ImportError:  # imported as benchmarks.serve_bench (the tests)
    from benchmarks import http_floor, roofline, serve_engine, serve_load, serve_report, serve_steps
    from benchmarks import serve_process as sp

DEFAULT_VOCAB_SIZE = 256  # below the tiny presets' 512, for servers whose model is unknown
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class LoadPoint:
    mode: str  # "rate" or "concurrency"
    value: float
    runs: list[list[serve_load.RequestSpec]]  # one prompt set a repetition

    @property
    def label(self) -> str:
        value = "inf" if self.value == float("inf") else f"{self.value:g}"
        return f"{self.mode}={value}"


# --- the workload --------------------------------------------------------------------


def vocab_size_of(model: str | None) -> int:
    """The model's vocab (read from its HF config or preset), else DEFAULT_VOCAB_SIZE."""
    try:
        from splitserve.workers.model.loader import load_hf_config

        return int(load_hf_config(model)[0].vocab_size)
    except Exception as e:
        print(f"warning: vocab of {model!r} unknown ({e}); ids below {DEFAULT_VOCAB_SIZE}")
        return DEFAULT_VOCAB_SIZE


def prompts(args, vocab_size: int, tag: str, num: int) -> list[serve_load.RequestSpec]:
    if args.prompts_file and tag not in ("warmup", "low-load"):
        return serve_load.read_prompts_file(args.prompts_file, args.output_len)[:num]
    return serve_load.random_prompts(
        num, args.input_len, args.input_len_range, args.output_len, vocab_size, f"{args.seed}/{tag}"
    )


def load_points(args, vocab_size: int) -> list[LoadPoint]:
    shapes = [("rate", r) for r in args.request_rate or []]
    shapes += [("concurrency", c) for c in args.max_concurrency or []]
    points = [LoadPoint(mode, value, []) for mode, value in shapes or [("rate", float("inf"))]]
    for p in points:
        tags = [p.label] + [f"{p.label}/{i}" for i in range(1, args.repeat)]
        p.runs = [prompts(args, vocab_size, tag, args.num_prompts) for tag in tags]
    return points


def baseline_spec(
    engine: dict, points: list[LoadPoint], warmup, low_load, threads: int | None
) -> dict:
    """The closed-loop points, and the highest-rate point at the configured max_num_seqs."""
    rates = [p for p in points if p.mode == "rate"]
    chosen = [p for p in points if p.mode == "concurrency"]
    chosen += [max(rates, key=lambda p: p.value)] if rates else []

    def requests(specs):
        return {"prompts": [s.prompt for s in specs], "max_tokens": [s.max_tokens for s in specs]}

    return {
        "engine": engine,
        "threads": threads,
        "warmup": [s.prompt for s in warmup],
        "max_tokens": warmup[0].max_tokens,
        "points": [
            {
                "label": p.label,
                "runs": [requests(specs) for specs in p.runs],
                "max_num_seqs": int(p.value) if p.mode == "concurrency" else None,
            }
            for p in chosen
        ],
        "ttft": requests(low_load) if low_load else None,
    }


# --- one config ----------------------------------------------------------------------


def run(url: str, specs, mode: str, value: float, args, seed: str):
    return asyncio.run(
        serve_load.run_load(
            f"{url}/v1/completions",
            specs,
            mode,
            value,
            seed=f"{args.seed}/{seed}",
            token_ids=not args.no_token_ids,
            timeout_s=args.timeout,
        )
    )


def bench_target(args, config: Path | None, url: str | None, progress=None) -> dict:
    """One config's (or URL's) figures; ``progress(out)`` after each stage (the engine
    alone, the low-load TTFT, each load point) with what is measured so far."""
    progress = progress or (lambda out: None)
    values = (yaml.safe_load(config.read_text()) or {}) if config else {}
    engine = dict(values.get("engine") or {})
    if args.model:
        engine["model"] = args.model
    model = engine.get("model", "qwen3-tiny") if config else None
    if url and not model:
        model = sp.get_json(f"{url}/v1/models")["data"][0].get("root")
    vocab = args.vocab_size or vocab_size_of(model)
    points = load_points(args, vocab)
    warmup = prompts(args, vocab, "warmup", max(1, args.warmup))
    low_load = prompts(args, vocab, "low-load", args.low_load_ttft) if args.low_load_ttft else []
    out = {"label": config.stem if config else url, "config": str(config) if config else None}
    out.update(config_values=values, model=model, vocab_size=vocab)
    out["background_cpu"] = warn_if_busy(sp.background_cpu(), "before the run")
    baseline = None
    if args.engine_baseline:
        if not config:
            raise SystemExit("--engine-baseline needs --config (the engine: section to build)")
        print(f"[{out['label']}] engine alone (LLM) on the same prompts ...", flush=True)
        spec, probe = (
            baseline_spec(engine, points, warmup, low_load, args.engine_threads),
            sp.CpuProbe(),
        )
        baseline = out["engine_baseline"] = serve_engine.engine_baseline(spec)
        baseline["cpu"] = warn_if_busy(probe.stop(), "during the engine baseline")
        progress(out)
    if url:
        target = contextlib.nullcontext(url)
    else:
        host = values.get("host", "127.0.0.1")
        extra = []
        if args.torch_profiler_dir:  # a folder per config: its traces named by it
            extra = ["--torch-profiler-dir", str(Path(args.torch_profiler_dir) / out["label"])]
        target = sp.served(
            config, host, args.model, args.port, args.startup_timeout, args.server_log, extra
        )
    with target as base:
        out["served_models"] = sp.get_json(f"{base}/v1/models")["data"]
        run(base, warmup, "rate", float("inf"), args, "warmup")
        if low_load:
            before = sp.metric_values(base)
            results, seconds = run(base, low_load, "concurrency", 1, args, "low-load")
            out["low_load_ttft"] = low_load_report(results, seconds, baseline)
            split = serve_report.ttft_split(before, settled_ttft_samples(base))
            out["low_load_ttft"]["split"] = split
            progress(out)
        out["points"] = []
        for point in points:
            out["points"].append(run_point(args, out["label"], base, point, baseline))
            progress(out)
        out["forwards"] = settled_forwards(base)  # graph hits
    if args.http_floor and low_load:  # the server is gone: its CPUs are free again
        out["low_load_ttft"].update(floor_report(values, warmup + low_load, len(warmup), out))
        progress(out)
    return out


def floor_report(values: dict, specs, warmup: int, out: dict) -> dict:
    """The HTTP floor under the low-load TTFT (``http_floor.py``): the echo app behind the
    same Ray Serve and HAProxy, the same prompts, its first chunk after the engine's own
    TTFT (the engine alone's p50, else the served engine's queue and prefill)."""
    proxy = (values.get("http") or {}).get("proxy", "haproxy")
    if proxy != "haproxy":
        return {"http_floor": None, "http_floor_note": f"not measured for http.proxy: {proxy}"}
    low = out["low_load_ttft"]
    wait = engine_ttft_ms(low)
    print(f"[{out['label']}] HTTP floor: an echo app, first chunk after {wait:.2f} ms ...")
    with http_floor.haproxy_front(120.0) as url:
        floor = http_floor.measure(url, specs, warmup, wait)
    added = low.get("added_p50_ms")
    over = added - floor["floor_ms"]["p50"] if added is not None else None
    return {"http_floor": floor, "added_over_floor_p50_ms": over}


def engine_ttft_ms(low_load: dict) -> float:
    """The engine's own TTFT at low load: the engine alone's p50, else the served engine's
    queue and prefill (means, from ``/metrics``; 0 without either)."""
    engine = (low_load.get("engine_ttft_ms") or {}).get("p50")
    if engine is None:
        split = next(iter(low_load.get("split", {}).values()), {})
        engine = split.get("engine queue", 0.0) + split.get("engine prefill", 0.0)
    return round(engine, 3)


def settled(read, period_s: float, timeout_s: float):
    """``read()`` once two reads ``period_s`` apart agree (the workers' and ingress
    replicas' reports reach ``/metrics`` periodically), or the last one at the timeout."""
    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        time.sleep(period_s)
        now = read()
        if now == last:
            break
        last = now
    return last


def settled_forwards(url: str) -> list[dict]:
    """The server's forwards by step kind once its workers' reports caught up (more than
    a report's way from an engine to ``/metrics`` between reads)."""
    return settled(lambda: serve_report.forwards(sp.metric_values(url)), 1.0, 10.0)


def settled_counters(url: str) -> dict:
    """Requests per route and outcome, and the engines' step counters (``serve_steps``),
    from one ``/metrics`` read once every ingress replica's and engine's report is in."""

    def read() -> dict:
        try:
            values = sp.metric_values(url)
        except OSError:  # a server without /metrics (--url): nothing to count
            values = {}
        return {"routes": sp.route_counts_of(values), "steps": serve_steps.step_times(values)}

    return settled(read, 0.5, 10.0)


def settled_ttft_samples(url: str) -> dict[str, float]:
    """The ingress's TTFT histograms once every ingress replica's post is in."""
    return settled(lambda: serve_report.ttft_samples(sp.metric_values(url)), 0.5, 5.0)


def one_run(args, url: str, point: LoadPoint, specs, seed: str, profiled: bool = False) -> dict:
    """One repetition of a point: its summary, the routes its requests took, the CPU, each
    request, and the engines' own steps over it; ``profiled``: under every engine's
    torch.profiler, the traces' paths in it too."""
    before = settled_counters(url)  # the warm-up's and the last run's all in
    if profiled:
        sp.post_json(f"{url}/start_profile")
    probe = sp.CpuProbe()
    results, seconds = run(url, specs, point.mode, point.value, args, seed)
    cpu = warn_if_busy(probe.stop(), f"during {point.label}")
    traces = sp.post_json(f"{url}/stop_profile", timeout=600.0)["engines"] if profiled else None
    after = settled_counters(url)
    summary = serve_load.summarize(results, seconds, args.slo_ttft_ms, args.slo_tpot_ms)
    old, new = before["routes"], after["routes"]
    routes = {k: v - old.get(k, 0) for k, v in new.items() if v != old.get(k, 0)}
    steps = serve_steps.difference(before["steps"], after["steps"])
    requests = [r.record() for r in results]
    out = {"summary": summary, "routes": routes, "cpu": cpu, "steps": steps, "requests": requests}
    if traces is not None:
        out["traces"] = traces  # each engine's trace: its pool, worker and path
        print(f"profiled: {', '.join(t['trace'] for t in traces)}", flush=True)
    return out


def run_point(args, label: str, url: str, point: LoadPoint, baseline: dict | None) -> dict:
    """Each repetition on its own prompts; the figures are the median run's (by output
    tokens/s), each run's are in ``runs``."""
    engine = (baseline or {}).get("points", {}).get(point.label)
    decode_alone = engine if engine and "decode_step_ms" in engine else None
    runs = []
    for i, specs in enumerate(point.runs):
        profiled = args.torch_profiler_dir is not None and i == 0  # a point's first run
        runs.append(one_run(args, url, point, specs, f"{point.label}/{i}", profiled))
        summary, routes, cpu = runs[-1]["summary"], runs[-1]["routes"], runs[-1]["cpu"]
        print(
            f"[{label}] {point.label} run {i + 1}/{len(point.runs)}: {summary['completed']}/"
            f"{summary['sent']} done in {summary['duration_s']:.2f} s, "
            f"{summary['output_throughput']:.0f} out tok/s, TTFT p50 "
            f"{summary['ttft_ms']['p50'] or 0:.1f} ms, routes {routes}, "
            f"client CPU {cpu['client'] or 0:.0%} of the machine",
            flush=True,
        )
    throughputs = [r["summary"]["output_throughput"] for r in runs]
    out = {"mode": point.mode, "value": point.value, "label": point.label}
    median = runs[median_index(throughputs)]
    out["summary"] = median["summary"]
    out["cpu"] = median["cpu"]  # with its CPU seconds by process role
    out["output_throughput_runs"] = throughputs
    out["loop_time"] = {
        pool: serve_steps.loop_time_by_kind(median["steps"], pool)
        for pool in sorted({r["pool"] for r in median["steps"]})
    }
    out["decode_steps"] = serve_steps.decode_against_engine(median["steps"], decode_alone)
    if engine:
        out["engine"] = {k: v for k, v in engine.items() if k != "runs"}
        out["served_vs_engine"] = out["summary"]["output_throughput"] / engine["output_throughput"]
        out["served_vs_engine_runs"] = [
            t / e["output_throughput"] for t, e in zip(throughputs, engine["runs"])
        ]
        tpot = out["summary"]["tpot_ms"]["p50"]
        token_ms = engine.get("decode_token_ms", engine.get("decode_step_ms"))
        if token_ms and tpot:  # the decode GPU, served against alone, a token each
            out["decode_step_vs_tpot"] = token_ms / tpot
    out["runs"] = runs
    return out


def median_index(values: list[float]) -> int:
    """The index of the median (the lower one of an even count)."""
    return sorted(range(len(values)), key=values.__getitem__)[(len(values) - 1) // 2]


def warn_if_busy(cpu: dict, when: str) -> dict:
    """``cpu`` (a ``CpuProbe`` reading), after a warning if others used over 5% of the CPU."""
    if (cpu["foreign"] or 0) > 0.05:
        print(f"warning: other processes took {cpu['foreign']:.0%} of the CPU {when}")
    return cpu


def low_load_report(results, seconds: float, baseline: dict | None) -> dict:
    summary = serve_load.summarize(results, seconds)
    out = {"requests": len(results), "served": summary, "served_ttft_ms": summary["ttft_ms"]}
    served_p50 = summary["ttft_ms"]["p50"]
    for key, name in (("ttft_s", ""), ("ttft_idle_s", "_idle")):
        if baseline and baseline.get(key):
            engine = serve_load.latency_stats(baseline[key])
            out[f"engine{name}_ttft_ms"] = engine
            if served_p50 is not None:
                out[f"added_p50{name}_ms"] = served_p50 - engine["p50"]
    return out


# --- the command ---------------------------------------------------------------------


def workload_text(args) -> str:
    if args.prompts_file:
        return f"prompts from {args.prompts_file}, greedy, ignore_eos"
    return (
        f"random token ids (a simulated load shape): input {args.input_len} "
        f"(+-{100 * args.input_len_range:g}%), output {args.output_len}, greedy, ignore_eos"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--config", type=Path, nargs="+", action="extend", default=[], help="serve configs, in turn"
    )
    p.add_argument("--url", help="a running server (http://host:port) instead of starting one")
    p.add_argument("--model", help="passed to splitserve serve --model (and the engine baseline)")
    p.add_argument("--port", type=int, help="the started server's port (default: a free one)")
    p.add_argument("--vocab-size", type=int, help="random ids below this (default: the model's)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--input-len-range", type=float, default=0.0, help="lengths +- this share")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens, with ignore_eos")
    p.add_argument("--prompts-file", type=Path, help='JSONL: {"prompt": ...} or token ids')
    p.add_argument("--num-prompts", type=int, default=128, help="requests per load point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, nargs="+", help="open-loop rates (inf: burst)")
    p.add_argument("--max-concurrency", type=int, nargs="+", help="closed-loop concurrencies")
    p.add_argument("--repeat", type=int, default=1, help="runs a point (new prompts each)")
    p.add_argument("--warmup", type=int, default=8, help="requests sent before measuring")
    p.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    p.add_argument("--engine-baseline", action="store_true", help="LLM alone on the same prompts")
    p.add_argument("--engine-threads", type=int, help="torch threads of the engine alone")
    p.add_argument("--low-load-ttft", type=int, default=0, metavar="N", help="N requests, 1 by 1")
    p.add_argument("--no-token-ids", action="store_true", help="don't ask for return_token_ids")
    p.add_argument(
        "--http-floor",
        action="store_true",
        help="with --low-load-ttft: after the server stops, time an echo app behind the same "
        "HTTP stack on the same prompts (http_floor.py): the TTFT added over that floor",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a read may wait")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--server-log", type=Path, help="append the started servers' output here")
    p.add_argument(
        "--torch-profiler-dir",
        metavar="DIR",
        help="each load point's first run under every engine's torch.profiler (POST "
        "/start_profile, /stop_profile); a started server writes its traces into "
        "DIR/<config name> (a server at --url needs its own --torch-profiler-dir); read "
        "them with trace_steps.py. The profiled run's figures carry the profiler's cost",
    )
    p.add_argument("--json", type=Path, help="write every point and request here")
    p.add_argument("--plot", type=Path, help="PNG of latency and goodput against load")
    args = p.parse_args(argv)
    if not args.config and not args.url:
        args.config = [default_config_path()]
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be >= 1")
    if args.url and len(args.config) > 1:
        p.error("--url takes at most one --config (the engine: section of that server)")
    if args.http_floor and (args.url or not args.low_load_ttft):
        p.error("--http-floor needs --low-load-ttft and a --config started here (not --url)")
    if any(c < 1 for c in args.max_concurrency or []) or any(
        not r > 0 for r in args.request_rate or []
    ):
        p.error("--max-concurrency values must be >= 1 and --request-rate values > 0")
    return args


def write_partial(path: Path, report: dict, config: dict) -> None:
    """The report so far, ``config`` (the one running) last, marked ``partial``: a run cut
    short (a ``timeout`` around it) keeps what it measured."""
    serve_report.write_json(
        path, {**report, "configs": [*report["configs"], config], "partial": True}
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command = roofline.command_line("serve_bench.py", ("--json", "--plot"))
    report = {
        "benchmark": "serve_bench",
        "workload": workload_text(args),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": {
            **roofline.environment(command),
            **sp.git_commit(REPO),
            "host": sp.host_info(),
            "http_client": "aiohttp" if serve_load.aiohttp is not None else "httpx",
        },
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "configs": [],
    }
    report["arguments"]["config"] = [str(c) for c in args.config]
    targets = (
        [(c, None) for c in args.config]
        if not args.url
        else [(args.config[0] if args.config else None, args.url.rstrip("/"))]
    )
    for config, url in targets:
        progress = functools.partial(write_partial, args.json, report) if args.json else None
        report["configs"].append(bench_target(args, config, url, progress))
        report["configs"][-1]["slo_rate"] = serve_report.slo_rate(report["configs"][-1])
    serve_report.print_tables(report)
    if args.json:
        serve_report.write_json(args.json, report)
    if args.plot:
        serve_report.plot(args.plot, report)
    return report


if __name__ == "__main__":
    main()
