"""Split-KV decode attention over an FP8 KV cache (Triton, through the interpreter on
CPU) against the reference, and the reference against float32 attention over the
dequantized cache: an FP8 cache is read as ``float(q) * scale``, new rows are stored
as ``store_kv_fp8`` would, and the kernel never changes a scale."""

import pytest
import torch

from splitserve.kernels.decode_attention import decode_attention as reference
from splitserve.kernels.kv_store import FP8_DTYPE, dequantize_fp8
from splitserve.kernels.triton.decode_attention import decode_attention
from splitserve.kernels.tuning import DecodeTiles
from tests.kernels.test_decode_attention import new_rows, paged_inputs
from tests.kernels.utils import DEVICE, DTYPES, ON_GPU, assert_close

# (seq_lens, num_heads, num_kv_heads, head_dim, block_size, splits)
CASES = [
    ([5], 4, 2, 16, 4, 1),
    ([1, 17, 33], 4, 2, 16, 4, 4),  # splits with no tokens
    ([150, 20], 4, 2, 16, 4, 1),  # several tiles: the online softmax rescales
]
GPU_CASES = [
    ([8192] * 64, 32, 8, 128, 16, None),  # Qwen3-8B at batch 64, 8k context
    ([1, 4000, 333, 2048], 32, 8, 128, 16, None),
]
ALL_CASES = CASES + [pytest.param(c, marks=pytest.mark.gpu) for c in GPU_CASES]
FP8_OK = not ON_GPU or torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.skipif(not FP8_OK, reason="FP8 needs compute capability >= 8.9")


SCALES = (2.0**-7, 2.0**-9)  # K's and V's; powers of 2: x / scale is exact


def fp8_inputs(case, dtype):
    """q in ``dtype``, FP8 caches quantized from random values with their own scales."""
    q, k_cache, v_cache, tables, lens = paged_inputs(*case[:-1], torch.float32)
    caches = [(c * 100).clamp(-448, 448).to(FP8_DTYPE) for c in (k_cache, v_cache)]
    scales = tuple(torch.tensor([s], device=DEVICE) for s in SCALES)
    return q.to(dtype), *caches, tables, lens, scales


