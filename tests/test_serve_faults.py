"""Faults against a live ``splitserve serve``: a hung worker, then shutdown.

Two mixed replicas of a transformers-written Qwen3 checkpoint on CPU, one server for
the module, tests in file order:

- SIGSTOP of one replica's engine process: streams on it end (retried, or with a clear
  error once they have tokens) and every client is served by the other replica within
  15 s; the stopped replica is replaced (its watchdog fails its health check) and the
  survivor holds no KV block afterwards.
- SIGTERM of ``splitserve serve`` with streams running: they finish, a new request
  meanwhile gets 503 with ``Retry-After`` in OpenAI's error shape, and the process
  exits 0 within the drain timeout.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import threading
import time

import pytest

from tests import checkpoints
from tests.serve_harness import Server, mixed_pool_config, serving

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 512
NUM_BLOCKS = 128
DRAIN_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3-faults"))
    pool = {"replicas": 2, "stall_timeout_s": 2.0, "watchdog_timeout_s": 4.0}
    config = mixed_pool_config(model_dir, pool, NUM_BLOCKS, MAX_MODEL_LEN)
    config["drain_timeout_s"] = DRAIN_TIMEOUT_S
    with serving(config, tmp_path_factory.mktemp("serve")) as server:
        yield server


def _body(i: int, max_tokens: int) -> dict:
    return {
        "prompt": f"Request {i}: a worker may hang at any moment. ",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def _engine_pids(server: Server) -> dict[str, int]:
    """replica label -> engine process pid, from the metrics."""
    pids = {}
    for name, value in server.metrics().items():
        m = re.match(r"splitserve_engine_pid\{(.*)\}", name)
        if m:
            pids[m.group(1)] = int(value)
    return pids


def _stream_in_thread(server: Server, body: dict, results: dict, key) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        try:
            status, raw = server.request("POST", "/v1/completions", {**body, "stream": True})
        except OSError as e:
            status, raw = 0, str(e)
        results[key] = (status, raw, time.monotonic())
        results[key, "took"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    return t


def _free_blocks_equal_blocks(server: Server) -> bool:
    m = server.metrics()
    free = sum(v for k, v in m.items() if k.startswith("splitserve_kv_free_blocks{"))
    total = sum(v for k, v in m.items() if k.startswith("splitserve_kv_blocks{"))
    return total > 0 and free == total


def test_a_stopped_worker_is_routed_around_within_15_s(server):
    before = _engine_pids(server)
    assert len(before) == 2, before
    results: dict = {}
    threads = [_stream_in_thread(server, _body(i, 300), results, i) for i in range(6)]
    time.sleep(1.0)  # every stream is running, on one replica or the other
    stopped = min(before.values())
    os.kill(stopped, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        # A new client is served (by the other replica) while the worker is stopped.
        status, body = server.post("/v1/completions", _body(99, 8))
        assert status == 200, body
        assert time.monotonic() - t_stop < 15
        for t in threads:
            t.join(timeout=60)
        for i in range(6):
            status, raw, ended = results[i]
            assert status == 200, raw
            assert ended - t_stop < 15, f"stream {i} ended {ended - t_stop:.1f} s after the stop"
            assert raw.rstrip().endswith("data: [DONE]")
            if '"error"' in raw:  # it had tokens from the stopped worker: a clear error
                assert "stalled" in raw, raw
            else:
                assert raw.count('"finish_reason":"length"') == 1
        # Ray Serve replaces the stopped replica: its watchdog fails the health check.
        deadline = time.monotonic() + 120
        while stopped in _engine_pids(server).values() or len(_engine_pids(server)) < 2:
            assert time.monotonic() < deadline, _engine_pids(server)
            time.sleep(1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
    server.wait_healthy()
    for i in range(4):
        assert server.post("/v1/completions", _body(100 + i, 8))[0] == 200
    deadline = time.monotonic() + 30
    while not _free_blocks_equal_blocks(server):
        assert time.monotonic() < deadline, server.blocks()
        time.sleep(0.2)


def test_sigterm_drains_running_streams_and_refuses_new_requests(server):
    results: dict = {}
    threads = [_stream_in_thread(server, _body(200 + i, 480), results, i) for i in range(4)]
    time.sleep(0.3)  # they are admitted; 480 tokens take about a second on an idle machine
    assert not results, "the streams should still be running"
    t_term = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    refused = None
    while time.monotonic() - t_term < 10 and refused is None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(_body(300, 4)),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        raw = resp.read().decode()
        if resp.status == 503:
            refused = (resp.getheader("Retry-After"), json.loads(raw)["error"])
        conn.close()
        time.sleep(0.1)
    assert refused is not None, "no 503 while draining"
    retry_after, error = refused
    assert int(retry_after) > 0
    assert "shutting down" in error["message"] and error["type"] == "server_error"
    for t in threads:
        t.join(timeout=DRAIN_TIMEOUT_S + 30)
    for i in range(4):
        status, raw, ended = results[i]
        assert status == 200 and raw.count('"finish_reason":"length"') == 1, raw[-500:]
        assert ended - t_term < DRAIN_TIMEOUT_S
    server.proc.wait(timeout=DRAIN_TIMEOUT_S + 40)
    assert server.proc.returncode == 0
