"""The engine process boundary: a replica's ``EngineClient``, its engine process, and a
front's ``EngineConnection`` to it.

Real processes and sockets: the client starts ``core_process``; fronts connect over TCP
and talk msgpack frames to it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from splitserve.config import EngineConfig
from splitserve.llm import LLM
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine import messages
from splitserve.workers.engine.engine_client import EngineClient, EngineStartError
from splitserve.workers.engine.engine_connection import EngineConnection
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.engine.messages import (
    Abort,
    Delta,
    Failed,
    GenerateCall,
    Overloaded,
    Rejected,
    StepEvents,
    TicketIssued,
    merge_deltas,
)
from splitserve.workers.sampling.sampler import TokenLogprobs

CONFIG = {
    "model": "qwen3-tiny",
    "device": "cpu",
    "cache": {"num_kv_blocks": 256},
    "scheduler": {"max_model_len": 512, "max_num_seqs": 16},
}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SECRET = "s3cret"


@pytest.fixture(scope="module")
def client():
    c = EngineClient(EngineConfig.from_dict(CONFIG), secret=SECRET, max_requests=8)
    yield c
    c.shutdown()


def _front(client: EngineClient, secret: str = SECRET):
    return EngineConnection.open(client.address, secret, "the test's engine")


async def _collect(front: EngineConnection, call: GenerateCall) -> tuple[list[int], int]:
    tokens, items = [], 0
    async for events in front.generate(call):
        items += 1
        for event in events:
            assert isinstance(event, Delta), event
            tokens += event.token_ids
    return tokens, items


def test_served_tokens_equal_the_engine_in_process(client):
    prompts = [[1 + i, 7, 42, 9 + i] * (i + 1) for i in range(6)]

    async def run():
        front = await _front(client)
        calls = [GenerateCall(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        served = await asyncio.gather(*[_collect(front, c) for c in calls])
        front.close()
        return served

    served = asyncio.run(run())
    engine = LLMEngine(EngineConfig.from_dict(CONFIG))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    offline = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                offline[out.request_id] = out.outputs[0].token_ids
    for i, (tokens, items) in enumerate(served):
        assert tokens == offline[f"r{i}"]
        assert 1 <= items <= GREEDY.max_tokens  # a list per item, never more than a step's
    assert client.alive


def test_the_engine_loop_counts_its_steps_by_kind_and_batch(client):
    """Four prompts at once, 12 tokens each: every request is in 12 steps (synchronous on
    CPU), all counted. The prompts come in one prefill step, or the later ones join the
    running in mixed steps (at most one each), then all decode."""

    def totals() -> dict[str, list]:
        sums: dict[str, list] = {}
        for kind, _, steps, requests, _, seconds, wait in client.stats.step_times:
            assert 0 <= wait <= seconds  # the wait for the device's tokens is in the turn
            old = sums.get(kind, [0, 0, 0.0])
            sums[kind] = [old[0] + steps, old[1] + requests, old[2] + seconds]
        return sums

    def settled() -> dict[str, list]:  # stats come every 50 ms: two reports agree
        last, now = None, totals()
        while now != last:
            time.sleep(0.2)
            last, now = now, totals()
        return now

    before = settled()  # an earlier test's last steps included

    async def run():
        front = await _front(client)
        calls = [GenerateCall(f"steps{i}", [3 + i, 5, 8, 13], GREEDY) for i in range(4)]
        await asyncio.gather(*[_collect(front, c) for c in calls])
        front.close()

    asyncio.run(run())
    expected = 4 * GREEDY.max_tokens
    deadline = time.monotonic() + 10
    while True:  # the next stats report carries the last steps
        after = totals()
        grown = {
            k: [a - b for a, b in zip(v, before.get(k, [0, 0, 0.0]))] for k, v in after.items()
        }
        if sum(g[1] for g in grown.values()) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sum(g[1] for g in grown.values()) == expected, grown
    prompts = grown["prefill"][1] + grown.get("mixed", [0, 0])[1]  # mixed: decodes too
    assert grown["prefill"][1] >= 1 and prompts >= 4, grown
    assert grown["decode"][1] >= 4 * (GREEDY.max_tokens - 1 - 3), grown
    assert all(g[2] > 0 for g in grown.values() if g[0])


def test_a_stream_interval_sends_a_streams_tokens_in_runs():
    config = {**CONFIG, "scheduler": {**CONFIG["scheduler"], "stream_interval": 4}}
    client = EngineClient(EngineConfig.from_dict(config), secret=SECRET)

    async def run():
        front = await _front(client)
        calls = [GenerateCall(f"s{i}", [3 + i, 5, 8, 13], GREEDY) for i in range(3)]
        runs = await asyncio.gather(*[_token_runs(front, c) for c in calls])
        front.close()
        return runs

    try:
        served = asyncio.run(run())
    finally:
        client.shutdown()
    offline = LLM(**CONFIG).generate([[3 + i, 5, 8, 13] for i in range(3)], GREEDY)
    for runs, out in zip(served, offline):
        assert [len(r) for r in runs] == [1, 4, 4, 3]  # 12 tokens: the first at once
        assert sum(runs, []) == out.outputs[0].token_ids


async def _token_runs(front: EngineConnection, call: GenerateCall) -> list[list[int]]:
    runs = []
    async for events in front.generate(call):
        runs += [e.token_ids for e in events if isinstance(e, Delta) and e.token_ids]
    return runs


def test_an_invalid_request_is_rejected_and_the_engine_goes_on(client):
    async def run():
        front = await _front(client)
        bad = GenerateCall("bad", [10**9], GREEDY)  # a token id beyond the vocabulary
        events = [e async for batch in front.generate(bad) for e in batch]
        good = await _collect(front, GenerateCall("good", [5, 6, 7], GREEDY))
        front.close()
        return events, good

    events, (tokens, _) = asyncio.run(run())
    assert len(events) == 1 and isinstance(events[0], Rejected)
    assert "out of range" in events[0].message
    assert len(tokens) == GREEDY.max_tokens and client.alive


def test_a_decode_worker_answers_a_remote_call_with_its_route_and_ticket_at_once():
    """Blocks free: the route and the KV ticket come back in the call's first frame, so
    the front calls the prefill worker without waiting for the decode loop's next step;
    with none free the ticket follows once a finished request returns its blocks."""
    config = {**CONFIG, "role": "decode", "kv_transfer": {"transport": "cpu"}}
    config["cache"] = {"num_kv_blocks": 5, "block_size": 16}  # 4 usable blocks: 64 tokens
    config["scheduler"] = {"max_model_len": 64, "max_num_seqs": 16}
    decode = EngineClient(EngineConfig.from_dict(config), secret=SECRET)

    async def run():
        front = await _front(decode)
        first = front.generate(GenerateCall("a", [5] * 40, GREEDY, remote=True))
        first_events = await anext(first)
        second = front.generate(GenerateCall("b", [6] * 40, GREEDY, remote=True))
        second_events = await anext(second)
        await first.aclose()  # "a" never gets its KV: leaving frees its blocks
        later = await anext(second)
        await second.aclose()
        front.close()
        return first_events, second_events, later

    try:
        first, second, later = asyncio.run(run())
    finally:
        decode.shutdown()
    assert [type(e).__name__ for e in first] == ["Routed", "TicketIssued"]
    assert first[0].route == "disaggregated"
    assert [type(e).__name__ for e in second] == ["Routed"]  # 3 blocks, 1 left: it waits
    assert [type(e).__name__ for e in later] == ["TicketIssued"]


def _wait_all_blocks_free(client: EngineClient) -> None:
    deadline = time.monotonic() + 5
    while client.stats.num_free_blocks != client.stats.num_blocks or client.stats.num_running:
        assert time.monotonic() < deadline, client.stats
        time.sleep(0.05)


LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def test_leaving_a_stream_aborts_its_request_and_frees_its_blocks(client):
    async def run():
        front = await _front(client)
        async for _ in front.generate(GenerateCall("left", [3] * 40, LONG)):
            break  # the caller leaves after the first step's events
        await asyncio.sleep(0.2)  # the abort is written before the connection closes
        front.close()

    asyncio.run(run())
    _wait_all_blocks_free(client)


def test_a_closed_connection_aborts_its_requests_and_frees_their_blocks(client):
    async def run():
        front = await _front(client)
        streams = [front.generate(GenerateCall(f"c{i}", [3] * 40, LONG)) for i in range(3)]
        for s in streams:
            await s.__anext__()  # every request is running
        front._writer.transport.abort()  # as a front that died: no Abort is sent

    asyncio.run(run())
    _wait_all_blocks_free(client)


def test_a_front_aborts_only_its_own_requests(client):
    async def run():
        owner, stranger = await _front(client), await _front(client)
        stranger._send(Abort("mine"))
        tokens, _ = await _collect(owner, GenerateCall("mine", [5, 6], GREEDY))
        owner.close(), stranger.close()
        return tokens

    assert len(asyncio.run(run())) == GREEDY.max_tokens


def test_beyond_max_requests_a_call_is_overloaded_and_the_others_go_on(client):
    async def run():
        front = await _front(client)
        streams = [front.generate(GenerateCall(f"o{i}", [7, 8], LONG)) for i in range(9)]
        firsts = [(await s.__anext__())[0] for s in streams]
        for s in streams:
            await s.aclose()
        front.close()
        return firsts

    firsts = asyncio.run(run())
    assert [type(e) for e in firsts] == [Delta] * 8 + [Overloaded]
    assert "holds its 8 requests" in firsts[-1].message
    _wait_all_blocks_free(client)


def test_a_wrong_secret_or_an_oversized_frame_closes_the_connection_only(client):
    import socket
    import struct

    async def run():
        wrong = await _front(client, secret="guess")
        call = GenerateCall("w", [5], GREEDY)
        events = [e async for batch in wrong.generate(call) for e in batch]
        assert isinstance(events[-1], Failed) and not wrong.alive
        with socket.create_connection(client.address.rsplit(":", 1)) as raw:
            raw.sendall(messages.framed(messages.encode(messages.Hello(SECRET))))
            raw.sendall(struct.pack("!i", (1 << 31) - 1))  # announces a 2 GiB frame
            raw.settimeout(10)
            while raw.recv(1 << 16):  # its stats came; then it closes, reading none of it
                pass
        return await _collect(await _front(client), GenerateCall("after", [5], GREEDY))

    tokens, _ = asyncio.run(run())
    assert len(tokens) == GREEDY.max_tokens and client.alive


def test_a_profile_call_is_answered_and_profiling_off_says_how_to_turn_it_on(client):
    async def run():
        front = await _front(client)
        answers = [await front.profile(start=True)]
        asked = asyncio.ensure_future(front.profile(start=False))
        await asyncio.sleep(0)  # the call is sent; its answer can come in no sooner
        open_call_stalled = front.stalled(0.0)  # 0 s: any engine not answering one is
        answers.append(await asked)
        tokens, _ = await _collect(front, GenerateCall("after-profile", [3, 4, 5], GREEDY))
        after = front.stalled(0.0)
        front.close()
        return answers, tokens, open_call_stalled, after

    answers, tokens, open_call_stalled, after = asyncio.run(run())
    assert open_call_stalled is None and after is not None
    for answer in answers:  # this engine has no torch_profiler_dir
        assert answer.trace is None and "--torch-profiler-dir" in answer.error
    assert answers[0].call_id != answers[1].call_id
    assert len(tokens) == GREEDY.max_tokens and client.alive  # it serves on


def test_a_start_failure_raises_the_engines_own_error():
    config = EngineConfig.from_dict({**CONFIG, "scheduler": {"max_model_len": 100000}})
    with pytest.raises(EngineStartError, match="max_position_embeddings"):
        EngineClient(config)


def test_a_killed_engine_ends_every_stream_with_an_error():
    client = EngineClient(EngineConfig.from_dict(CONFIG))

    async def run():
        front = await _front(client, secret="")
        streams = [front.generate(GenerateCall(f"k{i}", [4, 5, 6], LONG)) for i in range(3)]
        first = [await s.__anext__() for s in streams]  # every request is running
        os.kill(client.pid, signal.SIGKILL)
        last = []
        for s in streams:
            events = [e for batch in [b async for b in s] for e in batch]
            last.append(events[-1])
        return first, last

    try:
        _, last = asyncio.run(asyncio.wait_for(run(), 30))
        assert all(isinstance(e, Failed) and "connection" in e.message for e in last)
        deadline = time.monotonic() + 5
        while client.alive:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "exited with code -9" in client.error
    finally:
        client.shutdown()


def test_an_exited_engine_says_why_before_its_reader_sees_the_pipe_close():
    """From the moment the process has exited the client is not alive and names the exit,
    whether or not its reader thread has run yet (a health check once read ``None``)."""
    client = object.__new__(EngineClient)  # the process alone: no reader thread
    client._error = None
    client.process = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    client.process.wait()
    assert not client.alive
    assert client.error == "the engine process exited with code -9"


def test_the_engine_process_does_not_outlive_its_replica(tmp_path):
    """A replica killed without shutting down: its engine process exits on its own."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from splitserve.config import EngineConfig
        from splitserve.workers.engine.engine_client import EngineClient
        client = EngineClient(EngineConfig.from_dict({CONFIG!r}))
        print(client.pid, flush=True)
        os._exit(0)  # no shutdown: as a replica killed by Ray
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    engine_pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _running(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived its replica"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_messages_round_trip_through_the_codec():
    params = SamplingParams(max_tokens=3, stop=["x"], seed=7, logprobs=2)
    lp = TokenLogprobs(5, -0.5, [(5, -0.5), (9, -1.25)])
    step = StepEvents(
        [
            Delta("a", [5], "hi", [lp], "stop", "x", 3, None),
            TicketIssued("b", b"\x00ticket"),
            Rejected("c", "bad prompt"),
        ]
    )
    call = GenerateCall("a", [1, 2], params, remote=True, local_prefix_ratio=0.5)
    assert messages.decode(messages.encode(call)) == call
    decoded = messages.decode(messages.encode(step))
    assert decoded.events[1:] == step.events[1:]
    delta = decoded.events[0]
    assert delta.token_ids == [5] and delta.finish_reason == "stop" and delta.stop_reason == "x"
    assert [tuple(pair) for pair in delta.logprobs[0].top] == lp.top
    from splitserve.workers.engine.core_process import Drain, Shutdown  # no fields

    assert [type(messages.decode(messages.encode(m()))) for m in (Drain, Shutdown)] == [
        Drain,
        Shutdown,
    ]
    with pytest.raises(TypeError, match="FirstTokenTimes2 is not a message type"):
        messages.encode(StepEvents([type("FirstTokenTimes2", (), {})()]))


def test_merged_deltas_keep_every_token_in_order():
    from splitserve.workers.output.request_output import FirstTokenTimes

    times = FirstTokenTimes(0.001, 0.04)  # on the first token's delta only
    a = Delta("r", [1, 2], "ab", None, None, None, 0, None, times)
    b = Delta("r", [3], "c", None, "length", None, 4, None)
    merged = merge_deltas([a, b])
    assert merged.token_ids == [1, 2, 3] and merged.text == "abc"
    assert merged.finish_reason == "length" and merged.num_cached_tokens == 4
    assert merged.first_token_times == times  # the TTFT split survives a lagging consumer
    assert messages.decode(messages.encode(merged)).first_token_times == times


def test_the_ingress_merges_a_lists_deltas_and_raises_on_rejection_or_failure():
    """``worker_calls.guard``: one worker item (a list of events) becomes its events with
    each run of deltas merged; ``Rejected`` is the ingress's 400, ``Overloaded``
    ``WorkerBusy``, ``Failed`` or an error delta ``WorkerFailed``."""
    from splitserve.cluster.openai_api import OpenAIError
    from splitserve.cluster.worker_calls import WorkerBusy, WorkerFailed, guard
    from splitserve.workers.engine.messages import Routed

    async def items(*lists):
        for events in lists:
            yield events

    async def take(call):
        return [e async for e in guard(call, "decode worker d1")]

    a = Delta("r", [1], "a", None, None, None, 0, None)
    b = Delta("r", [2, 3], "bc", None, "length", None, 0, None)
    events = asyncio.run(take(items([Routed("r", "disaggregated"), a, b])))
    assert events[0] == Routed("r", "disaggregated") and len(events) == 2
    assert events[1].token_ids == [1, 2, 3] and events[1].finish_reason == "length"
    with pytest.raises(OpenAIError) as rejected:
        asyncio.run(take(items([Rejected("r", "prompt is empty")])))
    assert rejected.value.status == 400 and "prompt is empty" in str(rejected.value)
    with pytest.raises(WorkerBusy, match="the decode worker d1 is busy: holds its 8"):
        asyncio.run(take(items([Overloaded("r", "holds its 8 requests")])))
    with pytest.raises(WorkerFailed, match="^the connection to decode worker d1 ended"):
        asyncio.run(take(items([a], [Failed("r", "the connection to decode worker d1 ended")])))
    error = Delta("r", [], "", None, "error", None, 0, "KV transfer timed out")
    with pytest.raises(WorkerFailed, match="the decode worker d1 failed: KV transfer timed out"):
        asyncio.run(take(items([error])))


def test_a_long_step_is_not_hung_until_the_step_timeout(monkeypatch):
    """An engine loop held inside one step (here the fault injection's 3 s after a prompt
    chunk; on GPUs a kernel build at first use) sends no stats, but its process's
    heartbeats say it is in a step: the watchdog waits for ``step_timeout_s``, and
    without one (or past it) reports it. A stopped process does not beat at all."""
    monkeypatch.setenv("SPLITSERVE_PREFILL_STEP_DELAY_S", "3")
    config = {**CONFIG, "scheduler": {**CONFIG["scheduler"], "max_num_batched_tokens": 16}}
    client = EngineClient(EngineConfig.from_dict(config))

    async def run():
        front = await _front(client, secret="")
        stream = front.generate(GenerateCall("long", list(range(1, 33)), GREEDY))
        task = asyncio.ensure_future(stream.__anext__())
        while client.in_step_s == 0.0:  # a heartbeat from inside the first chunk's step
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.2)  # the step has run at least 1.2 s of its 3
        seen = (client.stalled(1.0, 60.0), client.stalled(1.0), client.stalled(1.0, 1.0))
        os.kill(client.pid, signal.SIGSTOP)
        await asyncio.sleep(2.5)
        stopped = client.stalled(1.0, 60.0)
        os.kill(client.pid, signal.SIGCONT)
        task.cancel()
        front.close()
        return seen, stopped

    try:
        (long_step, no_step_timeout, past_it), stopped = asyncio.run(asyncio.wait_for(run(), 30))
        assert long_step is None
        assert no_step_timeout is not None and "no stats" in no_step_timeout
        assert past_it is not None and "one step has run for" in past_it
        assert stopped is not None and "one step" not in stopped
    finally:
        os.kill(client.pid, signal.SIGCONT)
        client.shutdown()
