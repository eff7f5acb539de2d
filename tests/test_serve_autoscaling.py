"""The pools end to end: goodput autoscaling, then unequal fixed pools resized live.

One ``splitserve serve`` (CPU, tiny Qwen3) runs the tests in file order (one
cluster for both halves keeps CI short). Autoscaled: the prefill pool
(``min_replicas: 0``) goes to zero when idle and stays there through a quiet
period; a long prompt brings it back and is answered token for token as the
offline engine does; long outputs grow the decode pool to its max, which shrinks
back once they end; the decision and its inputs are read from ``/metrics``.
Unequal: ``splitserve scale --prefill 2 --decode 1`` makes the pools fixed; long
prompts sent together answer as the offline engine does; then
``splitserve scale --prefill 1 --decode 2`` resizes them in place while clients
keep sending, and every answer, before, during and after, is the same, with no
KV block left held on any worker.
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
from tests.serve_harness import TEST_RAY_ENV, offline_greedy, one_prefill_one_decode_config, serving

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 512
NUM_BLOCKS = 256
MAX_TOKENS = 12
PROMPTS = [
    f"Request {i}: prefill computes the prompt and hands its KV cache to a decode worker. "
    for i in range(6)
]
TARGET = 'splitserve_autoscaler_target_replicas{pool="%s"}'
LONG_PROMPT = "Prefill computes the prompt; decode generates one token at a time. " * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3-autoscale"))


@pytest.fixture(scope="module")
def offline(model_dir):
    return offline_greedy(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    config = one_prefill_one_decode_config(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)
    config["pools"] = {
        "prefill": {"min_replicas": 0, "max_replicas": 1},
        "decode": {"min_replicas": 1, "max_replicas": 2, "target_running_requests": 2},
    }
    config["autoscaling"] = {
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 4.0,
        "downscale_to_zero_delay_s": 3.0,
        "window_s": 2.0,
    }
    config["slo"] = {"ttft_ms": 60000, "tpot_ms": 60000}
    with serving(config, tmp_path_factory.mktemp("serve")) as server:
        yield server


def wait_for(server, name: str, value: float, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m.get(name) == value:
            return m
        assert time.monotonic() < deadline, (name, m.get(name))
        time.sleep(0.3)


def test_an_idle_prefill_pool_goes_to_zero_and_stays_there(server):
    m = wait_for(server, TARGET % "prefill", 0, timeout=60)
    assert m['splitserve_autoscaler_decision{pool="prefill",reason="idle"}'] == 1
    assert m['splitserve_autoscaler_slo{objective="ttft_ms"}'] == 60000
    assert m['splitserve_autoscaler_input{input="in_flight"}'] == 0
    for name in ("queued_prompt_tokens", "running_requests", "kv_usage", "replicas"):
        assert f'splitserve_autoscaler_pool_input{{input="{name}",pool="decode"}}' in m
    quiet = []
    for _ in range(16):  # 8 s of no requests: no flapping back to one
        quiet.append(server.metrics().get(TARGET % "prefill"))
        time.sleep(0.5)
    assert set(quiet) == {0}, quiet
    assert server.request("GET", "/health")[0] == 503  # no prefill worker: not serving


def test_a_long_prompt_brings_the_prefill_pool_back(server, offline):
    body = {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    status, resp = server.post("/v1/completions", body)
    deadline = time.monotonic() + 180
    while status == 503:  # the replica took longer to start than the ingress waits (30 s)
        assert "prefill" in resp["error"]["message"], resp
        assert server.metrics()[TARGET % "prefill"] == 1  # asked for: it is on its way
        assert time.monotonic() < deadline, resp
        status, resp = server.post("/v1/completions", body)
    assert status == 200, resp
    assert resp["choices"][0]["token_ids"] == offline(resp["prompt_token_ids"], 8)
    m = server.metrics()
    assert m[TARGET % "prefill"] == 1
    assert m['splitserve_requests_total{outcome="ok",route="disaggregated"}'] == 1
    server.wait_all_blocks_free(pools=("decode",))


def test_long_outputs_grow_the_decode_pool_and_it_shrinks_back(server):
    body = {"prompt": "Hello there", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    finished: list[str] = []
    grown = threading.Event()

    def client() -> None:
        while not grown.is_set():
            events = server.stream("/v1/completions", body)
            finished.append(events[-1]["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        m = wait_for(server, TARGET % "decode", 2, timeout=60)
        assert m['splitserve_autoscaler_decision{pool="decode",reason="running_requests"}'] == 1
    finally:
        grown.set()
        for t in threads:
            t.join(timeout=120)
    assert len(finished) >= 6 and set(finished) == {"length"}, finished
    wait_for(server, TARGET % "decode", 1, timeout=60)
    server.wait_all_blocks_free(pools=("decode",))


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


def scale(server, **sizes: int) -> str:
    env = {**os.environ, **TEST_RAY_ENV, "RAY_AUTH_MODE": "token"}
    cmd = [sys.executable, "-m", "splitserve.cluster.cli", "scale", "--address", server.ray_address]
    for pool, n in sizes.items():
        cmd += [f"--{pool}", str(n)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for pool, n in sizes.items():
        assert f"{pool}={n}" in done.stdout, done.stdout
    return done.stdout


def test_two_prefill_workers_and_one_decode_worker(server, offline):
    scale(server, prefill=2, decode=1)  # fixed pools from here on
    wait_for_replicas(server, {"prefill": 2, "decode": 1})
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
        scale(server, prefill=1, decode=2)  # in place: the other replicas keep serving
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
