"""Expert-parallel DECODE-mode rows: the Triton send buffer and sum, and the reads of the
ranks' shared buffers (``ep_peer``, several ranks' buffers in one process), against the
references."""

import pytest
import torch

from splitserve.kernels import ep_rows as ref
from splitserve.kernels.ep_rows import RowLayout
from splitserve.kernels.triton import ep_peer as peer
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


def test_send_rows_into_a_given_buffer():
    """The rows sent and every id and weight equal the reference's; rows nobody writes
    keep their hidden bytes (the peer read pads them)."""
    hidden, ids, weights = _routing(9, 16, 3, torch.float32)
    slots = torch.where(torch.arange(9, device=DEVICE) < 6, 5, -1)
    args = (hidden, ids, weights, slots, 8, 2, 12)
    want, want_row = ref.send_rows(*args)
    given = torch.zeros_like(want)
    buffer, row = tri.send_rows(*args, buffer=given)
    assert buffer.data_ptr() == given.data_ptr() and torch.equal(row, want_row)
    layout = RowLayout(40, 3, torch.float32)
    assert torch.equal(buffer[:, layout.hidden_bytes :], want[:, layout.hidden_bytes :])
    sent = row[row < 24]
    assert torch.equal(buffer[sent], want[sent])
    assert (buffer[~torch.isin(torch.arange(24, device=DEVICE), sent), :160] == 0).all()


def _shared_buffers(ranks: int, capacity: int, layout: RowLayout, offset: int):
    """Each rank's buffer (send rows at ``offset``), its send rows and token routes: the
    same layout as ``peer_memory``'s, in one process, read through their addresses."""
    buffers, sends, routes = [], [], []
    for r in range(ranks):
        g = torch.Generator(DEVICE).manual_seed(r)
        n = capacity - r  # the ranks bring different token counts
        hidden = torch.randn(n, layout.hidden, device=DEVICE, generator=g).to(layout.dtype)
        scores = torch.rand(n, 8 * ranks, device=DEVICE, generator=g)
        ids = scores.topk(layout.top_k, dim=-1).indices
        ids[0] = torch.arange(layout.top_k, device=DEVICE)  # token 0: rank 0's experts only
        weights = torch.rand(n, layout.top_k, device=DEVICE, generator=g)
        send, row = ref.send_rows(hidden, ids, weights, None, 8, ranks, capacity)
        buffer = torch.full((offset + send.numel(),), 7, dtype=torch.uint8, device=DEVICE)
        buffer[offset:].copy_(send.flatten())
        buffers.append(buffer), sends.append(send), routes.append(row)
    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)
    return bases, buffers, sends, routes


@pytest.mark.parametrize("ranks", [2, 3])
def test_pull_rows_read_what_every_rank_sends_here(ranks):
    """Rank r's rows out of every rank's send rows, padding rows with their hidden state
    0xFF; a token with all its experts on rank 0 sends rank 1 nothing."""
    layout = RowLayout(40, 3, torch.float32)
    bases, _, sends, routes = _shared_buffers(ranks, 6, layout, offset=256)
    for r in range(ranks):
        got = peer.pull_rows(bases, r, 6, 256, layout)
        assert torch.equal(got, ref.pull_rows(sends, r, 6, layout))
    assert (routes[0][0, 1:] == ranks * 6).all()
    padding = (layout.unpack(got)[1] < 0).all(dim=-1)
    assert padding.any() and (got[padding, :160] == ref.PAD_BYTE).all()


def test_sum_peer_parts_add_every_rank_s_part():
    ranks, capacity, hidden = 3, 6, 40
    layout = RowLayout(hidden, 3, torch.float32)
    bases, _, _, routes = _shared_buffers(ranks, capacity, layout, offset=0)
    parts = [torch.randn(ranks * capacity, hidden, device=DEVICE) for _ in range(ranks)]
    part_bases = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64, device=DEVICE)
    for r in range(ranks):
        got = peer.sum_peer_parts(part_bases, routes[r], r, capacity, 0, hidden, torch.float32)
        assert torch.equal(got, ref.sum_peer_parts(parts, routes[r], r, capacity))


def test_barrier_counts_and_signals_every_rank():
    """Rank 0's first barrier when rank 1 already arrived: its epoch (1) lands in its
    flag of both buffers, and it returns (rank 1's flag in its own buffer is 1)."""
    flags = [torch.zeros(2, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    flags[0][1] = 1  # rank 1 reached its first barrier
    bases = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    peer.barrier(bases, counter, 0, 0)
    assert counter.item() == 1 and flags[0].tolist() == [1, 1] and flags[1].tolist() == [1, 0]
