"""MTP speculative decoding in the engine (CPU, torch attention): lossless against decoding
without it, acceptance as the checkpoint's drafter allows, and every KV block returned.

Checkpoints (``tests/mtp_checkpoints.py``): random weights (the drafter almost never
agrees: the rejection path), a drafter that always agrees with the target
(acceptance 1), one that agrees exactly when the target's token is outside a known
set (a known fraction, checked against a replay of the target's own tokens), and a
target whose context moves its predictions (the drafter agrees now and then, and the
accepted drafts' KV feeds later steps).
"""

from __future__ import annotations

import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine
from tests import checkpoints
from tests.mtp_checkpoints import swapped_tokens, write_glm4_moe_drafter

GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
SWAPPED_PAIRS = 96


@pytest.fixture(scope="module")
def random_glm(tmp_path_factory):
    return checkpoints.write_glm4_moe(tmp_path_factory.mktemp("glm-random"))


@pytest.fixture(scope="module")
def agreeing_glm(tmp_path_factory):
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-agree"))


@pytest.fixture(scope="module")
def swapped_glm(tmp_path_factory):
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-swap"), swapped_pairs=SWAPPED_PAIRS)


@pytest.fixture(scope="module")
def context_glm(tmp_path_factory):
    return write_glm4_moe_drafter(tmp_path_factory.mktemp("glm-context"), context_scale=0.15)


def engine(path, k: int = 0, num_kv_blocks: int = 128, **scheduler) -> LLMEngine:
    spec = SpeculativeConfig("mtp", k) if k else None
    return LLMEngine(
        EngineConfig(
            model=str(path),
            device="cpu",
            attention_backend="torch",
            cache=CacheConfig(block_size=4, num_kv_blocks=num_kv_blocks),
            scheduler=SchedulerConfig(max_model_len=64, **scheduler),
            speculative_config=spec,
        )
    )


def prompts() -> list[list[int]]:
    """Different lengths; the last two share a 12-token prefix (prefix-cache hits)."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(1, 512, (12,), generator=g).tolist()
    lengths = (2, 9, 23)
    out = [torch.randint(1, 512, (n,), generator=g).tolist() for n in lengths]
    return out + [shared + [3, 4], shared + [5, 6, 7]]


def generate(
    eng: LLMEngine, batch, params=GREEDY, abort: str | None = None, requests=None, cached=None
) -> dict[str, list]:
    """Token ids per request id; ``abort``: that request is aborted after 3 steps;
    ``requests`` and ``cached`` (dicts) receive each request and its prefix-cache hit."""
    requests = {} if requests is None else requests
    for i, p in enumerate(batch):
        requests[f"r{i}"] = eng.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            if cached is not None:
                cached[out.request_id] = out.num_cached_tokens
        steps += 1
        if abort is not None and steps == 3:
            assert eng.abort_request(abort)
            tokens.pop(abort)
    return tokens


def assert_all_blocks_free(eng: LLMEngine) -> None:
    assert not eng.scheduler.requests
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


# ---- configuration


def test_speculative_config_has_one_spelling():
    config = EngineConfig.from_dict(
        {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}
    )
    assert config.speculative_config == SpeculativeConfig("mtp", 3)
    assert config.num_speculative_tokens == 3
    assert EngineConfig.from_dict({"speculative_config": None}).num_speculative_tokens == 0
    with pytest.raises(ValueError, match="unknown config key 'speculative_config.num_draft'"):
        EngineConfig.from_dict({"speculative_config": {"num_draft": 2}})
    with pytest.raises(ValueError, match="num_speculative_tokens=0: must be an integer >= 1"):
        EngineConfig.from_dict({"speculative_config": {"num_speculative_tokens": 0}})
    with pytest.raises(ValueError, match="method='eagle': must be one of mtp"):
        EngineConfig.from_dict({"speculative_config": {"method": "eagle"}})
    both = {"speculative_config": {}, "parallel": {"expert_parallel_size": 2}}
    assert EngineConfig.from_dict(both).num_speculative_tokens == 1  # MTP with EP


def test_a_model_without_an_mtp_layer_is_refused_at_start_up(tmp_path, random_glm):
    qwen = checkpoints.write_qwen3(tmp_path / "qwen3")
    with pytest.raises(ValueError, match="needs the checkpoint's MTP layer.*Qwen3ForCausalLM"):
        engine(qwen, k=2)
    no_mtp = tmp_path / "glm-no-mtp"
    no_mtp.mkdir()
    for file in random_glm.iterdir():
        (no_mtp / file.name).symlink_to(file)
    (no_mtp / "model.safetensors.index.json").unlink()
    (no_mtp / "model-mtp.safetensors").unlink()
    with pytest.raises(ValueError, match="needs the checkpoint's MTP layer"):
        engine(no_mtp, k=1)


# ---- lossless greedy decoding


@pytest.mark.parametrize("checkpoint", ["random_glm", "agreeing_glm", "context_glm"])
def test_greedy_tokens_equal_decoding_without_speculation(checkpoint, request):
    """Batched prompts of different lengths, chunked prefill (a 16-token budget) and
    prefix-cache hits: K = 1, 2, 3 give exactly the tokens of decoding without MTP."""
    path = request.getfixturevalue(checkpoint)
    batch = prompts()
    expected = generate(engine(path, max_num_batched_tokens=16), batch)
    rates = []
    for k in (1, 2, 3):
        eng = engine(path, k, max_num_batched_tokens=16)
        cached = {}
        assert generate(eng, batch, cached=cached) == expected, f"K={k}"
        assert cached["r4"] > 0  # the shared prefix came from the cache
        assert_all_blocks_free(eng)
        stats = eng.spec_stats
        assert stats.num_draft_tokens > 0
        rates.append(stats.acceptance_rate)
    if checkpoint == "random_glm":
        assert max(rates) < 0.05  # the rejection path, nearly every step
    elif checkpoint == "agreeing_glm":
        assert rates == [1.0, 1.0, 1.0]
    else:
        assert min(rates) > 0.05 and max(rates) < 0.95  # some drafts right, some wrong


def replay_acceptance(tokens: list[int], k: int, max_tokens: int, wrong: set):
    """Drafts and accepted drafts that the swapped drafter must give for a request whose
    output is ``tokens``: a draft is right exactly when the target's token it guesses is
    not in ``wrong``, and a run stops at the first wrong draft; the scheduler keeps
    ``min(k, tokens left - 1)`` drafts a step."""
    drafts = accepted = 0
    emitted = 1  # the first token comes from the prefill step
    while emitted < max_tokens:
        n = min(k, max_tokens - emitted - 1)
        a = 0
        while a < n and tokens[emitted + a] not in wrong:
            a += 1
        drafts, accepted = drafts + n, accepted + a
        emitted += a + 1
    return drafts, accepted


def test_known_fraction_of_drafts_is_accepted(swapped_glm):
    """The swapped drafter's drafts and acceptances per request equal a replay of the
    target's tokens, and are a fraction strictly between 0 and 1."""
    batch = prompts()[:3]
    expected = generate(engine(swapped_glm), batch)
    wrong = swapped_tokens(SWAPPED_PAIRS)
    for k in (1, 3):
        eng = engine(swapped_glm, k)
        requests = {}
        assert generate(eng, batch, requests=requests) == expected
        total = [0, 0]
        for i in range(len(batch)):
            r = requests[f"r{i}"]
            want = replay_acceptance(expected[f"r{i}"], k, GREEDY.max_tokens, wrong)
            assert (r.num_draft_tokens, r.num_accepted_tokens) == want, (k, i)
            total = [total[0] + want[0], total[1] + want[1]]
        assert 0 < total[1] < total[0]
        assert (eng.spec_stats.num_draft_tokens, eng.spec_stats.num_accepted_tokens) == tuple(total)


