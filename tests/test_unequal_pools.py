"""Unequal pools end to end: two prefill workers and one decode worker, then one and two.

One ``splitserve serve`` (CPU, tiny Qwen3) starts with 2 prefill + 1 decode
workers; long prompts sent together (each handed from a prefill worker to the
decode worker) must answer token for token as the offline engine does. Then
``splitserve scale --prefill 1 --decode 2`` resizes the running app while clients
keep sending; every request, before, during and after the resize, must answer
the same tokens, and no KV block may stay held on any worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import checkpoints
from tests.serve_harness import offline_greedy, one_prefill_one_decode_config, serving

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 256
NUM_BLOCKS = 256
MAX_TOKENS = 12
PROMPTS = [
    f"Request {i}: prefill computes the prompt and hands its KV cache to a decode worker. "
    for i in range(6)
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3-unequal"))


@pytest.fixture(scope="module")
def offline(model_dir):
    return offline_greedy(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    config = one_prefill_one_decode_config(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)
    config["pools"] = {"prefill": {"replicas": 2}, "decode": {"replicas": 1}}
    with serving(config, tmp_path_factory.mktemp("serve")) as server:
        wait_for_replicas(server, {"prefill": 2, "decode": 1})
        yield server


def wait_for_replicas(server, replicas: dict[str, int], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    live = None
    while time.monotonic() < deadline:
        status, raw = server.request("GET", "/health")
        live = json.loads(raw).get("replicas")
        if status == 200 and {p: n for p, n in live.items() if n} == replicas:
            return
        time.sleep(0.5)
    raise AssertionError(f"replicas {live}, waited for {replicas}")


def complete(server, prompt: str) -> tuple[list[int], list[int]]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, resp = server.post("/v1/completions", {**body, "return_token_ids": True})
    assert status == 200, resp
    return resp["prompt_token_ids"], resp["choices"][0]["token_ids"]


def check_batch(server, offline) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(server, p), PROMPTS))
    for prompt_ids, tokens in answers:
        assert tokens == offline(prompt_ids, MAX_TOKENS)


def test_two_prefill_workers_and_one_decode_worker(server, offline):
    before = server.metrics()
    check_batch(server, offline)
    m = server.metrics()
    route = 'splitserve_requests_total{outcome="ok",route="disaggregated"}'
    assert m[route] - before.get(route, 0) == len(PROMPTS)
    server.wait_all_blocks_free()


def test_resized_to_one_prefill_and_two_decode_workers_while_serving(server, offline):
    answers: list[tuple[list[int], list[int]]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def client(prompt: str) -> None:
        while not stop.is_set():
            try:
                answers.append(complete(server, prompt))
            except BaseException as e:  # a failed request fails the test below
                errors.append(e)
                return

    clients = [threading.Thread(target=client, args=(p,)) for p in PROMPTS[:3]]
    for t in clients:
        t.start()
    try:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
        cmd = [sys.executable, "-m", "splitserve.cluster.cli", "scale"]
        cmd += ["--address", server.ray_address, "--prefill", "1", "--decode", "2"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "prefill=1" in done.stdout and "decode=2" in done.stdout, done.stdout
        wait_for_replicas(server, {"prefill": 1, "decode": 2})
        during, deadline = len(answers), time.monotonic() + 60
        while len(answers) < during + 3 and not errors:  # by the resized pools too
            assert time.monotonic() < deadline, "no answers after the resize"
            time.sleep(0.2)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=120)
    assert not errors, errors
    for prompt_ids, tokens in answers:
        assert tokens == offline(prompt_ids, MAX_TOKENS)
    check_batch(server, offline)
    server.wait_all_blocks_free()
