"""The tensor-core FP8 decode kernel (CUDA C through cupy, GPU only) against the reference:
query groups of 1 to 16 heads, blocks of 16 to 64 tokens, int32 and int64 indexes, one
to 32 splits (empty ones too), requests of no tokens, and the bytes past a request's
last token set to NaN (the kernel must never read them). On the CPU: where it refuses to
run, and its split count."""

import pytest
import torch

from splitserve.kernels.decode_attention import decode_attention as reference
from splitserve.kernels.fp8_decode_cuda import FP8DecodeKernel
from splitserve.kernels.kv_store import FP8_DTYPE
from splitserve.kernels.tuning import FP8DecodeTiles
from tests.kernels.test_fp8_kv_decode import fp8_inputs
from tests.kernels.utils import ON_GPU, assert_close

NAN_E4M3 = 0x7F

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, splits)
CASES = [
    ([8192] * 64, 32, 8, 128, 16, None),  # Qwen3-8B at batch 64, 8k context
    ([1, 4000, 333, 2048, 0], 32, 8, 128, 16, None),
    ([17, 700, 1], 32, 8, 128, 16, 32),  # more splits than tiles: empty splits
    ([300, 45], 32, 8, 128, 16, 3),
    ([1500, 31], 64, 8, 128, 16, 2),  # 8 heads a group
    ([1500, 31], 96, 8, 128, 16, 1),  # 12: two head tiles, the second part-filled
    ([1500, 31], 32, 2, 128, 16, 4),  # 16, two KV heads: blocks of two warps
    ([1500, 31], 8, 8, 128, 16, 1),  # 1
    ([999, 64, 65], 32, 8, 128, 32, 2),  # blocks of 32 and 64 tokens
    ([999, 64, 65], 32, 8, 128, 64, 1),
]
TILINGS = [FP8DecodeTiles(8, 3, 2.0), FP8DecodeTiles(4, 2, 4.0), FP8DecodeTiles(8, 4, 1.0)]


def poison_past_the_end(cache, tables, lens, block_size) -> None:
    """NaN in every slot of a request's blocks past its last token."""
    for row, n in zip(tables.tolist(), lens.tolist()):
        for t in range(n, -(-n // block_size) * block_size):
            cache[row[t // block_size], t % block_size].view(torch.uint8).fill_(NAN_E4M3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype, index_dtype):
    why = FP8DecodeKernel.supports(torch.device("cuda"), case[3], case[1] // case[2], case[4])
    if why is not None:
        pytest.skip(why)
    q, k_cache, v_cache, tables, lens, scales = fp8_inputs(case, dtype)
    scale = case[3] ** -0.5
    want = reference(q.float(), k_cache, v_cache, tables, lens, scale, kv_scales=scales)
    for cache in (k_cache, v_cache):  # after the reference, which multiplies them by 0
        poison_past_the_end(cache, tables, lens, case[4])
    tables, lens = tables.to(index_dtype), lens.to(index_dtype)
    out = FP8DecodeKernel()(q, k_cache, v_cache, tables, lens, scale, scales, splits=case[-1])
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out.float(), want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("tiles", TILINGS)
def test_tilings_agree_and_fill_the_given_output(tiles):
    case = ([2049, 100, 7, 4096], 32, 8, 128, 16, None)
    q, k_cache, v_cache, tables, lens, scales = fp8_inputs(case, torch.bfloat16)
    want = reference(q.float(), k_cache, v_cache, tables, lens, 128**-0.5, kv_scales=scales)
    out = torch.full_like(q, float("nan"))
    FP8DecodeKernel(tiles)(q, k_cache, v_cache, tables, lens, 128**-0.5, scales, out=out)
    assert_close(out.float(), want, torch.bfloat16)


def test_refuses_what_it_cannot_run_with_the_reason():
    assert FP8DecodeKernel.supports(torch.device("cpu"), 128, 4, 16) is not None
    if ON_GPU and torch.cuda.get_device_capability() >= (8, 9):
        cuda = torch.device("cuda")
        assert FP8DecodeKernel.supports(cuda, 128, 4, 16) is None
        assert "head_dim 128" in FP8DecodeKernel.supports(cuda, 64, 4, 16)
        assert "group 17" in FP8DecodeKernel.supports(cuda, 128, 17, 16)
        assert "block_size 8" in FP8DecodeKernel.supports(cuda, 128, 4, 8)


@pytest.mark.skipif(ON_GPU, reason="the CPU's answer")
def test_refuses_a_cpu_tensor():
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 1, 128, dtype=FP8_DTYPE)
    scales = (torch.ones(1), torch.ones(1))
    table, lens = torch.ones(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cupy|sm89"):
        FP8DecodeKernel()(q, cache, cache, table, lens, 1.0, scales)


@pytest.mark.parametrize(
    ("batch", "kv_heads", "splits"),
    [(64, 8, 16), (32, 8, 32), (8, 8, 32), (1, 8, 32), (256, 8, 4), (1024, 8, 1), (64, 2, 16)],
)
def test_split_count_aims_at_blocks_per_sm(batch, kv_heads, splits):
    tiles = FP8DecodeTiles(warps=8, stages=3, blocks_per_sm=4.0)
    assert FP8DecodeKernel.num_splits(tiles, batch, kv_heads, num_sms=132) == splits
