"""A real ``splitserve serve`` subprocess and an HTTP client for it (serving tests)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from benchmarks.serve_process import parse_metrics
from splitserve.cluster.ports import free_port


class Server:
    def __init__(self, port: int):
        self.port = port
        self.ray_address = ""
        self.proc: subprocess.Popen | None = None  # the ``splitserve serve`` process

    def request(self, method: str, path: str, body=None, timeout: float = 60.0):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, bytes | str) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        conn.close()
        return resp.status, raw

    def post(self, path: str, body) -> tuple[int, dict]:
        status, raw = self.request("POST", path, body)
        return status, json.loads(raw)

    def stream(self, path: str, body) -> list[dict]:
        status, raw = self.request("POST", path, {**body, "stream": True})
        assert status == 200, raw
        events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def metrics(self) -> dict[str, float]:
        status, raw = self.request("GET", "/metrics")
        assert status == 200
        return parse_metrics(raw)

    def metrics_when(self, name: str, value: float, timeout: float = 10.0) -> dict[str, float]:
        """The metrics once ``name`` reads ``value``; workers report their counters periodically."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get(name) == value or time.monotonic() > deadline:
                assert m.get(name) == value, (name, m.get(name))
                return m
            time.sleep(0.2)

    def blocks(self) -> dict[str, tuple[float, float]]:
        """pool -> (free KV blocks, usable KV blocks), summed over its replicas."""
        out: dict[str, list[float]] = {}
        for name, value in self.metrics().items():
            m = re.match(r'splitserve_kv_(free_blocks|blocks)\{pool="(\w+)"', name)
            if m:
                pair = out.setdefault(m.group(2), [0.0, 0.0])
                pair[0 if m.group(1) == "free_blocks" else 1] += value
        return {pool: tuple(v) for pool, v in out.items()}

    def wait_all_blocks_free(self, pools=("prefill", "decode"), timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            blocks = self.blocks()
            if all(p in blocks and blocks[p][0] == blocks[p][1] for p in pools):
                return
            time.sleep(0.2)
        raise AssertionError(f"KV blocks still held: {self.blocks()}")

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("the server did not become healthy")


def one_prefill_one_decode_config(
    model_dir: Path, num_kv_blocks: int, max_model_len: int, **scheduler
) -> dict:
    """A serve config of one prefill and one decode worker on CPU, KV over the CPU
    transport; prompts under 24 tokens stay on the decode worker."""
    return {
        "engine": {
            "model": str(model_dir),
            "device": "cpu",
            "cache": {"block_size": 16, "num_kv_blocks": num_kv_blocks},
            "scheduler": {
                "max_model_len": max_model_len,
                "max_num_batched_tokens": 512,
                **scheduler,
            },
            "kv_transfer": {"transport": "cpu", "timeout_s": 20},
        },
        "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
        "router": {"local_prompt_tokens": 24},
        "served_model_name": "tiny",
    }


def mixed_pool_config(
    model_dir: Path, mixed_pool: dict, num_kv_blocks: int, max_model_len: int
) -> dict:
    """A serve config of one mixed pool (no prefill or decode workers) on CPU."""
    return {
        "engine": {
            "model": str(model_dir),
            "device": "cpu",
            "cache": {"block_size": 16, "num_kv_blocks": num_kv_blocks},
            "scheduler": {"max_model_len": max_model_len},
        },
        "pools": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "mixed": mixed_pool},
        "served_model_name": "tiny",
    }


# No usage reports; and a leaving ingress replica stays reachable 1 s (Ray Serve's HAProxy
# mode waits 30 s by default for load balancers to deregister it): the whole server stops.
TEST_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
}


@contextlib.contextmanager
def serving(config: dict, directory: Path, startup_s: float = 180.0) -> Iterator[Server]:
    """Run ``splitserve serve`` on ``config`` (a free port is filled in) until the block ends.

    ``config["served_model_name"]`` must be set. On exit the server gets
    SIGTERM and must shut down cleanly with status 0.
    """
    port = free_port()
    path = directory / "serve.yaml"
    path.write_text(yaml.safe_dump({**config, "port": port}))
    name = config["served_model_name"]
    env = {**os.environ, **TEST_RAY_ENV, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cluster.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    server = Server(port)
    server.proc = proc
    try:
        deadline = time.monotonic() + startup_s
        while not any(f"serving {name} at" in line for line in log):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            time.sleep(0.2)
        (line,) = [line for line in log if "Ray cluster at" in line]
        server.ray_address = line.split("Ray cluster at ")[1].strip()
        server.wait_healthy()
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, "".join(log[-40:])
    assert any("shutting down" in line for line in log)


def offline_greedy(
    model_dir: Path, num_blocks: int, max_model_len: int, kv_cache_dtype: str = "auto"
):
    """Greedy continuations from the offline engine (one step read back at a time),
    token ids in, token ids out: what the served completions must equal."""
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.sampling_params import SamplingParams
    from splitserve.workers.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            cache=CacheConfig(num_kv_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_model_len=max_model_len, async_scheduling=False),
        )
    )

    def generate(prompt_ids: list[int], max_tokens: int) -> list[int]:
        rid = f"r{time.monotonic_ns()}"
        engine.add_request(rid, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
        return tokens

    return generate
