"""End to end: ``splitserve serve`` on a real Ray cluster, spoken to over HTTP.

One prefill and one decode worker serve a transformers-written Qwen3
checkpoint on CPU. The tests run in file order on one cluster: the last ones
kill replicas and resize the pools.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from benchmarks import serve_process
from splitserve.workers.engine.torch_profiler import read_trace, step_names
from tests import checkpoints
from tests.serve_harness import (
    TEST_RAY_ENV,
    Server,
    offline_greedy,
    one_prefill_one_decode_config,
    serving,
)

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 256
NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3-serve"))


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, profile_dir):
    config = one_prefill_one_decode_config(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)
    config["engine"]["torch_profiler_dir"] = str(profile_dir)
    with serving(config, tmp_path_factory.mktemp("serve")) as server:
        yield server


@pytest.fixture(scope="module")
def offline(model_dir):
    return offline_greedy(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)


LONG_PROMPT = (
    "Prefill computes the prompt; decode generates one token at a time from the KV cache. "
)
SHORT_PROMPT = "Hello world!"


def _completion(text: str, **extra) -> dict:
    return {"prompt": text, "max_tokens": 16, "temperature": 0, "return_token_ids": True, **extra}


def test_greedy_completions_match_the_offline_engine(server, offline):
    for prompt in (LONG_PROMPT * 2, SHORT_PROMPT):
        status, body = server.post("/v1/completions", _completion(prompt))
        assert status == 200, body
        (choice,) = body["choices"]
        expected = offline(body["prompt_token_ids"], 16)
        assert choice["token_ids"] == expected
        assert body["usage"]["completion_tokens"] == 16
        assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])
        chunks = server.stream("/v1/completions", _completion(prompt))
        streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        assert streamed == expected
        assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == choice["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    m = server.metrics_when('splitserve_kv_transfers_total{pool="prefill"}', 1)
    # The first long prompt is disaggregated; its repeat is a prefix-cache hit on the
    # decode worker, which then computes it itself; short prompts never leave it.
    assert m['splitserve_requests_total{outcome="ok",route="disaggregated"}'] == 1
    assert m['splitserve_requests_total{outcome="ok",route="local_prefix_hit"}'] == 1
    assert m['splitserve_requests_total{outcome="ok",route="local_short"}'] == 2
    assert m['splitserve_kv_transfers_total{pool="prefill"}'] == 1
    # The prompt went to the prefill worker with the reservation, its ticket after it
    # (the prefix hit's prompt too, aborted there once the decode worker kept it).
    assert m['splitserve_kv_late_tickets_total{pool="prefill"}'] == 1
    assert m['splitserve_kv_transfer_bytes_total{pool="prefill"}'] > 0
    # Each route's TTFT splits into the computing engine's queue and prefill time (the
    # prefill worker's, when disaggregated) and the serving path's share.
    for route in ("disaggregated", "local_prefix_hit", "local_short"):
        label = f'{{route="{route}"}}'
        ttft = m[f"splitserve_time_to_first_token_seconds_sum{label}"]
        parts = [
            m[f"splitserve_request_{part}_time_seconds_sum{label}"] for part in ("queue", "prefill")
        ]
        path = m[f"splitserve_time_to_first_token_serving_path_seconds_sum{label}"]
        assert parts[1] > 0 and path > 0
        assert sum(parts) + path == pytest.approx(ttft, rel=1e-6)
        count = m[f"splitserve_time_to_first_token_seconds_count{label}"]
        assert m[f"splitserve_request_prefill_time_seconds_count{label}"] == count
    server.wait_all_blocks_free()


def test_chat_completion_uses_the_chat_template(server, offline):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": LONG_PROMPT}],
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    status, resp = server.post("/v1/chat/completions", body)
    assert status == 200, resp
    assert resp["prompt_token_ids"][:1] == [1]  # <|im_start|>
    (choice,) = resp["choices"]
    assert choice["token_ids"] == offline(resp["prompt_token_ids"], 8)
    assert choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert len(content) == 8 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["logprob"] <= 0 for c in content)


def test_models_and_health(server):
    status, raw = server.request("GET", "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "tiny"
    status, raw = server.request("GET", "/health")
    assert status == 200 and json.loads(raw)["replicas"] == {"prefill": 1, "decode": 1}


def test_http_goes_through_haproxy(server):
    """The default ``http.proxy: haproxy``: the port belongs to HAProxy, which forwards to
    an ingress replica's own HTTP server (no Ray Serve proxy actor on the way)."""
    assert _listener_of(server.port) == "haproxy"
    assert server.request("GET", "/v1/models")[0] == 200


