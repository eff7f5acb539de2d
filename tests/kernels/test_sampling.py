import pytest
import torch

from splitserve.kernels.sampling import top_k_top_p_mask
from splitserve.kernels.sampling import top_k_top_p_sample as top_k_top_p_sample_ref
from splitserve.kernels.triton.sampling import (
    sample_from_probs,
    top_k_top_p_sample,
    top_k_top_p_thresholds,
)
from tests.kernels.utils import DEVICE, ON_GPU, randn

TOP_K = [0, 1, 5, 40, 10**6, 7, 3, 2]  # 0 and >= vocab: off
TOP_P = [0.9, 1.0, 0.5, 0.3, 0.05, 1.0, 0.999, 0.7]  # 1.0: off
N_DRAWS = 65536 if ON_GPU else 8192
TOL = 0.01 if ON_GPU else 0.02  # > 3.5 standard deviations of a frequency over N_DRAWS


def probs_of(batch: int, vocab: int, temperature: float = 0.5) -> torch.Tensor:
    return torch.softmax(randn(batch, vocab) / temperature, dim=-1)


def params(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = torch.tensor([TOP_K[i % 8] for i in range(batch)], device=DEVICE)
    top_p = torch.tensor([TOP_P[i % 8] for i in range(batch)], device=DEVICE)
    return top_k, top_p


@pytest.mark.parametrize(
    ("batch", "vocab", "temperature"),
    [(8, 50, 0.5), (8, 1000, 0.5), pytest.param(256, 151936, 0.1, marks=pytest.mark.gpu),
     pytest.param(64, 32000, 0.1, marks=pytest.mark.gpu)],
)  # fmt: skip
def test_keep_threshold_matches_reference_mask(batch, vocab, temperature):
    """Exact agreement, on inputs where no token sits within rounding of the top-p
    boundary (large vocabularies get a low temperature: fp32 sums over 10^5 tokens in a
    different order may differ by more than a flat distribution's boundary gap)."""
    probs = probs_of(batch, vocab, temperature)
    top_k, top_p = params(batch)
    mask = probs >= top_k_top_p_thresholds(probs, top_k, top_p)[:, None]
    ref = top_k_top_p_mask(probs, top_k, top_p)
    assert torch.equal(mask, ref)
    kept = ref.sum(dim=-1)
    assert (kept < vocab).sum() >= batch * 6 // 8 and (kept == 1).any()  # the filters bite


def test_threshold_keeps_every_token_tied_at_the_kth_probability():
    probs = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1]], device=DEVICE)
    threshold = top_k_top_p_thresholds(probs, 2, 1.0)
    assert (probs[0] >= threshold).tolist() == [True, True, True, True, False]


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (6, 0.7), (0, 1.0), (1, 1.0)])
def test_draws_stay_in_the_kept_set_at_renormalized_frequencies(top_k, top_p):
    vocab = 12
    probs = probs_of(1, vocab, temperature=1.0)
    mask = top_k_top_p_mask(probs, torch.tensor([top_k]), torch.tensor([top_p]))[0]
    expected = probs[0] * mask / (probs[0] * mask).sum()
    thresholds = top_k_top_p_thresholds(probs, top_k, top_p)
    seeds = torch.tensor([1234], device=DEVICE)
    draws = sample_from_probs(probs, thresholds, seeds, num_samples=N_DRAWS)[0]
    freq = torch.bincount(draws, minlength=vocab).float() / N_DRAWS
    assert freq[~mask].sum() == 0  # never a token outside top-k / top-p
    torch.testing.assert_close(freq, expected, atol=TOL, rtol=0)
    gen = torch.Generator(DEVICE).manual_seed(0)
    many = probs.expand(N_DRAWS, -1)
    ref_draws = top_k_top_p_sample_ref(many, *params_like(top_k, top_p, N_DRAWS), generator=gen)
    ref_freq = torch.bincount(ref_draws, minlength=vocab).float() / N_DRAWS
    torch.testing.assert_close(ref_freq, expected, atol=TOL, rtol=0)


def params_like(top_k, top_p, n):
    return torch.full((n,), top_k, device=DEVICE), torch.full((n,), top_p, device=DEVICE)


def test_batch_draws_follow_each_rows_own_filters():
    batch, vocab = 16, 500
    probs = probs_of(batch, vocab)
    top_k, top_p = params(batch)
    mask = top_k_top_p_mask(probs, top_k, top_p)
    for seed in range(3):
        seeds = torch.arange(batch, device=DEVICE) + 100 * seed
        ids = top_k_top_p_sample(probs, top_k, top_p, seeds=seeds)
        assert ids.shape == (batch,) and ids.dtype == torch.int64
        assert mask.gather(1, ids[:, None]).all()
        single = (mask.sum(dim=-1) == 1).nonzero()[:, 0]
        assert torch.equal(ids[single], probs[single].argmax(dim=-1))


def test_draws_depend_only_on_the_seed():
    probs = probs_of(4, 300, temperature=4.0)  # flat: many tokens are likely
    seeds = torch.tensor([5, 6, 7, 8], device=DEVICE)
    first = top_k_top_p_sample(probs, 0, 1.0, seeds=seeds)
    assert torch.equal(top_k_top_p_sample(probs, 0, 1.0, seeds=seeds), first)
    # row 0 alone with its seed draws the same token as inside the batch
    assert torch.equal(top_k_top_p_sample(probs[:1], 0, 1.0, seeds=seeds[:1]), first[:1])
    draws = sample_from_probs(probs, torch.zeros(4, device=DEVICE), seeds, num_samples=64)
    assert all(len(row.unique()) > 10 for row in draws)  # draws of a row are independent


def test_generator_seeds_reproduce():
    probs = probs_of(3, 100, temperature=4.0)
    a = top_k_top_p_sample(probs, 0, 1.0, generator=torch.Generator(DEVICE).manual_seed(1))
    b = top_k_top_p_sample(probs, 0, 1.0, generator=torch.Generator(DEVICE).manual_seed(1))
    assert torch.equal(a, b)
