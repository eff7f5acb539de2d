"""Goodput autoscaling end to end: ``splitserve serve`` with both pools autoscaled.

One server (CPU, tiny Qwen3) runs the tests in file order: the prefill pool
(``min_replicas: 0``) goes to zero when idle and stays there through a quiet
period; a long prompt brings it back and is answered token for token as the
offline engine does; long outputs grow the decode pool to its max, which shrinks
back once they end. The decision and its inputs are read from ``/metrics``.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests import checkpoints
from tests.serve_harness import offline_greedy, one_prefill_one_decode_config, serving

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 512
NUM_BLOCKS = 256
TARGET = 'splitserve_autoscaler_target_replicas{pool="%s"}'
LONG_PROMPT = "Prefill computes the prompt; decode generates one token at a time. " * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3-autoscale"))


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


def test_a_long_prompt_brings_the_prefill_pool_back(server, model_dir):
    body = {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    status, resp = server.post("/v1/completions", body)
    deadline = time.monotonic() + 180
    while status == 503:  # the replica took longer to start than the ingress waits (30 s)
        assert "prefill" in resp["error"]["message"], resp
        assert server.metrics()[TARGET % "prefill"] == 1  # asked for: it is on its way
        assert time.monotonic() < deadline, resp
        status, resp = server.post("/v1/completions", body)
    assert status == 200, resp
    offline = offline_greedy(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)
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
