"""Expert-parallel DECODE-mode rows: the Triton send buffer and sum against the reference."""

import pytest
import torch

from splitserve.kernels import ep_rows as ref
from splitserve.kernels.triton import ep_rows as tri
from tests.kernels.utils import DEVICE, DTYPES


def _routing(num_tokens: int, experts: int, top_k: int, dtype):
    hidden = torch.randn(num_tokens, 40, device=DEVICE).to(dtype)
    ids = torch.rand(num_tokens, experts, device=DEVICE).topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    return hidden, ids, weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "ranks", "capacity", "live"),
    [(1, 2, 1, None), (9, 2, 9, None), (70, 2, 96, 50), (13, 4, 16, 7), (0, 2, 4, None)],
)
def test_send_rows_equal_the_reference(dtype, num_tokens, ranks, capacity, live):
    """Every byte of the buffer (rows nobody writes: 0xFF) and every row index; tokens
    past ``live`` are padding (KV slot -1) and go nowhere; 70 tokens span two chunks."""
    hidden, ids, weights = _routing(num_tokens, 8 * ranks, 3, dtype)
    slots = None
    if live is not None:
        slots = torch.where(torch.arange(num_tokens, device=DEVICE) < live, 5, -1)
    args = (hidden, ids, weights, slots, 8, ranks, capacity)
    buffer, row = tri.send_rows(*args)
    want_buffer, want_row = ref.send_rows(*args)
    assert torch.equal(row, want_row) and torch.equal(buffer, want_buffer)
    if live is not None:
        assert (row[live:] == ranks * capacity).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_rows_equal_the_reference(dtype):
    _, ids, weights = _routing(11, 16, 4, dtype)
    hidden = torch.randn(11, 40, device=DEVICE).to(dtype)
    _, row = ref.send_rows(hidden, ids, weights, None, 8, 2, 12)
    back = torch.randn(24, 40, device=DEVICE).to(dtype)
    assert torch.equal(tri.sum_rows(back, row), ref.sum_rows(back, row))
    rank0 = row[:, 0] < 24
    assert rank0.any() and (~rank0).any()  # tokens with and without a part from rank 0
