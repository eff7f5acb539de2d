"""Autoscaling end to end: a mixed pool under load grows to its max_replicas.

One mixed worker (CPU) with `min_replicas: 1, max_replicas: 2` and a target of
two running requests per replica gets eight long streams at once, each client
starting a new one as its last ends, until the pool reaches two live replicas
(read from `/metrics`); every stream must complete. (The load is held, not one
burst: a burst can end before the autoscaler's look-back window fills.)
"""

from __future__ import annotations

import threading
import time

import pytest

from tests import checkpoints
from tests.serve_harness import mixed_pool_config, serving

pytestmark = pytest.mark.slow
STREAMS = 8


def test_mixed_pool_scales_up_under_load(tmp_path):
    model = checkpoints.write_qwen3(tmp_path / "model")
    autoscaled = {"min_replicas": 1, "max_replicas": 2, "target_running_requests": 2}
    config = mixed_pool_config(model, autoscaled, num_kv_blocks=512, max_model_len=1024)
    body = {"prompt": "Hello there", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    replicas = 'splitserve_pool_replicas{pool="mixed"}'
    with serving(config, tmp_path) as server:
        assert server.metrics()[replicas] == 1
        finished: list[str] = []
        scaled = threading.Event()

        def client() -> None:
            while not scaled.is_set():
                events = server.stream("/v1/completions", body)
                finished.append(events[-1]["choices"][0]["finish_reason"])

        threads = [threading.Thread(target=client) for _ in range(STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        try:
            while server.metrics().get(replicas) != 2:
                assert time.monotonic() < deadline, server.metrics().get(replicas)
                time.sleep(0.5)
        finally:
            scaled.set()
            for t in threads:
                t.join(timeout=180)
        assert len(finished) >= STREAMS and set(finished) == {"length"}, finished
