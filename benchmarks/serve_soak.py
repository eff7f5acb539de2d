"""Soak: many requests against ``splitserve serve`` with client disconnects and aborts;
reports the KV blocks each worker replica still holds afterwards (must be 0) and the
workers' memory (RSS) before and after.

Starts ``splitserve serve`` (the embedded default unless ``--config``) on a free port,
or measures ``--url``'s server (then on this machine: RSS is read from ``/proc``).
After a warm-up it records the RSS of every worker replica and its engine process,
then sends ``--requests`` completions, ``--concurrency`` at a time: short prompts
(computed on the decode worker) and long ones (handed off from the prefill worker),
streamed or whole. ``--disconnect-share`` of them are dropped by the client
mid-stream, after a random number of events; ``--abort-share`` more are abandoned at a
random moment (a client timeout: queued, prefilling, handing off or decoding). When
the load is done and the workers are idle it reads every replica's free and usable
KV blocks and the RSS again. ``--json PATH`` keeps the table and the outcome counts.

    python benchmarks/serve_soak.py --requests 10000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import metric_values, served  # noqa: E402

from splitserve.cluster.serve_command import default_config_path  # noqa: E402

STARTUP_S = 600.0  # the server's start, /health answering 200

WORDS = [
    "prefill",
    "decode",
    "block",
    "cache",
    "token",
    "stream",
    "worker",
    "replica",
    "ingress",
    "route",
]


def replicas(url: str) -> dict[str, dict[str, float]]:
    """replica label set -> its gauges (free and usable blocks, pids), from /metrics."""
    out: dict[str, dict[str, float]] = {}
    for name, value in metric_values(url).items():
        m = re.match(r"splitserve_(kv_free_blocks|kv_blocks|worker_pid|engine_pid)\{(.*)\}", name)
        if m:
            out.setdefault(m.group(2), {})[m.group(1)] = value
    return out


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory(url: str) -> dict[str, dict[str, float | None]]:
    return {
        label: {
            "replica_rss_mib": rss_mib(int(g.get("worker_pid", 0))),
            "engine_rss_mib": rss_mib(int(g.get("engine_pid", 0))),
        }
        for label, g in replicas(url).items()
    }


def prompt(rng: random.Random) -> str:
    n = rng.choice([4, 8, 60, 120, 240])  # words: short ones stay on the decode worker
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one_request(session, url: str, rng: random.Random, shares) -> str:
    """Send one completion; the outcome: ok, error, disconnected, aborted or http_<status>."""
    disconnect, abort = shares
    stream = rng.random() < 0.7
    body = {
        "prompt": prompt(rng),
        "max_tokens": rng.randint(1, 64),
        "temperature": rng.choice([0.0, 0.8]),
        "ignore_eos": True,
        "stream": stream,
    }
    roll, drop_after, timeout = rng.random(), None, None
    if stream and roll < disconnect:
        drop_after = rng.randint(1, 20)  # the client goes away mid-stream
    elif roll < disconnect + abort:
        timeout = rng.uniform(0.005, 1.0)  # ... or at a random moment
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    await resp.read()
                    return f"http_{resp.status}"
                if not stream:
                    data = await resp.json()
                    return "ok" if data.get("choices") else "error"
                events = 0
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    if b'"error"' in line:
                        return "error"
                    events += 1
                    if drop_after is not None and events >= drop_after:
                        return "disconnected"  # leaving the block closes the connection
                return "ok"
    except TimeoutError:
        return "aborted"
    except aiohttp.ClientError as e:
        return f"client_error:{type(e).__name__}"


async def run_load(url: str, n: int, concurrency: int, shares, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(n):
        queue.put_nowait(random.Random(rng.random()))
    done = 0
    t0 = time.monotonic()

    async def client(session) -> None:
        nonlocal done
        while not queue.empty():
            outcome = await one_request(session, url, queue.get_nowait(), shares)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            done += 1
            if done % 500 == 0:
                rate = done / (time.monotonic() - t0)
                print(f"{done}/{n} requests ({rate:.0f}/s): {outcomes}", file=sys.stderr)

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return outcomes


def settled(url: str, timeout_s: float = 60.0) -> dict[str, dict[str, float]]:
    """The replicas' gauges once every block is free, or as they are at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = replicas(url)
        idle = all(g.get("kv_free_blocks") == g.get("kv_blocks") for g in state.values())
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, help="serve config (default: the embedded one)")
    p.add_argument("--url", help="measure this server instead of starting one")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-share", type=float, default=0.3)
    p.add_argument("--abort-share", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200, help="requests before the first RSS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()

    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            config = args.config or default_config_path()
            url = stack.enter_context(served(config, "127.0.0.1", None, None, STARTUP_S))
        shares = (args.disconnect_share, args.abort_share)
        asyncio.run(run_load(url, args.warmup, args.concurrency, (0.0, 0.0), args.seed + 1))
        settled(url)
        before = memory(url)
        t0 = time.monotonic()
        outcomes = asyncio.run(run_load(url, args.requests, args.concurrency, shares, args.seed))
        seconds = time.monotonic() - t0
        state = settled(url)
        after = memory(url)

    rows = []
    for label, g in sorted(state.items()):
        pool = re.search(r'pool="(\w+)"', label).group(1)
        rows.append(
            {
                "replica": label,
                "pool": pool,
                "blocks": int(g["kv_blocks"]),
                "blocks_leaked": int(g["kv_blocks"] - g["kv_free_blocks"]),
                **{f"{k}_before": v for k, v in before.get(label, {}).items()},
                **{f"{k}_after": v for k, v in after.get(label, {}).items()},
            }
        )
    print(f"\n{args.requests} requests in {seconds:.0f} s at concurrency {args.concurrency}")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    head = ("pool", "blocks", "leaked", "replica RSS MiB", "engine RSS MiB")
    print(f"{head[0]:8} {head[1]:>7} {head[2]:>7} {head[3]:>22} {head[4]:>22}")
    for r in rows:
        rep = f"{r['replica_rss_mib_before']:.0f} -> {r['replica_rss_mib_after']:.0f}"
        eng = f"{r['engine_rss_mib_before']:.0f} -> {r['engine_rss_mib_after']:.0f}"
        print(f"{r['pool']:8} {r['blocks']:7d} {r['blocks_leaked']:7d} {rep:>22} {eng:>22}")
    result = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "disconnect_share": args.disconnect_share,
        "abort_share": args.abort_share,
        "seconds": seconds,
        "outcomes": outcomes,
        "replicas": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    leaked = sum(r["blocks_leaked"] for r in rows)
    return 0 if leaked == 0 and "http_500" not in outcomes else 1


if __name__ == "__main__":
    sys.exit(main())
