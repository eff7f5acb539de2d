import pytest
import torch

from splitserve.kernels import tuning
from splitserve.kernels.fused_moe import fused_moe as fused_moe_ref
from splitserve.kernels.moe_align import moe_align_block_size
from splitserve.kernels.moe_routing import softmax_topk
from splitserve.kernels.triton.fused_moe import _tiles, fused_moe
from tests.kernels.utils import DEVICE, DTYPES, assert_close, randn

# (num_tokens, hidden, intermediate, num_experts, top_k); 72 and 40 are not block multiples
SHAPES = [(5, 64, 48, 4, 2), (9, 72, 40, 8, 3), (3, 32, 16, 8, 2)]
GPU_SHAPES = [(512, 2048, 768, 64, 8), (3, 4096, 1408, 60, 4), (2048, 1024, 512, 128, 8)]
CPU_BLOCKS = (16, 32, 32)  # keep the interpreter's tiles small


def route(num_tokens, num_experts, top_k):
    logits = randn(num_tokens, num_experts)
    return softmax_topk(logits, top_k, renormalize=True)


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (13, 6, 3), (40, 16, 4)]
)
def test_moe_align_block_size_invariants(num_tokens, num_experts, top_k, block_m):
    _, topk_ids = route(num_tokens, num_experts, top_k)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, block_m)
    flat, num_entries = topk_ids.flatten(), topk_ids.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    used = int(num_post.item())
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() >= used and sorted_ids.numel() % block_m == 0
    real = sorted_ids[sorted_ids < num_entries]
    assert sorted(real.tolist()) == list(range(num_entries))  # each entry exactly once
    assert (sorted_ids[used:] == num_entries).all() and (expert_ids[used // block_m :] == -1).all()
    for block in range(used // block_m):
        rows = sorted_ids[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_entries].long()
        assert len(rows) > 0 and (flat[rows] == expert_ids[block]).all()
        assert (rows.diff() > 0).all()  # stable: token order kept within an expert


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", SHAPES + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SHAPES]
)
def test_fused_moe_matches_reference(shape, dtype):
    num_tokens, hidden, intermediate, num_experts, top_k = shape
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = (randn(num_experts, 2 * intermediate, hidden) / hidden**0.5).to(dtype)
    w2 = (randn(num_experts, hidden, intermediate) / intermediate**0.5).to(dtype)
    topk_weights, topk_ids = route(num_tokens, num_experts, top_k)
    blocks = CPU_BLOCKS if DEVICE == "cpu" else None
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, block_sizes=blocks)
    assert out.dtype == dtype
    assert_close(out, fused_moe_ref(x, w13, w2, topk_weights, topk_ids), dtype)


def test_fused_moe_uses_each_tokens_own_experts():
    """Swapping two tokens' routing must swap their outputs (catches a row mix-up that a
    symmetric input could hide)."""
    x = randn(4, 64)
    w13, w2 = randn(8, 96, 64) / 8, randn(8, 64, 48) / 7
    topk_weights, topk_ids = route(4, 8, 2)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, block_sizes=CPU_BLOCKS)
    perm = torch.tensor([1, 0, 2, 3], device=DEVICE)
    swapped = fused_moe(
        x[perm], w13, w2, topk_weights[perm], topk_ids[perm], block_sizes=CPU_BLOCKS
    )
    assert_close(swapped, out[perm], torch.float32)
    assert not torch.allclose(out[0], out[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_skipped_choices_add_nothing(dtype):
    """An expert id of -1 (computed on another expert-parallel rank) adds nothing: the
    output equals the reference with that choice's weight zero, a token with every
    choice skipped comes out zero."""
    num_tokens, hidden, intermediate, num_experts, top_k = 9, 72, 40, 8, 3
    x = randn(num_tokens, hidden, dtype=dtype)
    w13 = (randn(num_experts, 2 * intermediate, hidden) / hidden**0.5).to(dtype)
    w2 = (randn(num_experts, hidden, intermediate) / intermediate**0.5).to(dtype)
    topk_weights, topk_ids = route(num_tokens, num_experts, top_k)
    skip = torch.zeros_like(topk_ids, dtype=torch.bool)
    skip[::2, 0] = True
    skip[4] = True
    ids, weights = topk_ids.masked_fill(skip, -1), topk_weights.masked_fill(skip, 0.0)
    want = fused_moe_ref(x, w13, w2, weights, topk_ids)
    assert_close(fused_moe_ref(x, w13, w2, weights, ids), want, dtype)
    blocks = CPU_BLOCKS if DEVICE == "cpu" else None
    out = fused_moe(x, w13, w2, weights, ids, block_sizes=blocks, skip_negative_ids=True)
    assert_close(out, want, dtype)
    assert (out[4] == 0).all()
    # An expert-parallel rank's part: the float32 sum, not rounded to the hidden dtype.
    part = fused_moe(
        x, w13, w2, weights, ids, block_sizes=blocks, skip_negative_ids=True,
        out_dtype=torch.float32,
    )  # fmt: skip
    assert part.dtype == torch.float32 and torch.equal(part.to(dtype), out)
    ref_part = fused_moe_ref(x, w13, w2, weights, ids, out_dtype=torch.float32)
    assert ref_part.dtype == torch.float32
    assert_close(ref_part, want.float(), dtype)


def test_decode_tiles_come_from_the_tuning_table():
    """Experts of at most 16 rows each take the device's ``moe_decode_tiles``; more rows,
    larger blocks of one tiling for both GEMMs."""
    cpu = torch.device("cpu")
    assert _tiles(128 * 8, 64, cpu) == tuning.for_device(cpu).moe_decode_tiles
    assert _tiles(32 * 64, 64, cpu) == tuning.MoETiles.of(32, 64, 64)
    assert _tiles(64 * 64, 64, cpu) == tuning.MoETiles.of(64, 128, 64)


def test_given_tiles_compute_the_same_layer():
    """Other tiles for each GEMM (the benchmark's sweep): the same output as the reference."""
    x = randn(9, 72)
    w13, w2 = randn(8, 80, 72) / 8, randn(8, 72, 40) / 6
    topk_weights, topk_ids = route(9, 8, 3)
    tiles = tuning.MoETiles(16, tuning.Tiles(32, 32, 2, 4), tuning.Tiles(16, 64, 2, 4))
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, tiles=tiles)
    assert_close(out, fused_moe_ref(x, w13, w2, topk_weights, topk_ids), torch.float32)