def _listener_of(port: int) -> str:
    """The name of the process listening on 127.0.0.1:``port``."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        lines = f.read().splitlines()[1:]
    for line in lines:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
            inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    with open(f"/proc/{pid}/comm") as f:
                        return f.read().strip()
    return ""


def test_32_concurrent_streams_complete(server):
    results: dict[int, list[dict]] = {}

    def run(i: int) -> None:
        prompt = (LONG_PROMPT if i % 2 else SHORT_PROMPT) + str(i)
        results[i] = server.stream("/v1/completions", _completion(prompt, max_tokens=12))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert sorted(results) == list(range(32))
    for chunks in results.values():
        tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        assert len(tokens) == 12 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    server.wait_all_blocks_free()


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "model": "gpt-9"}, 404, "gpt-9"),
        ({"prompt": [1, 2, 999999]}, 400, "999999"),
        ({"prompt": "x" * 2000}, 400, "context"),
        ({"prompt": "hi", "n": 3}, 400, "n"),
        ({"prompt": "hi", "bogus_field": 1}, 400, "bogus_field"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, needle):
    got, raw = server.request("POST", "/v1/completions", body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert needle in error["message"] and error["type"] and "param" in error and "code" in error
    ok, _ = server.post("/v1/completions", _completion(SHORT_PROMPT, max_tokens=2))
    assert ok == 200


def _open_stream(server: Server, body: dict) -> tuple[socket.socket, bytes]:
    """Send a streaming request on a raw socket and read until two events arrived."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    payload = json.dumps({**body, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    seen = b""
    while seen.count(b"data: ") < 2:
        seen += sock.recv(65536)
    return sock, seen


def test_client_disconnect_frees_kv_on_both_workers(server):
    check_disconnect_frees_kv(server, "Disconnect. ")


def check_disconnect_frees_kv(server: Server, prefix: str) -> None:
    """A stream closed two tokens into its 200 is cancelled (the counter rises), and
    then every block is free on both workers. ``prefix`` keeps its prompt a miss."""
    body = _completion(prefix + LONG_PROMPT * 2, max_tokens=200)
    cancelled = 'splitserve_requests_total{outcome="cancelled",route="disaggregated"}'
    before = server.metrics().get(cancelled, 0)
    sock, _ = _open_stream(server, body)
    sock.close()  # at once: far from its 200 tokens (the workers hold its KV)
    deadline = time.monotonic() + 10
    while server.metrics().get(cancelled, 0) <= before:
        requests = {k: v for k, v in server.metrics().items() if "requests_total" in k}
        assert time.monotonic() < deadline, requests
        time.sleep(0.1)
    server.wait_all_blocks_free()  # after the cancel, on both workers


def test_profile_endpoints_trace_every_engine_and_refuse_out_of_turn(server, profile_dir):
    status, raw = server.request("POST", "/stop_profile", b"")
    assert status == 409 and "no profile running" in json.loads(raw)["error"]["message"]
    # the benchmark's client says what the server said
    with pytest.raises(RuntimeError, match="409 .*no profile running"):
        serve_process.post_json(f"http://127.0.0.1:{server.port}/stop_profile")
    status, raw = server.request("POST", "/start_profile", b"")
    assert (status, json.loads(raw)["profiling"]) == (200, True), raw
    status, raw = server.request("POST", "/start_profile", b"")
    assert status == 409 and "already running" in json.loads(raw)["error"]["message"]
    status, body = server.post("/v1/completions", _completion("Profiled. " + LONG_PROMPT))
    assert status == 200 and body["usage"]["completion_tokens"] == 16
    status, raw = server.request("POST", "/stop_profile", b"")
    assert status == 200, raw
    engines = {e["pool"]: e for e in json.loads(raw)["engines"]}
    assert set(engines) == {"prefill", "decode"}
    for pool, engine in engines.items():
        assert engine["error"] is None and engine["trace"].startswith(str(profile_dir))
        steps = set(step_names(read_trace(engine["trace"])))
        # The prompt went disaggregated: its prefill on one engine, its decode on the other.
        assert steps == {f"engine_step[{pool} b1]"}, (pool, steps)