# ---- scheduling under pressure


def test_simulated_acceptance_is_a_labelled_benchmark_switch(random_glm):
    """Benchmarks of dummy weights: with simulated_acceptance 1 every draft of a random
    drafter is accepted (it became the target's greedy token); with 0 nothing changes."""

    def run(alpha: float) -> tuple[LLMEngine, dict]:
        eng = LLMEngine(
            EngineConfig(
                model=str(random_glm),
                device="cpu",
                attention_backend="torch",
                cache=CacheConfig(block_size=4, num_kv_blocks=128),
                scheduler=SchedulerConfig(max_model_len=64),
                speculative_config=SpeculativeConfig("mtp", 2, simulated_acceptance=alpha),
            )
        )
        return eng, generate(eng, prompts())

    always, _ = run(1.0)
    assert always.spec_stats.num_draft_tokens > 0
    assert always.spec_stats.num_accepted_tokens == always.spec_stats.num_draft_tokens
    assert_all_blocks_free(always)
    never, tokens = run(0.0)
    assert tokens == generate(engine(random_glm), prompts())
    assert never.spec_stats.num_accepted_tokens < never.spec_stats.num_draft_tokens
    with pytest.raises(ValueError, match="simulated_acceptance=1.5: must be a number in"):
        EngineConfig.from_dict({"speculative_config": {"simulated_acceptance": 1.5}})


def test_preemption_and_aborts_keep_tokens_and_return_every_block(context_glm):
    """A cache too small for the batch preempts (drafts and lookahead slots included);
    an aborted request frees its blocks; the others' tokens are unchanged."""
    batch = prompts()
    expected = generate(engine(context_glm, num_kv_blocks=18), batch, abort="r2")
    for k in (1, 3):
        eng = engine(context_glm, k, num_kv_blocks=18)
        assert generate(eng, batch, abort="r2") == expected
        assert eng.num_preemptions > 0
        assert_all_blocks_free(eng)


def test_requests_that_reach_the_context_length(context_glm):
    """Near max_model_len the drafts are trimmed and chained drafts past the block table
    store nothing: tokens and finish reasons equal decoding without MTP."""
    batch = prompts()[:3]
    sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = generate(engine(context_glm), batch, sp)
    assert any(len(p) + len(expected[f"r{i}"]) == 64 for i, p in enumerate(batch))
    eng = engine(context_glm, 3)
    assert generate(eng, batch, sp) == expected
    assert_all_blocks_free(eng)


