import math

import pytest
import torch

from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.request import Request
from splitserve.workers.model.tokenizer import tiny_tokenizer
from splitserve.workers.sampling.logits_processors import apply_penalties
from splitserve.workers.sampling.sampler import Sampler, filter_logits

N_DRAWS = 20_000
TOL = 0.015  # ~4 standard deviations of a frequency over 20k draws


def req(rid="r", prompt=(1,), output=(), eos=(), **params) -> Request:
    r = Request(str(rid), list(prompt), SamplingParams(**params), eos_token_ids=frozenset(eos))
    r.output_token_ids = list(output)
    return r


def frequencies(logits: list[float], seed: int = 0, **params) -> torch.Tensor:
    """Sample N_DRAWS times from one distribution (rows of one batch), return frequencies."""
    row = torch.tensor(logits)
    requests = [req(i, **params) for i in range(N_DRAWS)]
    out = Sampler(tiny_tokenizer(), seed=seed)(row.expand(N_DRAWS, -1), requests)
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logits)).float() / N_DRAWS


def log_probs(*p: float) -> list[float]:
    return [math.log(x) for x in p]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_frequencies(temperature):
    logits = [1.0, 0.5, 0.0, -0.5, -1.0]
    freq = frequencies(logits, temperature=temperature)
    expected = torch.softmax(torch.tensor(logits) / temperature, dim=0)
    torch.testing.assert_close(freq, expected, atol=TOL, rtol=0)


def test_top_k_samples_only_the_k_best_at_renormalized_frequencies():
    logits = torch.randn(10, generator=torch.Generator().manual_seed(3))
    freq = frequencies(logits.tolist(), top_k=3)
    top = logits.topk(3).indices
    outside = torch.ones(10, dtype=torch.bool)
    outside[top] = False
    assert freq[outside].sum() == 0
    torch.testing.assert_close(freq[top], torch.softmax(logits[top], dim=0), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.3, 1), (0.4, 1), (0.69, 2), (0.71, 3), (0.89, 3), (0.91, 4), (1.0, 4)]
)
def test_top_p_keeps_the_smallest_head_reaching_top_p(top_p, kept):
    logits = torch.tensor([log_probs(0.4, 0.3, 0.2, 0.1)])
    out = filter_logits(logits, torch.tensor([0]), torch.tensor([top_p]), torch.tensor([0.0]))
    assert out[0].isfinite().tolist() == [True] * kept + [False] * (4 - kept)


def test_top_p_frequencies():
    freq = frequencies(log_probs(0.4, 0.3, 0.2, 0.1), top_p=0.69)
    torch.testing.assert_close(freq, torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=TOL, rtol=0)


@pytest.mark.parametrize(("min_p", "expected"), [(0.2, [5, 3, 1.5, 0]), (0.5, [5, 3, 0, 0])])
def test_min_p_drops_tokens_below_min_p_times_max(min_p, expected):
    freq = frequencies(log_probs(0.5, 0.3, 0.15, 0.05), min_p=min_p)
    expected = torch.tensor(expected) / sum(expected)
    torch.testing.assert_close(freq, expected, atol=TOL, rtol=0)


