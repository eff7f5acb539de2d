import pytest
import torch

from splitserve.kernels.argmax import argmax as argmax_ref
from splitserve.kernels.triton import argmax as triton_argmax
from tests.kernels.utils import DEVICE, DTYPES, ON_GPU

SHAPES = [(1, 5000), (3, 9000), (5, 100)]
GPU_SHAPES = [(1, 151936), (8, 151936), (64, 151936), (200, 32000)]
ALL_SHAPES = SHAPES + [pytest.param(s, marks=pytest.mark.gpu) for s in GPU_SHAPES]


def host_tokens(rows: int) -> torch.Tensor:
    """Where the kernel stores the tokens: page-locked memory on a GPU machine."""
    return torch.full((rows,), -7, dtype=torch.int64, pin_memory=ON_GPU)


def logits_with_ties(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows whose maximum appears twice (and, in row 0, last in the first program's
    words and first in a later one's), so ties decide the result."""
    x = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    for r in range(rows):
        top = x[r].max() + 1
        first = (r * 997) % vocab
        x[r, first] = top
        x[r, (first + vocab // 2) % vocab] = top
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_argmax_matches_reference_with_ties(shape, dtype):
    x = logits_with_ties(*shape, dtype)
    host = host_tokens(shape[0])
    tokens = triton_argmax.argmax(x, host)
    if ON_GPU:
        torch.cuda.synchronize()
    want = argmax_ref(x)
    assert torch.equal(tokens, want)
    assert torch.equal(host, want.cpu())
    again = triton_argmax.argmax(x)  # the scratch was reset by the launch before
    assert torch.equal(again, want)


def test_argmax_resets_its_scratch():
    x = logits_with_ties(3, 9000, torch.float32)
    triton_argmax.argmax(x)
    scratch = triton_argmax._Scratch.of(x.device, 3)
    assert (scratch.keys == triton_argmax.EMPTY).all() and not scratch.counts.any()
    y = -x  # every row's answer changes: a stale key would win
    assert torch.equal(triton_argmax.argmax(y), y.argmax(dim=-1))


def test_argmax_orders_special_values_as_torch():
    x = torch.full((4, 5000), float("-inf"), device=DEVICE)
    x[1, 4000] = float("nan")  # NaN beats +inf, the first NaN wins, whatever its sign
    x[1, 10] = -torch.tensor(float("nan"))
    assert x[1, 10].view(torch.int32) < 0  # the sign bit is set
    x[1, 3] = float("inf")
    x[2] = 0.0
    x[2, :5] = -0.0  # -0.0 ties 0.0: index 0
    x[3, 4999] = -3.0  # one finite value among -inf, in the last program's words
    assert torch.equal(triton_argmax.argmax(x), x.argmax(dim=-1))
    assert triton_argmax.argmax(x).tolist() == [0, 10, 0, 4999]


def test_argmax_reads_strided_rows():
    x = torch.randn(6, 6000, device=DEVICE)[::2]  # rows 12000 apart
    assert torch.equal(triton_argmax.argmax(x), x.argmax(dim=-1))


def test_argmax_rejects_bad_shapes():
    x = torch.randn(2, 100, device=DEVICE)
    with pytest.raises(ValueError, match=r"host_out must be \[2\] int64"):
        triton_argmax.argmax(x, torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows, vocab"):
        triton_argmax.argmax(x[0])
