"""One request's failure stays its own: sampling params are checked against what the
engine represents, and a request that still fails inside the engine loop (its sampling or
its output processing raises) ends alone with an error while the others finish and every
KV block returns to the pool."""

from __future__ import annotations

import pytest

from splitserve.config import CacheConfig, EngineConfig, RequestLimits, SchedulerConfig
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.engine.messages import GenerateCall, decode, encode

GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 33, 9, 41, 2, 77]


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(
        model="qwen3-tiny",
        device="cpu",
        cache=CacheConfig(num_kv_blocks=64),
        scheduler=SchedulerConfig(max_model_len=128, async_scheduling=False),
    )
    return LLMEngine(config, delta_outputs=True)


def _run(engine: LLMEngine, requests: dict[str, SamplingParams], poison=None) -> dict:
    for rid, params in requests.items():
        engine.add_request(rid, PROMPT, params)
    if poison is not None:  # past the engine's own checks, as a bug elsewhere could
        poison(requests["poisoned"])
    results = {rid: {"tokens": [], "error": None, "finish": None} for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"] += out.new_token_ids
            r["error"] = r["error"] or out.error
            r["finish"] = out.outputs[0].finish_reason or r["finish"]
    return results


@pytest.mark.parametrize(
    "poison",
    [
        pytest.param(lambda p: setattr(p, "seed", 2**64), id="seed-beyond-64-bits"),
        pytest.param(lambda p: setattr(p, "top_k", 2**70), id="top_k-beyond-int64"),
        pytest.param(lambda p: setattr(p, "stop", [12345]), id="stop-not-a-string"),
    ],
)
def test_a_poisoned_request_fails_alone(engine, poison):
    free_before = engine.block_manager.num_free_blocks
    alone = _run(engine, {"ref": SamplingParams(**GREEDY)})["ref"]["tokens"]
    poisoned = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    results = _run(
        engine,
        {
            "good-greedy": SamplingParams(**GREEDY),
            "poisoned": poisoned,
            "good-seeded": SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
        },
        poison,
    )
    assert results["poisoned"]["finish"] == "error"
    assert "could not process the request" in results["poisoned"]["error"]
    assert results["good-greedy"] == {"tokens": alone, "error": None, "finish": "length"}
    assert len(results["good-seeded"]["tokens"]) == 8
    assert results["good-seeded"]["error"] is None
    assert engine.block_manager.num_free_blocks == free_before
    assert not engine.sampler.failures
    # The loop goes on: the next request is served as before.
    assert _run(engine, {"after": SamplingParams(**GREEDY)})["after"]["tokens"] == alone


@pytest.mark.parametrize(
    "field, value, accepted",
    [
        ("seed", 2**64, "[-9223372036854775808, 18446744073709551615]"),
        ("seed", -(2**63) - 1, "[-9223372036854775808, 18446744073709551615]"),
        ("top_k", 2**31, "[-1, 2147483647]"),
        ("max_tokens", 2**40, "[1, 2147483647]"),
        ("min_tokens", 9, "[0, max_tokens=8]"),
        ("logprobs", -1, "[0, 2147483647]"),
        ("temperature", float("inf"), "a finite number >= 0"),
        ("top_p", float("nan"), "a finite number in (0, 1]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("stop_token_ids", [2**31], "token ids in [0, 2147483647]"),
        ("stop", ["\ud800"], "valid Unicode"),
        ("ignore_eos", 1, "true or false"),
    ],
)
def test_sampling_params_name_the_field_and_the_accepted_range(field, value, accepted):
    kwargs = {"max_tokens": 8, field: value}
    with pytest.raises(ValueError, match=rf"invalid {field}=") as info:
        SamplingParams(**kwargs)
    assert accepted in str(info.value)


def test_every_accepted_value_crosses_the_process_boundary():
    params = SamplingParams(
        max_tokens=2**31 - 1, seed=2**64 - 1, top_k=2**31 - 1, stop_token_ids=[2**31 - 1]
    )
    call = decode(encode(GenerateCall("r", PROMPT, params)))
    assert call.params == params
    assert decode(encode(SamplingParams(seed=-(2**63)))).seed == -(2**63)


def test_the_engine_checks_params_again_at_admission(engine):
    params = SamplingParams(max_tokens=8)
    params.seed = 2**64
    with pytest.raises(InvalidRequestError, match=r"invalid seed=.*an integer in \[-9223"):
        engine.add_request("changed", PROMPT, params)
    assert not engine.has_unfinished_requests()


def test_list_limits_are_checked_by_the_engine(engine):
    limits = RequestLimits()
    too_many = SamplingParams(stop=[f"s{i}" for i in range(limits.max_stop_strings + 1)])
    with pytest.raises(InvalidRequestError, match=r"invalid stop=.*at most 64 strings"):
        engine.add_request("many-stops", PROMPT, too_many)
    too_long = SamplingParams(stop=["x" * (limits.max_stop_string_chars + 1)])
    with pytest.raises(InvalidRequestError, match="at most 1024 characters"):
        engine.add_request("long-stop", PROMPT, too_long)
    ids = SamplingParams(stop_token_ids=list(range(limits.max_stop_token_ids + 1)))
    with pytest.raises(InvalidRequestError, match="invalid stop_token_ids=.*at most 1024"):
        engine.add_request("many-ids", PROMPT, ids)
    assert not engine.has_unfinished_requests()


def test_limits_are_config_keys():
    config = EngineConfig.from_dict({"limits": {"max_stop_strings": 2}})
    assert config.limits.max_stop_strings == 2
    with pytest.raises(ValueError, match="unknown config key 'limits.max_stops'"):
        EngineConfig.from_dict({"limits": {"max_stops": 2}})
    with pytest.raises(ValueError, match="invalid limits.max_bad_words=0"):
        EngineConfig.from_dict({"limits": {"max_bad_words": 0}})