def test_greedy_is_argmax_in_any_dtype():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0)).bfloat16()
    requests = [req(i, temperature=0.0, seed=i) for i in range(6)]
    out = Sampler(tiny_tokenizer())(logits, requests)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_plain_greedy_rows_pick_what_the_full_path_picks():
    # Small integers: many ties, which both paths break towards the first index.
    logits = torch.randint(-3, 4, (8, 50), generator=torch.Generator().manual_seed(1)).bfloat16()
    first_best = [row.index(max(row)) for row in logits.float().tolist()]
    plain = [req(i, temperature=0.0) for i in range(8)]
    assert Sampler(tiny_tokenizer())(logits, plain).token_ids == first_best
    with_logprobs = plain[:7] + [req(7, temperature=0.0, logprobs=1)]  # the float32 path
    assert Sampler(tiny_tokenizer())(logits, with_logprobs).token_ids == first_best


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plain_greedy_on_cuda_stores_its_tokens_in_a_page_locked_slot():
    logits = torch.randint(-3, 4, (8, 50), generator=torch.Generator().manual_seed(1)).bfloat16()
    first_best = [row.index(max(row)) for row in logits.float().tolist()]
    sampler = Sampler(tiny_tokenizer())
    plain = [req(i, temperature=0.0) for i in range(8)]
    sampled = sampler.sample(logits.cuda(), plain)
    assert sampled._host_tokens is not None  # no copy to the host queued for the tokens
    assert sampled.result().token_ids == first_best
    assert sampled.token_ids.tolist() == first_best  # on the device for the next step
    late = sampler.sample(logits.cuda(), plain)
    for _ in range(4):  # the ring comes round to ``late``'s slot
        sampler.sample(logits.cuda(), plain).result()
    with pytest.raises(RuntimeError, match="overwritten"):
        late.result()


def test_penalties_follow_the_formulas():
    # token 0 in the prompt, token 1 once and token 3 twice in the output.
    r = req(
        prompt=[0],
        output=[1, 3, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    apply_penalties(logits, [r])
    expected = [
        2.0 / 2,  # prompt only: repetition divides a positive logit
        -1.0 * 2 - 0.5 * 1 - 0.25,  # negative: multiplied, then frequency * 1 + presence
        0.5,  # unseen
        3.0 / 2 - 0.5 * 2 - 0.25,
        -2.0,  # unseen
    ]
    torch.testing.assert_close(logits, torch.tensor([expected]))
    # The sampler applies them: greedy picks token 0 (1.0) instead of the raw argmax 3.
    r.sampling_params.temperature = 0.0
    raw = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    assert Sampler(tiny_tokenizer())(raw, [r]).token_ids == [0]


def test_penalties_leave_other_rows_alone():
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_penalties(logits, [req(0, output=[1, 2], frequency_penalty=1.0), req(1, output=[1, 2])])
    assert torch.equal(logits[1], before[1])
    assert not torch.equal(logits[0], before[0])


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])  # eos 5 best, stop id 4 next
    sampler = Sampler(tiny_tokenizer())
    for n_out, expected in [(0, 3), (1, 3), (2, 5)]:
        r = req(output=[0] * n_out, eos=[5], min_tokens=2, stop_token_ids=[4], temperature=0.0)
        assert sampler(logits, [r]).token_ids == [expected]
    sampled = [req(i, eos=[5], min_tokens=1, stop_token_ids=[4]) for i in range(200)]
    assert set(sampler(logits.expand(200, -1), sampled).token_ids) <= {0, 1, 2, 3}


def test_bad_words_banned_only_after_their_prefix():
    tok = tiny_tokenizer()
    assert tok.encode("quick brown") == [359, 350, 427]  # 'qu' 'ick' 'Ġbrown'
    assert tok.encode(" quick brown") == [457, 427]
    assert tok.encode(" fox") == [436] and tok.encode("fox") == [72, 81, 90]
    logits = torch.zeros(1, len(tok))
    logits[0, [427, 436, 90]] = torch.tensor([10.0, 9.0, 8.0])
    logits[0, 7] = 1.0
    sampler = Sampler(tok)

    def greedy(output, rid="r"):
        r = req(rid, output=output, bad_words=["quick brown", "fox"], temperature=0.0)
        return sampler(logits, [r]).token_ids[0]

    assert greedy([]) == 427  # no prefix yet; ' fox' (436) is one token, but 427 wins
    assert greedy([5, 457]) == 90  # after ' quick': ' brown' banned, ' fox' always banned
    assert greedy([359, 350]) == 90  # after 'qu' 'ick'
    assert greedy([350]) == 427  # 'ick' alone is not the prefix
    assert greedy([72, 81, 457]) == 90  # ' brown', ' fox' banned; 'x' needs 'f' 'o' right before
    assert greedy([457, 72, 81]) == 427
    logits[0, 427] = 0.0
    assert greedy([72, 81]) == 7  # 'x' after 'f' 'o' banned, ' fox' too
    sampler.release("r")
    assert sampler.bad_words._token_ids == {}


