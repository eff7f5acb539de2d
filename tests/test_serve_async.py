"""``splitserve serve`` with async scheduling in both workers, over HTTP on CPU.

The serving loop (``workers/engine/core_process.py``) then always has a step in
flight: tokens must match the offline engine, concurrent streams must all
finish, and a client that disconnects mid-stream must free its KV on both
workers while its step is still being read back. Streams go out every
``STREAM_INTERVAL`` tokens (``scheduler.stream_interval``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from tests import checkpoints
from tests.serve_harness import TEST_RAY_ENV, offline_greedy, one_prefill_one_decode_config, serving
from tests.test_serve import LONG_PROMPT, SHORT_PROMPT, _completion, check_disconnect_frees_kv

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 256
NUM_BLOCKS = 256
STREAM_INTERVAL = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3-serve-async"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    config = one_prefill_one_decode_config(
        model_dir, NUM_BLOCKS, MAX_MODEL_LEN, async_scheduling=True, stream_interval=STREAM_INTERVAL
    )
    config["ingress"] = {"replicas": 2}  # two HTTP fronts behind Ray Serve's proxy
    with serving(config, tmp_path_factory.mktemp("serve-async")) as server:
        yield server


@pytest.fixture(scope="module")
def offline(model_dir):
    return offline_greedy(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)


def test_greedy_completions_match_the_sync_offline_engine(server, offline):
    for prompt in (LONG_PROMPT * 2, SHORT_PROMPT):
        status, body = server.post("/v1/completions", _completion(prompt))
        assert status == 200, body
        (choice,) = body["choices"]
        assert choice["token_ids"] == offline(body["prompt_token_ids"], 16)
        chunks = server.stream("/v1/completions", _completion(prompt))
        streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        assert streamed == choice["token_ids"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    m = server.metrics_when('splitserve_kv_transfers_total{pool="prefill"}', 1)
    assert m['splitserve_requests_total{outcome="ok",route="disaggregated"}'] == 1
    server.wait_all_blocks_free()


def test_a_stream_sends_its_tokens_every_stream_interval(server, offline):
    for prompt in (LONG_PROMPT * 2 + "interval", SHORT_PROMPT + " interval"):
        chunks = server.stream("/v1/completions", _completion(prompt))
        counts = [len(ch.get("token_ids") or []) for c in chunks for ch in c["choices"]]
        ends = {sum(counts[: i + 1]) for i, n in enumerate(counts) if n}
        # the first token at once, then every 4th, the last at once (a lagging reader
        # may take two of these in one chunk, never a cut elsewhere)
        assert ends <= {1, 5, 9, 13, 16} and 16 in ends, counts
        tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        status, body = server.post("/v1/completions", _completion(prompt))
        assert status == 200 and tokens == body["choices"][0]["token_ids"]
        assert tokens == offline(body["prompt_token_ids"], 16)
    server.wait_all_blocks_free()


def test_32_concurrent_streams_complete(server):
    results: dict[int, list[dict]] = {}

    def run(i: int) -> None:
        prompt = (LONG_PROMPT if i % 2 else SHORT_PROMPT) + f" async {i}"
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


def test_client_disconnect_frees_kv_on_both_workers(server):
    check_disconnect_frees_kv(server, "Disconnect async. ")


def test_the_ingress_runs_the_configured_replicas(server):
    """``ingress.replicas: 2``: two HTTP front replicas run, and the tests above went
    through them."""
    script = (
        "import json, ray; from ray import serve; "
        f"ray.init(address={server.ray_address!r}, logging_level='ERROR'); "
        "d = serve.status().applications['splitserve'].deployments['ingress']; "
        "print(json.dumps({str(k): v for k, v in d.replica_states.items()}))"
    )
    env = {**os.environ, **TEST_RAY_ENV, "RAY_AUTH_MODE": "token"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    states = json.loads(out.stdout.strip().splitlines()[-1])
    assert states == {"RUNNING": 2}, (states, out.stderr[-2000:])