# ---- stops over the accepted run


@pytest.mark.parametrize(
    "params",
    [
        dict(max_tokens=7),
        dict(stop_token_ids=["pick"]),
        dict(stop_token_ids=["pick"], min_tokens=12),
        dict(stop=["pick"]),
        dict(logprobs=2),
    ],
    ids=["max_tokens", "stop_token_ids", "min_tokens", "stop_string", "logprobs"],
)
def test_stops_and_logprobs_inside_an_accepted_run(agreeing_glm, params):
    """With every draft accepted a step emits K + 1 tokens; a stop inside the run ends the
    request exactly where decoding without MTP ends it, with the same text and logprobs."""
    batch = prompts()[:3]
    free_run = generate(engine(agreeing_glm), batch)
    params = dict(params)
    picked = free_run["r1"][5]  # a token in the middle of a run
    if params.get("stop_token_ids") == ["pick"]:
        params["stop_token_ids"] = [picked]
    if params.get("stop") == ["pick"]:
        params["stop"] = [engine(agreeing_glm).tokenizer.decode([picked]).strip() or "x"]
    sp = SamplingParams(**{**dict(max_tokens=14, temperature=0.0, ignore_eos=True), **params})
    outputs = {}
    for k in (0, 3):
        eng = engine(agreeing_glm, k)
        for i, p in enumerate(batch):
            eng.add_request(f"r{i}", p, sp)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outputs[k, out.request_id] = out
        assert_all_blocks_free(eng)
    for i in range(len(batch)):
        a, b = outputs[0, f"r{i}"].outputs[0], outputs[3, f"r{i}"].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.stop_reason,
        )
        if a.logprobs is not None:
            assert len(b.logprobs) == len(b.token_ids)
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    if "stop_token_ids" in params and "min_tokens" not in params:
        assert outputs[3, "r1"].outputs[0].token_ids[-1] == picked
        assert len(outputs[3, "r1"].outputs[0].token_ids) == 6


def test_penalties_are_served_without_drafts(agreeing_glm):
    """Sampling that reads the output tokens (penalties) is not drafted for; its tokens
    are those of decoding without MTP."""
    sp = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    batch = prompts()[1:3]
    expected = generate(engine(agreeing_glm), batch, sp)
    eng = engine(agreeing_glm, 2)
    assert generate(eng, batch, sp) == expected
    assert eng.spec_stats.num_draft_tokens == 0


# ---- sampling


def test_sampled_token_frequencies_match_decoding_without_speculation(agreeing_glm):
    """Temperature 1 over the top 3 tokens, many draws of one prompt: the joint frequency
    of the 2nd and 3rd tokens (emitted by verify steps, drafts accepted and rejected) is
    within sampling noise of decoding without MTP."""
    n, prompt = 320, prompts()[1]
    sp = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    freqs = []
    for k in (0, 2):
        eng = engine(agreeing_glm, k, num_kv_blocks=512, max_num_seqs=128)
        out = generate(eng, [prompt] * n, sp)
        pairs = [tuple(t[1:]) for t in out.values()]
        freqs.append({p: pairs.count(p) / n for p in set(pairs)})
        if k:
            assert 0 < eng.spec_stats.num_accepted_tokens < eng.spec_stats.num_draft_tokens
    support = set(freqs[0]) | set(freqs[1])
    distance = sum(abs(freqs[0].get(p, 0) - freqs[1].get(p, 0)) for p in support) / 2
    assert distance < 0.15, (distance, freqs)


def test_a_seeded_request_gives_the_same_tokens_whatever_the_batch(context_glm):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    batch = prompts()
    alone = generate(engine(context_glm, 2), batch[1:2], sp)["r0"]
    others = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    eng = engine(context_glm, 2)
    for i, p in enumerate(batch):
        eng.add_request(f"o{i}", p, sp if i == 1 else others)
    tokens = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert tokens["o1"] == alone
    assert eng.spec_stats.num_draft_tokens > 0


def test_an_eager_first_pass_runs_the_mtp_head_on_the_draft_rows_only(agreeing_glm):
    """A prompt's step: the MTP layer over all its rows (its KV), the head on the one row
    drafted from (it ran over every row: thousands on a long prompt); the same tokens."""
    eng = engine(agreeing_glm, k=2)
    heads: list[int] = []
    model = eng.runner.model
    compute = model.mtp_compute_logits
    model.mtp_compute_logits = lambda hidden: (heads.append(len(hidden)), compute(hidden))[1]
    prompt = prompts()[2]  # 23 tokens, one step
    tokens = generate(eng, [prompt])
    assert heads[0] == 1  # the prompt's step: its last row only
    assert all(n <= 1 for n in heads)  # one request: one row a pass, chained or not
    assert tokens == generate(engine(agreeing_glm), [prompt])
