"""The HTTP floor benchmark's echo app: what it streams, how long it waits, one timed run
through its bare uvicorn front, and the environment its Ray front sets and restores (that
front itself runs in ``test_serve_bench.py``'s run with ``--http-floor``)."""

import asyncio
import json
import os
import time

import pytest

from benchmarks import http_floor


def _call(path: str, body: dict, query: bytes = b"") -> list[dict]:
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "query_string": query}
    asyncio.run(http_floor.echo_app(scope, receive, send))
    return sent


def test_echo_streams_max_tokens_chunks_then_done():
    sent = _call("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True})
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    bodies = [m["body"] for m in sent[1:]]
    chunks = [json.loads(b[len(b"data: ") :]) for b in bodies[:-1]]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[1], [2], [3]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert bodies[-1] == b"data: [DONE]\n\n" and sent[-1]["more_body"] is False


def test_echo_answers_other_paths_empty():
    sent = _call("/health", {})
    assert sent[0]["status"] == 200 and sent[1]["body"] == b""


def test_echo_waits_the_delay_asked_before_its_first_chunk():
    start = time.monotonic()
    sent = _call("/v1/completions", {"max_tokens": 1}, b"delay_ms=30")
    assert time.monotonic() - start >= 0.030
    assert sent[0]["status"] == 200 and len(sent) == 3  # headers, one chunk, [DONE]


def test_bare_front_is_timed_with_the_benchmark_client():
    argv = ["--fronts", "bare", "--requests", "4", "--warmup", "1", "--input-len", "16"]
    report = http_floor.main([*argv, "--output-len", "5", "--delay-ms", "0", "20"])
    quick, paused = report["points"]
    assert (quick["front"], quick["delay_ms"], paused["delay_ms"]) == ("bare", 0, 20)
    assert quick["completed"] == paused["completed"] == 4
    assert 0 < quick["ttft_ms"]["p50"] <= quick["e2e_ms"]["p50"]
    # the floor is the TTFT less the delay: the first chunk never comes before it
    assert paused["ttft_ms"]["p50"] >= 20
    assert paused["floor_ms"]["p50"] == pytest.approx(paused["ttft_ms"]["p50"] - 20)


def test_the_ray_fronts_environment_is_restored_key_by_key(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_FLOOR_KEPT", "before")
    monkeypatch.delenv("SPLITSERVE_FLOOR_NEW", raising=False)
    values = {"SPLITSERVE_FLOOR_KEPT": "during", "SPLITSERVE_FLOOR_NEW": "during"}
    with http_floor._environment(values):
        assert os.environ["SPLITSERVE_FLOOR_KEPT"] == os.environ["SPLITSERVE_FLOOR_NEW"] == "during"
    assert os.environ["SPLITSERVE_FLOOR_KEPT"] == "before"
    assert "SPLITSERVE_FLOOR_NEW" not in os.environ
