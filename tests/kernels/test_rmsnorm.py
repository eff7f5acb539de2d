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
