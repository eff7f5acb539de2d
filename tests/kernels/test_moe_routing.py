import pytest
import torch

from splitserve.kernels import moe_routing as ref
from splitserve.kernels.triton import moe_routing as tri
from tests.kernels.utils import DEVICE, ON_GPU, assert_close, randn

# (num_tokens, num_experts, top_k)
SOFTMAX_SHAPES = [(9, 8, 2), (5, 60, 4), (7, 128, 8)]
SOFTMAX_GPU = [(4096, 128, 8), (1000, 160, 8)]
# (num_tokens, num_experts, top_k, n_group, topk_group)
GROUPED_SHAPES = [(6, 16, 4, 4, 2), (5, 64, 6, 8, 3), (4, 160, 8, 1, 1), (7, 48, 4, 3, 2)]
GROUPED_GPU = [(4096, 256, 8, 8, 4), (1000, 160, 8, 1, 1)]


# The GPU's exp differs from torch's in the last bit, which can swap two experts whose
# scores are that close; thousands of GPU tokens make such a near-tie plausible.
MAX_SWAPPED_TOKENS = 1e-3 if ON_GPU else 0.0


def assert_same_routing(weights, ids, weights_ref, ids_ref):
    same = (ids == ids_ref).all(dim=-1)
    assert (~same).float().mean().item() <= MAX_SWAPPED_TOKENS, f"{(~same).sum()} tokens differ"
    assert_close(weights[same], weights_ref[same], torch.float32)


def gpu(shapes):
    return [pytest.param(s, marks=pytest.mark.gpu) for s in shapes]


def by_expert(weights, ids):
    """Reorder each row by expert id: the reference's grouped top-k is unsorted."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES + gpu(SOFTMAX_GPU))
def test_softmax_topk_matches_reference(shape, renormalize):
    num_tokens, num_experts, top_k = shape
    logits = 2 * randn(num_tokens, num_experts)
    weights, ids = tri.softmax_topk(logits, top_k, renormalize)
    weights_ref, ids_ref = ref.softmax_topk(logits, top_k, renormalize)
    assert ids.dtype == ids_ref.dtype == torch.int64 and weights.dtype == torch.float32
    assert_same_routing(weights, ids, weights_ref, ids_ref)  # both in descending order
    if renormalize:
        assert_close(weights.sum(-1), torch.ones(num_tokens, device=DEVICE), torch.float32)


def test_softmax_topk_with_ties_picks_a_valid_top_k():
    """bf16 logits tie often; the experts may then differ from torch.topk's, but the
    weights are the same top-k values and belong to the chosen experts."""
    logits = randn(16, 60, dtype=torch.bfloat16)
    weights, ids = tri.softmax_topk(logits, 4, False)
    weights_ref, ids_ref = ref.softmax_topk(logits, 4, False)
    assert (weights[:, :-1] == weights[:, 1:]).any()  # the input does tie
    assert_close(weights, weights_ref, torch.float32)
    probs = torch.softmax(logits.float(), dim=-1)
    assert_close(probs.gather(1, ids), weights, torch.float32)
    assert all(len(row.unique()) == 4 for row in ids)


def test_ties_at_the_top_k_boundary_go_to_the_lowest_expert():
    logits = randn(3, 12)
    logits[:, :5] = torch.tensor([1.0, 9.0, 5.0, 8.0, 5.0], device=DEVICE)
    logits[:, 5:] = -9.0
    assert tri.softmax_topk(logits, 3, True)[1].tolist() == [[1, 3, 2]] * 3
    assert tri.noaux_tc_topk(logits, None, 3, 1, 1, True, 1.0)[1].tolist() == [[1, 3, 2]] * 3


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", GROUPED_SHAPES + gpu(GROUPED_GPU))
def test_noaux_tc_topk_matches_reference(shape, with_bias, renormalize):
    num_tokens, num_experts, top_k, n_group, topk_group = shape
    logits = 2 * randn(num_tokens, num_experts)
    bias = 0.5 * randn(num_experts) if with_bias else None
    args = (top_k, n_group, topk_group, renormalize, 2.5)
    weights, ids = tri.noaux_tc_topk(logits, bias, *args)
    weights_ref, ids_ref = ref.noaux_tc_topk(logits, bias, *args)
    weights, ids = by_expert(weights, ids)
    weights_ref, ids_ref = by_expert(weights_ref, ids_ref)
    assert_same_routing(weights, ids, weights_ref, ids_ref)
    assert all(len(row.unique()) <= topk_group for row in ids // (num_experts // n_group))


def test_bias_and_groups_change_the_choice():
    """Guards the comparison above: on its inputs both the bias and the group limit
    change which experts win, so a kernel ignoring either would fail it."""
    logits = 2 * randn(24, 64)
    bias = 0.5 * randn(64)
    plain = ref.noaux_tc_topk(logits, None, 6, 1, 1, True, 1.0)[1].sort(-1)[0]
    grouped = ref.noaux_tc_topk(logits, None, 6, 8, 3, True, 1.0)[1].sort(-1)[0]
    biased = ref.noaux_tc_topk(logits, bias, 6, 1, 1, True, 1.0)[1].sort(-1)[0]
    assert not torch.equal(plain, grouped) and not torch.equal(plain, biased)
    tri_grouped = tri.noaux_tc_topk(logits, None, 6, 8, 3, True, 1.0)[1].sort(-1)[0]
    tri_biased = tri.noaux_tc_topk(logits, bias, 6, 1, 1, True, 1.0)[1].sort(-1)[0]
    assert torch.equal(tri_grouped, grouped) and torch.equal(tri_biased, biased)


def test_bias_only_chooses_weights_are_unbiased_scores():
    logits = randn(5, 16)
    bias = randn(16)
    weights, ids = tri.noaux_tc_topk(logits, bias, 3, 1, 1, False, 1.0)
    assert_close(weights, logits.sigmoid().gather(1, ids), torch.float32)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "n_group", "topk_group", "match"),
    [(10, 2, 3, 1, "groups"), (8, 2, 8, 1, "groups"), (16, 2, 4, 5, "topk_group"),
     (16, 9, 4, 2, "top_k")],
)  # fmt: skip
def test_invalid_grouping_is_refused(num_experts, top_k, n_group, topk_group, match):
    with pytest.raises(ValueError, match=match):
        tri.noaux_tc_topk(randn(2, num_experts), None, top_k, n_group, topk_group, True, 1.0)
