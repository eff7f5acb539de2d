import pytest
import torch

from splitserve.kernels.rmsnorm import rms_norm as rms_norm_ref
from splitserve.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm
from tests.kernels.utils import DTYPES, assert_close, randn

SHAPES = [(5, 64), (3, 7, 96), (4, 1000)]
GPU_SHAPES = [(4096, 4096), (257, 5120)]
ALL_SHAPES = SHAPES + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SHAPES]


def inputs(shape, dtype):
    x = randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]  # strided rows and columns
    weight = 1 + 0.5 * randn(shape[-1], dtype=dtype)
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    x, weight = inputs(shape, dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    assert_close(out, rms_norm_ref(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_fused_add_rms_norm_matches_reference(shape, dtype):
    x, weight = inputs(shape, dtype)
    residual = 3 * randn(*shape, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    out_ref, residual_ref = rms_norm_ref(x, weight, 1e-5, residual)
    assert_close(out, out_ref, dtype)
    assert torch.equal(new_residual, residual_ref)  # one rounding of the same sum
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    out2, residual2 = rms_norm(x, weight, 1e-5, residual)  # the reference's signature
    assert torch.equal(out2, out) and torch.equal(residual2, new_residual)


def test_float32_weight_promotes_like_the_reference():
    x = randn(3, 48, dtype=torch.float16)
    weight = randn(48)
    out = rms_norm(x, weight, 1e-6)
    ref = rms_norm_ref(x, weight, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    assert_close(out, ref, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_view_of_fused_qkv_is_read_in_place(dtype):
    """q of a fused qkv output: [tokens, heads, head_dim] whose token stride spans q, k and v."""
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 32
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = 1 + 0.5 * randn(head_dim, dtype=dtype)
    with pytest.raises(RuntimeError):
        q.view(-1, head_dim)  # rows do not flatten: the kernel must address (token, head)
    out = rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape and out.is_contiguous()
    assert_close(out, rms_norm_ref(q, weight, 1e-6), dtype)


def test_many_short_rows_share_a_program():
    x = randn(300, 16)  # 300 rows of 16: several programs of many rows, a partial last one
    weight = 1 + 0.5 * randn(16)
    assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), torch.float32)
