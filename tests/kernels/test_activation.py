import pytest
import torch

from splitserve.kernels.activation import silu_and_mul as silu_and_mul_ref
from splitserve.kernels.triton.activation import silu_and_mul
from tests.kernels.utils import DTYPES, assert_close, randn

SHAPES = [(5, 2 * 64), (3, 4, 2 * 96), (2, 2 * 1500)]  # the last one spans two column blocks
GPU_SHAPES = [(4096, 2 * 3072), (77, 2 * 1408)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", SHAPES + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SHAPES]
)
def test_silu_and_mul_matches_reference(shape, dtype):
    x = 3 * randn(*shape, dtype=dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, silu_and_mul_ref(x), dtype)


def test_silu_and_mul_into_out_and_from_strided_rows():
    x = randn(6, 2 * 2 * 40)[:, ::2]  # [6, 80], stride 2 along the last dim
    out = torch.full((6, 40), float("nan"), device=x.device)
    assert silu_and_mul(x, out=out) is out
    assert_close(out, silu_and_mul_ref(x), torch.float32)
