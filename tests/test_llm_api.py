"""The offline API on the embedded preset: bad input, stop strings, seeds, abort."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.errors import InvalidRequestError

FREE = 255  # usable blocks of the engines below (256 minus the null page)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("qwen3-tiny", max_model_len=64, block_size=4, num_kv_blocks=FREE + 1)


def test_one_bad_prompt_is_rejected_and_the_others_finish(llm):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(1, 101)), {"prompt_token_ids": [1, 10**6]}, "", [8, 9]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert "100 tokens" in outs[1].error and "at most 63" in outs[1].error
    assert "out of range" in outs[2].error and "[0, 512)" in outs[2].error
    assert "empty" in outs[3].error
    assert [len(o.outputs[0].token_ids) for o in (outs[0], outs[4])] == [8, 8]
    assert llm.engine.block_manager.num_free_blocks == FREE


def test_engine_rejects_with_a_clear_error(llm):
    with pytest.raises(InvalidRequestError, match="already in use"):
        llm.engine.add_request("dup", [1, 2])
        llm.engine.add_request("dup", [1, 2])
    llm.engine.abort_request("dup")
    with pytest.raises(InvalidRequestError, match="string or a list of token ids"):
        llm.engine.add_request("x", 3.5)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"temperature": -1.0}, ["temperature", ">= 0"]),
        ({"top_p": 0.0}, ["top_p", "(0, 1]"]),
        ({"top_k": -3}, ["top_k", "[-1, 2147483647]"]),
        ({"max_tokens": 0}, ["max_tokens", "[1, 2147483647]"]),
        ({"min_p": 2.0}, ["min_p", "[0, 1]"]),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert all(w in str(e.value) for w in words)


def test_bad_engine_settings_are_named():
    with pytest.raises(ValueError, match="unknown dtype 'float8'; accepted: float32, bfloat16"):
        LLM("qwen3-tiny", dtype="float8")
    with pytest.raises(ValueError, match="qwen3-tiny"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="unknown config key 'blocksize'"):
        LLM("qwen3-tiny", blocksize=8)


def _token_boundaries(tokenizer, ids: list[int]) -> list[int]:
    return [len(tokenizer.decode(ids[:i])) for i in range(1, len(ids))]


def test_stop_string_across_tokens_is_cut_from_the_output(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(["Hello world"], greedy, use_tqdm=False)[0].outputs[0]
    text = full.text
    # A stop string made of the last character of one token and the next two characters.
    cut = next(b for b in _token_boundaries(llm.tokenizer, full.token_ids) if 4 < b < len(text) - 2)
    stop = text[cut - 1 : cut + 2]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    out = llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert llm.engine.block_manager.num_free_blocks == FREE


def test_seeded_sampling_ignores_the_rest_of_the_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=10, temperature=1.3, top_k=50, ignore_eos=True)
    alone = llm.generate(["Once upon"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["a b c", "Once upon", "The fox jumps"], [other, seeded, other], use_tqdm=False
    )
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert llm.generate(["Once upon"], unseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_abort_at_any_point_frees_every_block(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", list(range(1 + i, 30 + i)), params)
    engine.step()
    engine.step()
    assert engine.abort_request("a0")  # running
    engine.add_request("late", [3, 4, 5], params)
    assert engine.abort_request("late")  # still waiting
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "a1" and len(out.outputs[0].token_ids) == 5:
                assert engine.abort_request("a1")  # mid-decode
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["a2", "a3"]
    assert not engine.abort_request("a2")  # already finished
    assert engine.block_manager.num_free_blocks == FREE


def test_step_outputs_stream_deltas_and_count_tokens(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    engine.add_request("s0", [5, 6, 7, 8, 9], params)
    engine.add_request("s1", [10, 11, 12], params)
    texts, tokens, finals = {"s0": "", "s1": ""}, {"s0": [], "s1": []}, {}
    counts = []
    while engine.has_unfinished_requests():
        # The prefill step's tokens go out with it, or with the next step when the engine
        # schedules asynchronously (on a GPU).
        outs = engine.step()
        counts.append((engine.last_step.num_prefill_tokens, engine.last_step.num_decode_tokens))
        for out in outs:
            texts[out.request_id] += out.new_text
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert counts[:2] == [(8, 0), (0, 2)]
    assert sorted(finals) == ["s0", "s1"]
    for rid, final in finals.items():
        assert tokens[rid] == final.token_ids
        assert final.text == texts[rid]
        assert len(final.logprobs) == 6
        assert all(
            lp.token_id == t and len(lp.top) == 3 for lp, t in zip(final.logprobs, final.token_ids)
        )
        assert all(lp.logprob <= 0 for lp in final.logprobs)


def test_delta_outputs_carry_only_what_is_new(llm):
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.workers.engine.llm_engine import LLMEngine

    config = EngineConfig(
        device="cpu",
        cache=CacheConfig(num_kv_blocks=64),
        scheduler=SchedulerConfig(max_model_len=64),
    )
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2)
    full, delta = LLMEngine(config), LLMEngine(config, delta_outputs=True)
    for engine in (full, delta):
        engine.add_request("d", [5, 6, 7, 8], params)
    text, tokens, logprobs, last = "", [], [], None
    while delta.has_unfinished_requests():
        for out in delta.step():
            completion = out.outputs[0]
            assert completion.token_ids == out.new_token_ids and completion.text == out.new_text
            assert out.prompt_token_ids == []  # the stream's caller has the prompt
            text, tokens = text + completion.text, tokens + completion.token_ids
            logprobs += completion.logprobs
    while full.has_unfinished_requests():
        last = full.step()[-1]
    assert tokens == last.outputs[0].token_ids and text == last.outputs[0].text
    assert [lp.token_id for lp in logprobs] == [lp.token_id for lp in last.outputs[0].logprobs]


@pytest.mark.parametrize("max_tokens", [1, 7, 8, 9])
def test_a_stream_interval_batches_a_streams_tokens_and_loses_none(max_tokens):
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.workers.engine.llm_engine import LLMEngine

    def engine(interval: int, delta: bool) -> LLMEngine:
        scheduler = SchedulerConfig(max_model_len=64, stream_interval=interval)
        cache = CacheConfig(num_kv_blocks=64)
        return LLMEngine(EngineConfig(device="cpu", cache=cache, scheduler=scheduler), delta)

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    whole, stream = engine(3, delta=False), engine(3, delta=True)
    sizes, tokens, text, logprobs, final = [], [], "", [], None
    for e in (whole, stream):
        e.add_request("s", [5, 6, 7, 8], params)
    while stream.has_unfinished_requests():
        for out in stream.step():
            sizes.append(len(out.new_token_ids))
            tokens, text = tokens + out.new_token_ids, text + out.new_text
            logprobs += out.outputs[0].logprobs
    while whole.has_unfinished_requests():
        outs = whole.step()
        assert [len(o.outputs[0].token_ids) for o in outs] == [len(outs[0].outputs[0].token_ids)]
        final = outs[0].outputs[0]  # whole outputs: every step, the interval aside
    # the first token at once, then three at a time, the last at once
    rest = max_tokens - 1
    assert sizes == [1] + [3] * (rest // 3) + ([rest % 3] if rest % 3 else [])
    assert tokens == final.token_ids and text == final.text
    assert [lp.token_id for lp in logprobs] == final.token_ids


def test_a_stream_interval_below_one_is_named():
    from splitserve.config import SchedulerConfig

    for bad in (0, -2, 1.5, "4"):
        with pytest.raises(ValueError, match="invalid stream_interval=.*must be an integer >= 1"):
            SchedulerConfig(stream_interval=bad).check()


def test_the_first_token_says_how_long_it_queued_and_prefilled():
    from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.workers.engine.llm_engine import LLMEngine

    # 8 tokens a step: "long" prefills in three steps, "short" waits two of them.
    scheduler = SchedulerConfig(max_model_len=64, max_num_batched_tokens=8)
    engine = LLMEngine(
        EngineConfig(device="cpu", cache=CacheConfig(num_kv_blocks=64), scheduler=scheduler),
        delta_outputs=True,
    )
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("long", list(range(1, 21)), params)
    engine.add_request("short", [5, 6, 7, 8], params)
    times = {"long": [], "short": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                times[out.request_id].append(out.first_token_times)
    long, short = times["long"][0], times["short"][0]
    assert all(t is None for t in times["long"][1:] + times["short"][1:])  # the first only
    assert 0 <= long.queued_s < short.queued_s  # "short" waited for two of long's chunks
    assert long.prefill_s > short.prefill_s > 0  # three steps against one


def test_an_unknown_warmup_setting_is_named(monkeypatch):
    from splitserve.workers.engine.llm_engine import warms_up

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (warms_up(cpu), warms_up(cuda)) == (False, True)  # auto: on a GPU
    monkeypatch.setenv("SPLITSERVE_WARMUP", "1")
    assert warms_up(cpu)
    monkeypatch.setenv("SPLITSERVE_WARMUP", "yes")
    with pytest.raises(ValueError, match="SPLITSERVE_WARMUP='yes': must be auto, 0 or 1"):
        warms_up(cpu)


def test_engine_settings_that_cannot_work_are_named():
    from splitserve.config import EngineConfig

    with pytest.raises(ValueError, match="unknown config key 'cache.blok_size'"):
        EngineConfig.from_dict({"cache": {"blok_size": 8}})
    with pytest.raises(ValueError, match="config section 'scheduler' must be a mapping"):
        EngineConfig.from_dict({"scheduler": 3})
    with pytest.raises(ValueError, match="invalid load_format='pt': must be auto or dummy"):
        EngineConfig(load_format="pt")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=4096"):
        LLM("qwen3-tiny", max_model_len=5000)
    with pytest.raises(ValueError, match="needs 33"):
        LLM("qwen3-tiny", max_model_len=128, block_size=4, num_kv_blocks=10)


def test_unknown_environment_variable_is_an_error():
    from splitserve.config import env

    with pytest.raises(KeyError, match="SPLITSERVE_DEVCE"):
        env("SPLITSERVE_DEVCE")


def test_a_profile_window_writes_a_chrome_trace_of_the_engines_steps(tmp_path):
    from splitserve.workers.engine.torch_profiler import ProfilerOff, read_trace, step_names

    with pytest.raises(ProfilerOff, match="--torch-profiler-dir"):
        LLM("qwen3-tiny", max_model_len=64).start_profile()
    llm = LLM("qwen3-tiny", max_model_len=64, torch_profiler_dir=str(tmp_path / "traces"))
    with pytest.raises(InvalidRequestError, match="no profile running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(InvalidRequestError, match="already running"):
        llm.start_profile()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False)
    path = llm.stop_profile()
    assert path.startswith(str(tmp_path / "traces")) and path.endswith(".trace.json.gz")
    steps = step_names(read_trace(path))
    # One prompt step of both requests, then a decode step a token after the first.
    assert steps == ["engine_step[prefill b2]"] + ["engine_step[decode b2]"] * 3
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    llm.start_profile()  # a second window, its own file
    assert llm.stop_profile() != path
