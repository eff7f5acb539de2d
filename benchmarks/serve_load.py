"""The client side of ``serve_bench.py``: prompts, streamed requests, load shapes, statistics.

Speaks only the OpenAI HTTP API (``/v1/completions``); no torch, no splitserve.

- ``random_prompts`` / ``read_prompts_file``: the requests (a prompt and its max_tokens).
- ``run_load``: sends them open-loop (Poisson arrivals at a rate; ``inf``: all at
  once) or closed-loop (C clients, each sending its next request when its last one
  ends), streaming, over aiohttp (Ray Serve depends on it) or else httpx.
- ``summarize``: throughput, latency percentiles and goodput of one load point.

Per request, from its SSE stream, timed on the client's ``perf_counter``:

- TTFT: from sending to the first event that carries a token;
- ITL: every gap between consecutive token-carrying events. An event may carry
  several tokens; their number is ``len(token_ids)`` (vLLM's ``return_token_ids``,
  asked for unless ``token_ids=False``), else 1 per event with text. Events that
  arrive in one network read share a time stamp (a gap of 0): they are counted;
- TPOT: ``(E2E - TTFT) / (output tokens - 1)``, output tokens from ``usage``;
- E2E: from sending to the end of the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    import aiohttp
except ImportError:  # pragma: no cover - Ray Serve brings aiohttp
    aiohttp = None


@dataclass
class RequestSpec:
    prompt: list[int] | str  # token ids, or text the server tokenizes
    max_tokens: int


@dataclass
class RequestResult:
    max_tokens: int
    ok: bool = False
    error: str | None = None  # the error body or exception, when not ok
    start_s: float = 0.0  # when it was sent, from the start of its load point
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0  # usage.completion_tokens when the server sent usage
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache
    token_events: int = 0  # SSE events that carried at least one token
    multi_token_events: int = 0  # ... more than one
    same_read_events: int = 0  # ... in the same network read as the token event before

    def record(self) -> dict:
        """The fields as a dict for a report, times rounded to the microsecond."""
        return {k: _round_us(v) for k, v in dataclasses.asdict(self).items()}

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _round_us(value):
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, list):
        return [_round_us(v) for v in value]
    return value


# --- prompts -------------------------------------------------------------------------


def random_prompts(
    num: int,
    input_len: int,
    input_len_range: float,
    output_len: int,
    vocab_size: int,
    seed: int | str,
) -> list[RequestSpec]:
    """``num`` prompts of random token ids in [1, vocab_size), lengths uniform in
    [input_len * (1 - range), input_len * (1 + range)]; the same for the same seed."""
    if not 0 <= input_len_range < 1:
        raise ValueError(f"invalid input_len_range={input_len_range}: must be in [0, 1)")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len={input_len} and output_len={output_len} must be >= 1")
    if vocab_size < 2:
        raise ValueError(f"invalid vocab_size={vocab_size}: must be >= 2")
    rng = random.Random(seed)
    low = max(1, round(input_len * (1 - input_len_range)))
    high = max(low, round(input_len * (1 + input_len_range)))
    lengths = [rng.randint(low, high) for _ in range(num)]
    return [
        RequestSpec([rng.randrange(1, vocab_size) for _ in range(n)], output_len) for n in lengths
    ]


def read_prompts_file(path: Path, default_max_tokens: int) -> list[RequestSpec]:
    """JSONL: ``{"prompt": text or ids}`` or ``{"prompt_token_ids": [...]}``, and
    optionally ``max_tokens`` (else ``default_max_tokens``)."""
    specs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON: {e}") from e
        keys = {"prompt", "prompt_token_ids"} & set(item) if isinstance(item, dict) else set()
        if len(keys) != 1:
            raise ValueError(f"{where}: give exactly one of 'prompt' or 'prompt_token_ids'")
        prompt = item[keys.pop()]
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if not (ids or (isinstance(prompt, str) and prompt)):
            raise ValueError(f"{where}: the prompt must be non-empty text or a list of token ids")
        max_tokens = item.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{where}: invalid max_tokens={max_tokens!r}: must be an integer >= 1")
        specs.append(RequestSpec(prompt, max_tokens))
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return specs


def request_body(spec: RequestSpec, token_ids: bool = True) -> dict:
    """Greedy, exactly max_tokens (ignore_eos), streamed with usage at the end."""
    body = {
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if token_ids:
        body["return_token_ids"] = True
    return body


# --- one streamed request ------------------------------------------------------------


@contextlib.asynccontextmanager
async def http_client(timeout_s: float) -> AsyncIterator[object]:
    """An HTTP client whose ``stream(url, body)`` gives (status, an iterator of bytes)."""
    if aiohttp is not None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # no cap on open connections
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            yield _Aiohttp(session)
    else:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            yield _Httpx(client)


class _Aiohttp:
    def __init__(self, session):
        self.session = session

    @contextlib.asynccontextmanager
    async def stream(self, url: str, body: dict):
        async with self.session.post(url, json=body) as resp:
            yield resp.status, resp.content.iter_any()


class _Httpx:
    def __init__(self, client):
        self.client = client

    @contextlib.asynccontextmanager
    async def stream(self, url: str, body: dict):
        async with self.client.stream("POST", url, json=body) as resp:
            yield resp.status_code, resp.aiter_bytes()


def _sse_payloads(event: bytes) -> Iterator[str]:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            yield line[5:].strip().decode()


async def send(client, url: str, spec: RequestSpec, t0: float, token_ids: bool) -> RequestResult:
    """Send one streamed completion and time its events (see the module docstring)."""
    result = RequestResult(max_tokens=spec.max_tokens)
    start = time.perf_counter()
    result.start_s = start - t0
    last, done, buffer = start, False, b""
    try:
        async with client.stream(url, request_body(spec, token_ids)) as (status, chunks):
            if status != 200:
                body = b"".join([c async for c in chunks]).decode(errors="replace")
                result.error = f"HTTP {status}: {body[:2000]}"
                return result
            async for data in chunks:
                now, token_in_read = time.perf_counter(), False
                *events, buffer = (buffer + data).replace(b"\r\n", b"\n").split(b"\n\n")
                for payload in (p for event in events for p in _sse_payloads(event)):
                    if payload == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = f"error event: {payload[:2000]}"
                        return result
                    n = _count_tokens(chunk)
                    if n:
                        if result.ttft_s is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        result.same_read_events += token_in_read
                        result.multi_token_events += n > 1
                        result.token_events += 1
                        result.output_tokens += n
                        last, token_in_read = now, True
                    _read_usage(chunk.get("usage"), result)
    except Exception as e:  # a benchmark records a failed request and goes on
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    if not done or result.ttft_s is None:
        result.error = "the stream ended without [DONE]" if not done else "no token came"
        return result
    result.ok = True
    return result


def _count_tokens(chunk: dict) -> int:
    if not chunk.get("choices"):
        return 0
    choice = chunk["choices"][0]
    if "token_ids" in choice:
        return len(choice["token_ids"] or [])
    return 1 if choice.get("text") or (choice.get("delta") or {}).get("content") else 0


def _read_usage(usage: dict | None, result: RequestResult) -> None:
    if not usage:
        return
    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
    result.prompt_tokens = usage.get("prompt_tokens")
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


# --- load shapes ---------------------------------------------------------------------


async def run_load(
    url: str,
    specs: list[RequestSpec],
    mode: str,
    value: float,
    seed: int | str = 0,
    token_ids: bool = True,
    timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send ``specs`` to ``url`` (``.../v1/completions``); return the results, in the
    order of ``specs``, and the seconds from the first send to the last response's end.

    ``mode`` "rate": Poisson arrivals at ``value`` requests/s (``inf``: all at once),
    whatever the responses do; "concurrency": ``value`` requests in flight at a time.
    """
    if mode not in ("rate", "concurrency"):
        raise ValueError(f"unknown load mode {mode!r}: 'rate' or 'concurrency'")
    if not value > 0:
        raise ValueError(f"invalid {mode}={value}: must be > 0")
    async with http_client(timeout_s) as client:
        t0 = time.perf_counter()
        if mode == "rate":
            results = await _open_loop(client, url, specs, value, seed, token_ids, t0)
        else:
            results = await _closed_loop(client, url, specs, int(value), token_ids, t0)
        return results, time.perf_counter() - t0