def test_row_with_every_token_banned_falls_back_to_raw_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0]]).expand(2, -1)
    requests = [req(0, eos=[0, 1, 2], min_tokens=1), req(1, eos=[0, 1, 2], min_tokens=1)]
    requests[0].sampling_params.temperature = 0.0
    assert Sampler(tiny_tokenizer())(logits, requests).token_ids == [1, 1]


def run_steps(target_logits, batches, sampler_seed):
    """Decode 20 steps; batches(step) gives the other requests and the target's position."""
    sampler = Sampler(tiny_tokenizer(), seed=sampler_seed)
    target = req("target", seed=1234, temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1)
    for step, row in enumerate(target_logits):
        others, pos = batches(step)
        pos = min(pos, len(others))
        requests = others[:pos] + [target] + others[pos:]
        logits = torch.randn(len(requests), row.numel())
        logits[pos] = row
        out = sampler(logits, requests)
        for r, t in zip(requests, out.token_ids):
            r.output_token_ids.append(t)
    return target.output_token_ids


def test_seeded_request_is_independent_of_the_batch():
    torch.manual_seed(0)
    target_logits = torch.randn(20, 64)
    others = [
        req("a"),
        req("b", seed=7, temperature=1.3),
        req("c", temperature=0.0),
        req("d", top_k=5),
        req("e", seed=1234),  # same seed, different request: its own generator
    ]
    alone = run_steps(target_logits, lambda step: ([], 0), sampler_seed=0)
    mixes = [
        lambda step: (others[:2], 2),
        lambda step: (others, 0),
        lambda step: (others[step % 5 :], step % 3),  # batch changes every step
    ]
    for i, mix in enumerate(mixes):
        assert run_steps(target_logits, mix, sampler_seed=i + 1) == alone
    assert len(set(alone)) > 5  # really sampled, not a constant


def test_release_restarts_the_seeded_stream():
    sampler = Sampler(tiny_tokenizer())
    logits = torch.zeros(1, 1000)
    first = [sampler(logits, [req("x", seed=5)]).token_ids[0] for _ in range(5)]
    sampler.release("x")
    again = [sampler(logits, [req("x", seed=5)]).token_ids[0] for _ in range(5)]
    assert first == again and len(set(first)) > 1


def test_logprobs_describe_the_raw_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    requests = [
        req(0, output=[3, 4], logprobs=5, temperature=0.7, repetition_penalty=1.5),
        req(1, logprobs=None),
        req(2, logprobs=0, temperature=0.0, presence_penalty=2.0, output=[int(logits[2].argmax())]),
    ]
    out = Sampler(tiny_tokenizer())(logits, requests)
    raw = torch.log_softmax(logits, dim=-1)
    for i in (0, 2):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-5)
    top = out.logprobs[0].top
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert top[0][1] == pytest.approx(raw[0].max().item(), abs=1e-5)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == []
    assert out.token_ids[2] != logits[2].argmax()  # the penalty moved the choice, not the logprob


def test_model_dtype_logits_sample_and_score_as_their_float32_values():
    """Logits arrive in the model's dtype: penalties, sampling and logprobs work on their
    float32 values, and the logprobs come out in float32 (log_softmax in bfloat16 would
    round them to about 3 digits)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)).bfloat16()

    def requests():
        return [
            req(0, output=[3, 4], logprobs=3, temperature=0.7, seed=5, repetition_penalty=1.5),
            req(1, temperature=0.0, frequency_penalty=1.0, output=[7]),
            req(2, logprobs=2, temperature=0.0),
        ]

    got = Sampler(tiny_tokenizer())(logits, requests())
    want = Sampler(tiny_tokenizer())(logits.float(), requests())
    assert got.token_ids == want.token_ids
    for i in (0, 2):
        assert got.logprobs[i] == want.logprobs[i]
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert got.logprobs[2].logprob == raw[2].max().item()
