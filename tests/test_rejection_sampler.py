"""Verification of drafts: greedy acceptance, and rejection sampling whose emitted tokens
follow the target's distribution exactly (statistical bounds over many draws)."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.request import Request
from splitserve.workers.sampling.sampler import Sampler
from splitserve.workers.spec_decode.rejection_sampler import RejectionSampler, draft_tensor

VOCAB = 6


class Verifier:
    """A rejection sampler, given host drafts."""

    def __init__(self, seed: int = 0):
        self.sampler = RejectionSampler(Sampler(tokenizer=None, seed=seed))

    def verify(self, logits: torch.Tensor, drafts: list[list[int]], requests: list[Request]):
        return self.sampler.verify(logits, *draft_tensor(drafts), requests)


def verifier(seed: int = 0) -> Verifier:
    return Verifier(seed)


def request(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params), eos_token_ids=frozenset({0}))


def rows(*logits: list[float]) -> torch.Tensor:
    return torch.tensor(logits, dtype=torch.float32)


def test_greedy_accepts_the_run_that_matches_the_argmax():
    logits = rows(
        [0, 5, 1, 0, 0, 0],  # argmax 1
        [0, 0, 0, 7, 0, 0],  # argmax 3
        [0, 0, 9, 0, 0, 0],  # argmax 2: the bonus row
        [4, 0, 0, 0, 0, 1],  # a second request: argmax 0
        [0, 0, 0, 0, 8, 0],
    )
    runs = verifier().verify(
        logits, [[1, 3], [5]], [request("a", temperature=0), request("b", temperature=0)]
    )
    assert runs[0].token_ids == [1, 3, 2]  # both drafts, then the bonus token
    assert runs[1].token_ids == [0]  # draft 5 rejected, the target's own token instead
    assert [r.num_accepted for r in runs] == [2, 0]


def test_min_tokens_bans_eos_on_the_rows_before_it():
    """Row j emits output token num_output + j + 1; EOS (0) is banned while that is
    within min_tokens, so a draft of EOS there is rejected."""
    r = request("a", temperature=0, min_tokens=2)
    logits = rows([9, 5, 0, 0, 0, 0], [9, 0, 6, 0, 0, 0], [9, 0, 0, 0, 0, 0])
    (run,) = verifier().verify(logits, [[1, 0]], [r])
    assert run.token_ids == [1, 2]  # row 1 is output token 2: EOS banned, 2 instead


def _frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / len(tokens)


def _assert_close(freq: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    """Every token's frequency within 5 standard deviations (and 0.01) of its probability."""
    for f, p in zip(freq.tolist(), probs.tolist()):
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 0.01, (freq, probs)


@pytest.mark.parametrize(
    "drafts", [[2, 4], [0, 1], [5, 5]], ids=["likely", "unlikely", "filtered-out"]
)
def test_emitted_tokens_follow_the_target_distribution(drafts):
    """Many copies of one request: the first emitted token is distributed as the
    target's p0 (temperature 0.8, top-k 4), and the second, given the first draft was
    accepted, as p1; whatever the drafts are."""
    n = 6000
    logits_0 = [0.2, 0.5, 2.0, 1.0, -1.0, 3.0]
    logits_1 = [1.5, 0.0, 0.5, 0.3, 2.0, -2.0]
    bonus = [0.0, 1.0, 0.0, 1.0, 0.0, 0.5]
    params = dict(temperature=0.8, top_k=4)
    logits = rows(logits_0, logits_1, bonus).repeat(n, 1)
    runs = verifier().verify(logits, [drafts] * n, [request(f"r{i}", **params) for i in range(n)])

    def target(values):
        x = torch.tensor(values) / 0.8
        x[x.argsort()[: VOCAB - 4]] = -math.inf  # top-k 4
        return x.softmax(dim=-1)

    _assert_close(_frequencies([r.token_ids[0] for r in runs]), target(logits_0), n)
    after = [r.token_ids[1] for r in runs if r.num_accepted >= 1]
    p0 = target(logits_0)[drafts[0]].item()
    assert abs(len(after) / n - p0) <= 5 * math.sqrt(p0 * (1 - p0) / n) + 0.01
    if len(after) > 1000:
        _assert_close(_frequencies(after), target(logits_1), len(after))
    if p0 == 0.0:
        assert not after  # a draft the filters removed is never accepted


def test_a_seeded_request_draws_the_same_whatever_the_batch():
    logits_0 = [0.2, 0.5, 2.0, 1.0, -1.0, 3.0]
    one = rows(logits_0, logits_0, logits_0)
    seeded = [request("s", temperature=1.0, seed=11) for _ in range(2)]
    alone = verifier().verify(one, [[2, 5]], [seeded[0]])[0].token_ids
    others = [request(f"o{i}", temperature=1.0) for i in range(3)]
    batch = torch.cat([one, one[:2], one, one[:1]])
    runs = verifier(seed=99).verify(
        batch, [[1, 2], [3], [2, 5], []], [others[0], others[1], seeded[1], others[2]]
    )
    assert runs[2].token_ids == alone
    different = [
        verifier().verify(one, [[2, 5]], [request("s", temperature=1.0, seed=s)]) for s in range(8)
    ]
    assert len({tuple(r[0].token_ids) for r in different}) > 1  # the seed decides


def test_logprobs_are_those_of_the_raw_target_rows():
    logits = rows([0, 5, 1, 0, 0, 0], [0, 0, 0, 7, 0, 0], [0, 0, 9, 0, 0, 0])
    (run,) = verifier().verify(logits, [[1, 4]], [request("a", temperature=0, logprobs=2)])
    assert run.token_ids == [1, 3]
    expected = torch.log_softmax(logits, dim=-1)
    for j, (token, lp) in enumerate(zip(run.token_ids, run.logprobs)):
        assert lp.token_id == token
        assert abs(lp.logprob - expected[j, token].item()) < 1e-6
        assert [t for t, _ in lp.top] == expected[j].topk(2).indices.tolist()