async def _open_loop(client, url, specs, rate, seed, token_ids, t0) -> list[RequestResult]:
    rng, at, tasks = random.Random(seed), 0.0, []
    for spec in specs:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(client, url, spec, t0, token_ids)))
        if math.isfinite(rate):
            at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


async def _closed_loop(client, url, specs, concurrency, token_ids, t0) -> list[RequestResult]:
    results: list[RequestResult | None] = [None] * len(specs)
    order = iter(range(len(specs)))  # shared: each client takes the next request

    async def one_client() -> None:
        for i in order:
            results[i] = await send(client, url, specs[i], t0, token_ids)

    await asyncio.gather(*(one_client() for _ in range(min(concurrency, len(specs)))))
    return results  # type: ignore[return-value]


# --- statistics ----------------------------------------------------------------------


def latency_stats(seconds: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds (linear interpolation); None when empty."""
    if not seconds:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slo(r: RequestResult, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    """Goodput's test of one request: completed, TTFT and TPOT within the SLOs given (an
    SLO not given is met; a request of one token has no TPOT and meets any TPOT SLO)."""
    if not r.ok:
        return False
    ttft_ok = ttft_ms is None or 1e3 * r.ttft_s <= ttft_ms
    return ttft_ok and (tpot_ms is None or r.tpot_s is None or 1e3 * r.tpot_s <= tpot_ms)


def summarize(
    results: list[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """One load point's figures. Goodput: completed requests whose TTFT and TPOT meet
    the SLOs given (an SLO not given is met), per second and as a share of all sent."""
    ok = [r for r in results if r.ok]
    num_good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    output = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "sent": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "wrong_length": sum(r.output_tokens != r.max_tokens for r in ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(r.cached_tokens or 0 for r in ok),
        "output_tokens": output,
        "goodput": num_good / duration_s,
        "goodput_fraction": num_good / len(results) if results else 0.0,
        "ttft_ms": latency_stats([r.ttft_s for r in ok]),
        "tpot_ms": latency_stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": latency_stats([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in ok]),
        "token_events": sum(r.token_events for r in ok),
        "multi_token_events": sum(r.multi_token_events for r in ok),
        "same_read_events": sum(r.same_read_events for r in ok),
        "errors": errors[:5],
    }