def _replica_pids(server: Server, process: str = "worker") -> dict[str, int]:
    """pool -> pid of its (single) live replica, or of its engine process, from the metrics."""
    pids = {}
    for name, value in server.metrics().items():
        m = re.match(rf'splitserve_{process}_pid\{{pool="(\w+)"', name)
        if m:
            pids[m.group(1)] = int(value)
    return pids


@pytest.mark.parametrize("process", ["worker", "engine"])
@pytest.mark.parametrize("pool", ["decode", "prefill"])
def test_killed_replica_ends_the_request_cleanly(server, pool, process):
    """kill -9 of a replica, or of its engine process: the stream ends cleanly (retried or
    with an error), the replica is replaced and the pool serves again."""
    pids = _replica_pids(server, process)
    body = _completion(f"Kill the {pool} worker. " + LONG_PROMPT * 2, max_tokens=150)
    results = []

    def run():
        results.append(server.request("POST", "/v1/completions", {**body, "stream": True}))

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    os.kill(pids[pool], signal.SIGKILL)
    t.join(timeout=120)
    status, raw = results[0]
    assert status == 200
    if '"error"' in raw:  # tokens were already sent: a clear error ends the stream
        assert "failed" in raw and raw.rstrip().endswith("data: [DONE]")
    else:  # the request was retried on the new pair
        assert '"finish_reason":"length"' in raw
    server.wait_healthy()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the new replica serves
        if _replica_pids(server, process).get(pool) not in (None, pids[pool]):
            status, resp = server.post("/v1/completions", _completion(LONG_PROMPT * 2))
            if status == 200:
                break
        time.sleep(1)
    assert status == 200, resp
    for _ in range(3):
        assert server.post("/v1/completions", _completion(LONG_PROMPT + "again"))[0] == 200
    server.wait_all_blocks_free(timeout=60)


def test_killed_prefill_engine_with_a_queued_request_frees_the_decode_reservation(server):
    """kill -9 of the prefill engine while a request waits in it (the engine is stopped
    first, so the request is queued there, unread): the decode worker's reserved blocks
    return, and the request is retried on the replacement (or told the pool is gone):
    no hang, and the survivor leaks nothing."""
    pid = _replica_pids(server, "engine")["prefill"]
    body = _completion("Queued on a stopped prefill worker. " + LONG_PROMPT * 2, max_tokens=8)
    results = []
    os.kill(pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: results.append(server.post("/v1/completions", body)))
        t.start()
        deadline = time.monotonic() + 1.5  # before the ingress finds the engine stalled
        while server.blocks()["decode"][0] == server.blocks()["decode"][1]:
            assert time.monotonic() < deadline, "the decode worker reserved no blocks"
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGKILL)
    t.join(timeout=90)
    assert results, "the request hung"
    status, resp = results[0]
    if status == 200:  # retried once a new prefill worker came
        assert resp["choices"][0]["finish_reason"] == "length"
    else:
        assert status == 503 and "prefill" in resp["error"]["message"], resp
    server.wait_all_blocks_free(pools=("decode",), timeout=30)
    server.wait_healthy()
    deadline = time.monotonic() + 120
    while server.post("/v1/completions", _completion(LONG_PROMPT + "queued"))[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(1)
    server.wait_all_blocks_free(timeout=60)


def test_scale_to_a_mixed_worker_alone(server, offline):
    # The cluster `serve` started uses Ray's token authentication (the token is in ~/.ray).
    address_env = {**os.environ, **TEST_RAY_ENV, "RAY_AUTH_MODE": "token"}
    cmd = [sys.executable, "-m", "splitserve.cluster.cli", "scale"]
    done = subprocess.run(
        [*cmd, "--address", server.ray_address, "--prefill", "0", "--decode", "0", "--mixed", "1"],
        capture_output=True,
        text=True,
        env=address_env,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mixed=1" in done.stdout
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, raw = server.request("GET", "/health")
        if status == 200 and json.loads(raw)["replicas"] == {"mixed": 1}:
            break
        time.sleep(1)
    for prompt in (LONG_PROMPT * 2, SHORT_PROMPT):
        status, body = server.post("/v1/completions", _completion(prompt))
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == offline(body["prompt_token_ids"], 16)
    m = server.metrics()
    assert m['splitserve_requests_total{outcome="ok",route="local_mixed"}'] >= 2
    server.wait_all_blocks_free(pools=("mixed",))
