import pytest
import torch

from splitserve.kernels import moe_align as ref
from splitserve.kernels.triton import moe_align as tri
from tests.kernels.utils import DEVICE


def random_topk_ids(num_tokens, num_experts, top_k, skew=False):
    """Distinct experts per token; ``skew`` sends most tokens to a few experts (long runs,
    many experts with none) as a real router often does."""
    scores = torch.rand(num_tokens, num_experts, device=DEVICE)
    if skew:
        scores[:, : max(1, num_experts // 8)] += 1.0
    return scores.topk(top_k, dim=1).indices


@pytest.mark.parametrize("block_m", [4, 16, 64])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "skew"),
    [(1, 128, 8, False), (1, 6, 1, False), (13, 6, 3, False), (40, 16, 4, True),
     (3, 60, 4, False), (128, 128, 8, True), (100, 8, 2, False)],
)  # fmt: skip
def test_triton_align_equals_reference(num_tokens, num_experts, top_k, skew, block_m):
    topk_ids = random_topk_ids(num_tokens, num_experts, top_k, skew)
    assert num_tokens * top_k <= tri.MAX_ENTRIES
    for dtype in (torch.int64, torch.int32):
        got = tri.moe_align_block_size(topk_ids.to(dtype), num_experts, block_m)
        want = ref.moe_align_block_size(topk_ids, num_experts, block_m)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == torch.int32 and torch.equal(g, w)


def test_triton_align_hands_large_batches_and_odd_blocks_to_the_reference():
    topk_ids = random_topk_ids(tri.MAX_ENTRIES // 2 + 1, 8, 2)
    for block_m in (16, 12):  # too many entries; a block_m that is not a power of two
        got = tri.moe_align_block_size(topk_ids, 8, block_m)
        want = ref.moe_align_block_size(topk_ids, 8, block_m)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("block_m", [4, 16])
def test_skipped_choices_are_left_out_of_the_layout(block_m):
    """-1 (a choice another expert-parallel rank computes) gets no row; the layout of the
    rest is what it would be without them, and the Triton layout equals the reference."""
    topk_ids = random_topk_ids(40, 16, 4)
    skipped = topk_ids.clone()
    skipped[::3, 1:] = -1
    skipped[5] = -1  # a token with nothing here
    sorted_ids, expert_ids, num_post = ref.moe_align_block_size(skipped, 16, block_m)
    flat, num_entries = skipped.flatten(), skipped.numel()
    real = sorted_ids[sorted_ids < num_entries].long()
    assert sorted(real.tolist()) == (flat >= 0).nonzero().flatten().tolist()
    counts = torch.bincount(flat[flat >= 0], minlength=16)
    assert int(num_post) == int(((counts + block_m - 1) // block_m * block_m).sum())
    for block in range(int(num_post) // block_m):
        rows = sorted_ids[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_entries].long()
        assert (flat[rows] == expert_ids[block]).all()
    got = tri.moe_align_block_size(skipped.to(torch.int32), 16, block_m)
    for g, w in zip(got, (sorted_ids, expert_ids, num_post), strict=True):
        assert torch.equal(g, w)