def fp8_exact_rows(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows whose FP8 quantization is exact (Triton's interpreter rounds some values up
    to a power of 2 wrongly: 127.9 becomes 64, not 128; a GPU rounds right)."""
    return ((x.float() * 100).clamp(-448, 448).to(FP8_DTYPE).float() * scale).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ALL_CASES)
def test_fp8_decode_matches_reference_and_dequantized_float32(case, dtype):
    q, k_cache, v_cache, tables, lens, scales = fp8_inputs(case, dtype)
    scale = case[3] ** -0.5
    out = decode_attention(q, k_cache, v_cache, tables, lens, scale, case[-1], kv_scales=scales)
    want = reference(q.float(), k_cache, v_cache, tables, lens, scale, kv_scales=scales)
    assert_close(out.float(), want, dtype)
    k32, v32 = dequantize_fp8(k_cache, scales[0]), dequantize_fp8(v_cache, scales[1])
    plain = reference(q.float(), k32, v32, tables, lens, scale)
    assert torch.allclose(want, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ALL_CASES)
def test_fp8_decode_stores_new_rows_quantized_and_leaves_the_scales(case, dtype):
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, splits = case
    q, k_cache, v_cache, tables, lens, scales = fp8_inputs(case, dtype)
    k, v, slots = new_rows(tables, lens, num_kv_heads, head_dim, block_size, dtype)
    new = (fp8_exact_rows(k, SCALES[0]), fp8_exact_rows(v, SCALES[1]), slots)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    before = [s.clone() for s in scales]
    scale = head_dim**-0.5
    out = decode_attention(
        q, k_cache, v_cache, tables, lens, scale, splits, new_kv=new, kv_scales=scales
    )
    want = reference(q.float(), ref_k, ref_v, tables, lens, scale, new_kv=new, kv_scales=scales)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    assert all(torch.equal(s, b) for s, b in zip(scales, before))
    assert_close(out.float(), want.float(), dtype)


# Triton's interpreter widens FP8 to bfloat16 wrongly (garbage): that case runs on GPUs.
@pytest.mark.parametrize("f16_dot", [pytest.param(False, marks=pytest.mark.gpu), True])
def test_fp8_tiles_widen_to_either_16_bit_type_alike(f16_dot):
    """FP8 tiles and a bf16 q multiplied in bfloat16 or in float16 (both hold e4m3 and
    bf16's q exactly) agree with the reference."""
    q, k_cache, v_cache, tables, lens, scales = fp8_inputs(CASES[2], torch.bfloat16)
    tiles = DecodeTiles(32, 1, 2, fp8_f16_dot=f16_dot)
    out = decode_attention(
        q, k_cache, v_cache, tables, lens, 0.25, 1, kv_scales=scales, tiles=tiles
    )
    want = reference(q.float(), k_cache, v_cache, tables, lens, 0.25, kv_scales=scales)
    assert_close(out.float(), want, torch.bfloat16)


def test_float16_products_clamp_a_q_beyond_float16s_range():
    """A bf16 q past float16's range is clamped to it for the float16 products: the output
    stays finite (an overflow to inf would give NaN)."""
    q, k_cache, v_cache, tables, lens, scales = fp8_inputs(CASES[0], torch.bfloat16)
    q[0, 0, 0] = 1e6
    tiles = DecodeTiles(32, 1, 2, fp8_f16_dot=True)
    out = decode_attention(
        q, k_cache, v_cache, tables, lens, 0.25, 1, kv_scales=scales, tiles=tiles
    )
    assert torch.isfinite(out.float()).all()


def test_fp8_cache_needs_scales_and_a_plain_cache_takes_none():
    q, k_cache, v_cache, tables, lens, scales = fp8_inputs(CASES[0], torch.float32)
    with pytest.raises(ValueError, match="needs kv_scales"):
        decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    with pytest.raises(ValueError, match="takes no kv_scales"):
        reference(q, k_cache.float(), v_cache.float(), tables, lens, 0.25, kv_scales=scales)


@pytest.mark.parametrize("case", [c for c in ALL_CASES if len(getattr(c, "values", [c])[0][0]) > 1])
def test_fp8_decode_sets_uncalibrated_scales_as_the_store_does(case):
    """Scales at 0: the kernel sets them from the step's stored new rows (amax / 448, a
    skipped row not counted) before storing and attending, as ``store_kv_fp8`` would."""
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, splits = case
    q, k_cache, v_cache, tables, lens, _ = fp8_inputs(case, torch.float32)
    k, v, slots = new_rows(tables, lens, num_kv_heads, head_dim, block_size, torch.float32)
    k, v = fp8_exact_rows(k, SCALES[0]), fp8_exact_rows(v, SCALES[1])
    k[1, 0, 0], v[1, 0, 0] = 448 * SCALES[0], 448 * SCALES[1]  # amax / 448 = SCALES
    k[0] *= 1000  # the largest row is skipped: it must not set the scale
    slots[0] = -1
    scales = tuple(torch.zeros(1, device=DEVICE) for _ in "kv")
    ref_scales = tuple(torch.zeros(1, device=DEVICE) for _ in "kv")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    scale = head_dim**-0.5
    new = (k, v, slots)
    out = decode_attention(
        q, k_cache, v_cache, tables, lens, scale, splits, new_kv=new, kv_scales=scales
    )
    want = reference(q, ref_k, ref_v, tables, lens, scale, new_kv=new, kv_scales=ref_scales)
    assert [s.item() for s in scales] == [s.item() for s in ref_scales] == list(SCALES)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    assert_close(out[1:], want[1:], torch.float32)  # row 0 (not stored) attends its input
