"""kill -9 of a worker in the middle of a disaggregated request's prefill or KV hand-off.

Two prefill and two decode workers serve a transformers-written Qwen3 checkpoint on CPU
(one server for the module). The fault-injection settings (``splitserve/config.py``)
hold each phase open: ``SPLITSERVE_PREFILL_STEP_DELAY_S`` after every chunk of a prompt
(a 320-token prompt in 32-token chunks stays mid-prefill for about 2 s) and
``SPLITSERVE_KV_LAYER_DELAY_S`` after each KV layer frame (a hand-off of the three
layers stays mid-transfer for about 2.4 s). Each test streams a request, waits until
``/metrics`` shows it in the phase (it is the only one in flight), starts another
request (the routers put it on the other, less loaded, workers), kills the worker of
the first one in the pool under test (its engine process, or its replica), and checks:

- the first stream ends within a bounded time, retried on the surviving workers (the
  greedy tokens of the offline engine: no token had been sent) or with an error event
  naming the worker that failed (after the first token at most: the prefill worker
  streams it before the hand-off ends);
- the other stream finishes with its greedy tokens, and the server serves a new request;
- every surviving worker's free KV blocks return to all of its blocks (the killed
  worker's partner held a reservation or the prompt's blocks for it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

from tests import checkpoints
from tests.serve_harness import Server, offline_greedy, one_prefill_one_decode_config, serving

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 512
NUM_BLOCKS = 64
PROMPT_TOKENS = 320
CHUNK_TOKENS = 32
MAX_TOKENS = 8
FAULT_DELAYS = {"SPLITSERVE_PREFILL_STEP_DELAY_S": "0.2", "SPLITSERVE_KV_LAYER_DELAY_S": "0.8"}
# HAProxy mode keeps a leaving ingress replica reachable this long (Ray Serve's default:
# 30 s) for load balancers to deregister it; the whole server stops here.
RAY_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
ENDED_WITHIN_S = 40.0  # after the kill: a retry prefills and transfers again


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.write_qwen3(tmp_path_factory.mktemp("qwen3-kill"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    config = one_prefill_one_decode_config(
        model_dir, NUM_BLOCKS, MAX_MODEL_LEN, max_num_batched_tokens=CHUNK_TOKENS
    )
    config["pools"] = {"prefill": {"replicas": 2}, "decode": {"replicas": 2}}
    config["drain_timeout_s"] = 5.0  # nothing is left running at the end
    saved = {name: os.environ.get(name) for name in {**FAULT_DELAYS, **RAY_ENV}}
    os.environ.update({**FAULT_DELAYS, **RAY_ENV})  # the server and its Ray workers inherit them
    try:
        with serving(config, tmp_path_factory.mktemp("serve")) as server:
            yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def offline(model_dir):
    return offline_greedy(model_dir, NUM_BLOCKS, MAX_MODEL_LEN)


def _replicas(metrics: dict[str, float]) -> dict[str, dict]:
    """replica -> its pool, worker and engine pids, free and usable KV blocks."""
    keys = {
        "splitserve_worker_pid": "worker",
        "splitserve_engine_pid": "engine",
        "splitserve_kv_free_blocks": "free",
        "splitserve_kv_blocks": "blocks",
    }
    out: dict[str, dict] = {}
    for name, value in metrics.items():
        m = re.match(r'(\w+)\{pool="(\w+)",replica="([^"]+)"\}', name)
        if m and m.group(1) in keys:
            out.setdefault(m.group(3), {"pool": m.group(2)})[keys[m.group(1)]] = value
    return out


def _ready_to_kill(server: Server, pool: str, gone: set[int]) -> dict[str, dict]:
    """The replicas once ``pool`` has two live ones, no replica killed before is left on
    the board (its stale load would blur the phase), and every one has all its blocks
    free."""
    deadline = time.monotonic() + 120
    while True:
        replicas = _replicas(server.metrics())
        stale = [r for r, s in replicas.items() if {s["worker"], s["engine"]} & gone]
        in_pool = [r for r, s in replicas.items() if s["pool"] == pool]
        if (
            not stale
            and len(in_pool) == 2
            and all(s["free"] == s["blocks"] for s in replicas.values())
        ):
            return replicas
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


def _pool_gauge(metrics: dict[str, float], name: str, pool: str) -> float:
    return metrics[f'splitserve_{name}{{pool="{pool}"}}']


def _in_phase(metrics: dict[str, float], phase: str, pool: str) -> list[str]:
    """The replicas of ``pool`` that hold a request in ``phase`` (from the pool gauges:
    while no prefill worker sends KV, a prefill worker holding blocks is prefilling;
    while every prompt is computed and no decode worker decodes, a worker holding
    blocks is in a hand-off)."""
    queued = _pool_gauge(metrics, "queued_prompt_tokens", "prefill")
    sending = _pool_gauge(metrics, "requests_sending_kv", "prefill")
    waiting_for_kv = _pool_gauge(metrics, "requests_waiting_for_kv", "decode")
    if phase == "prefilling":
        ok = queued > 0 and sending == 0
    else:
        ok = queued == 0 and sending > 0 and waiting_for_kv > 0
        ok = ok and _pool_gauge(metrics, "requests_running", "decode") == 0
    replicas = _replicas(metrics)
    holding = [r for r, s in replicas.items() if s["pool"] == pool and s["free"] < s["blocks"]]
    return holding if ok else []


def _prompt(seed: int) -> list[int]:
    """A prompt of token ids of its own (no prefix shared with another test's)."""
    return [1 + (seed * 131 + i * 7) % 500 for i in range(PROMPT_TOKENS)]


def _stream(server: Server, prompt: list[int], results: dict, key: int) -> threading.Thread:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }

    def run() -> None:
        status, raw = server.request("POST", "/v1/completions", body, timeout=120)
        results[key] = (status, raw, time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _outcome(raw: str) -> tuple[list[int], str | None]:
    """A stream's token ids and its error message (None: it finished)."""
    lines = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", raw[-500:]
    tokens, error = [], None
    for event in map(json.loads, lines[:-1]):
        if "error" in event:
            error = event["error"]["message"]
        for choice in event.get("choices", []):
            tokens += choice.get("token_ids") or []
    return tokens, error


CASES = [
    pytest.param("prefilling", "prefill", "engine", id="prefilling-prefill-engine"),
    pytest.param("transferring", "decode", "engine", id="transferring-decode-engine"),
    pytest.param("transferring", "prefill", "worker", id="transferring-prefill-replica"),
]
_killed: set[int] = set()  # pids killed by earlier tests of the module


@pytest.mark.parametrize("phase, pool, process", CASES)
def test_kill_mid_phase(server, offline, phase, pool, process):
    replicas = _ready_to_kill(server, pool, _killed)
    seed = len(_killed) * 2
    victim_prompt, other_prompt = _prompt(seed), _prompt(seed + 1)
    results: dict = {}
    threads = [_stream(server, victim_prompt, results, "victim")]
    deadline = time.monotonic() + 30
    while not (held := _in_phase(server.metrics(), phase, pool)):
        assert time.monotonic() < deadline and not results, f"never {phase}: {results}"
        time.sleep(0.05)
    (victim,) = held
    # Another request, on the other workers (the routers choose the less loaded ones).
    threads.append(_stream(server, other_prompt, results, "other"))
    while sum(s["free"] < s["blocks"] for s in _replicas(server.metrics()).values()) < 3:
        assert time.monotonic() < deadline + 5, "the other request was not admitted"
        time.sleep(0.05)
    pids = {int(replicas[victim]["worker"]), int(replicas[victim]["engine"])}
    os.kill(int(replicas[victim][process]), signal.SIGKILL)
    killed_at = time.monotonic()
    _killed.update(pids)
    for t in threads:
        t.join(timeout=ENDED_WITHIN_S + 30)
    for key, prompt in (("victim", victim_prompt), ("other", other_prompt)):
        status, raw, ended = results[key]
        assert status == 200, raw
        assert ended - killed_at < ENDED_WITHIN_S, f"{key} ended {ended - killed_at:.0f} s on"
        tokens, error = _outcome(raw)
        if error is None or key == "other":  # retried, or on the other workers
            assert error is None and tokens == offline(prompt, MAX_TOKENS), raw[-500:]
        else:  # a clear error that names what failed, after at most the first token
            # (the prefill worker streams it before the hand-off ends)
            assert tokens == offline(prompt, MAX_TOKENS)[: len(tokens)], raw[-500:]
            assert len(tokens) <= 1 and f"{pool} worker" in error, error
    short = _prompt(seed + 2)[:48]  # disaggregated too, but quicker than the others
    status, body = server.post("/v1/completions", {"prompt": short, "max_tokens": 4})
    assert status == 200, body
    survivors = {r for r, s in replicas.items() if not pids & {s["worker"], s["engine"]}}
    deadline = time.monotonic() + 30
    while True:
        now = _replicas(server.metrics())
        held = {r: (now[r]["free"], now[r]["blocks"]) for r in survivors}
        if all(free == blocks for free, blocks in held.values()):
            break
        assert time.monotonic() < deadline, f"survivors hold KV blocks: {held}"
        time.sleep(0.2)
