"""Expert-parallel DECODE-mode rows: the Triton send buffer and sum, and the reads of the
ranks' shared buffers (``ep_peer``, several ranks' buffers in one process), against the
references."""

import pytest
import torch

from splitserve.kernels import ep_rows as ref
from splitserve.kernels.ep_rows import PeerOffsets, RowLayout
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


def _rank_buffers(ranks: int, capacity: int, layout: RowLayout):
    """Each rank's shared buffer (as ``peer_memory``'s, in one process, read through
    their addresses; stale bytes 7 everywhere), its send rows written by the kernel,
    and what the reference sends: ``(bases, offsets, buffers, counters, sends, routes)``."""
    send_bytes = ranks * capacity * layout.bytes
    offsets = PeerOffsets(flags=0, counts=64, send=128, parts=128 + -(-send_bytes // 256) * 256)
    nbytes = offsets.parts + ranks * capacity * layout.hidden * 4
    buffers = [torch.full((nbytes,), 7, dtype=torch.uint8, device=DEVICE) for _ in range(ranks)]
    counters = [torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(ranks)]
    sends, routes = [], []
    for r, buffer in enumerate(buffers):
        g = torch.Generator(DEVICE).manual_seed(r)
        n = capacity - r  # the ranks bring different token counts
        hidden = torch.randn(n, layout.hidden, device=DEVICE, generator=g).to(layout.dtype)
        ids = torch.rand(n, 8 * ranks, device=DEVICE, generator=g).topk(layout.top_k).indices
        ids[0] = torch.arange(layout.top_k, device=DEVICE)  # token 0: rank 0's experts only
        weights = torch.rand(n, layout.top_k, device=DEVICE, generator=g)
        slots = torch.where(torch.arange(n, device=DEVICE) < n - 1, 3, -1)  # last: padding
        want, want_row = ref.send_rows(hidden, ids, weights, slots, 8, ranks, capacity)
        send = buffer[offsets.send : offsets.send + send_bytes].view(-1, layout.bytes)
        counts = buffer[offsets.counts : offsets.counts + 4 * ranks].view(torch.int32)
        row = peer.send_rows(send, counts, hidden, ids, weights, slots, 8, capacity)
        assert torch.equal(row, want_row)
        sends.append(want), routes.append(row)
    bases = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)
    return bases, offsets, buffers, counters, sends, routes


def _flags(buffer: torch.Tensor, ranks: int) -> torch.Tensor:
    return buffer[: 8 * ranks].view(torch.int64)


def test_send_rows_write_the_rows_and_their_counts():
    """The rows sent equal the reference's, rows past a rank's count keep their stale
    bytes, the counts are the rows each rank gets."""
    layout = RowLayout(40, 3, torch.float32)
    _, offsets, buffers, _, sends, routes = _rank_buffers(2, 6, layout)
    for buffer, want, row in zip(buffers, sends, routes):
        per_rank = [int((row[:, d] < 12).sum()) for d in range(2)]
        counts = buffer[offsets.counts : offsets.counts + 8].view(torch.int32)
        assert counts.tolist() == per_rank
        send = buffer[offsets.send : offsets.send + 12 * layout.bytes].view(12, layout.bytes)
        for d in range(2):
            assert torch.equal(send[d * 6 : d * 6 + per_rank[d]], want[d * 6 : d * 6 + per_rank[d]])
            assert (send[d * 6 + per_rank[d] : (d + 1) * 6] == 7).all()
    assert per_rank[1] < 5  # token 0 stays home, the last is padding: rows to spare


@pytest.mark.parametrize("ranks", [2, 3])
def test_pull_rows_read_what_every_rank_sends_here(ranks):
    """Rank r's rows out of every rank's send rows, places past a rank's count padding
    (ids -1, 0xFF bytes) whatever stale bytes lie there."""
    layout = RowLayout(40, 3, torch.float32)
    bases, offsets, buffers, _, sends, _ = _rank_buffers(ranks, 6, layout)  # kept alive
    for r in range(ranks):
        got = peer.pull_rows(bases, r, 6, offsets, layout)
        assert torch.equal(got, ref.pull_rows(sends, r, 6))
    padding = (layout.unpack(got)[1] < 0).all(dim=-1)
    assert padding.any() and (got[padding] == ref.PAD_BYTE).all()


@pytest.mark.parametrize("num_tokens", [None, 0])
def test_sum_peer_parts_add_every_rank_s_part(num_tokens):
    """Each token's parts read from every rank's buffer and added as the reference."""
    ranks, capacity, hidden = 3, 6, 40
    layout = RowLayout(hidden, 3, torch.float32)
    bases, offsets, buffers, _, _, routes = _rank_buffers(ranks, capacity, layout)
    parts = [torch.randn(ranks * capacity, hidden, device=DEVICE) for _ in range(ranks)]
    for buffer, part in zip(buffers, parts):
        buffer[offsets.parts :].view(torch.float32).copy_(part.flatten())
    for r in range(ranks):
        row = routes[r][:num_tokens]
        got = peer.sum_peer_parts(bases, row, r, capacity, offsets, hidden, torch.float32)
        assert torch.equal(got, ref.sum_peer_parts(parts, row, r, capacity))


def test_count_choices_equal_the_reference():
    """Strided ids (a view of received rows), -1 skipped, repeated experts counted."""
    rows = torch.randint(-1, 6, (70, 5), dtype=torch.int32, device=DEVICE)
    ids = rows[:, 1:4]  # not contiguous
    got = torch.full((6,), 3, dtype=torch.long, device=DEVICE)
    want = got.clone()
    tri.count_choices(got, ids)
    ref.count_choices(want, ids)
    assert torch.equal(got, want) and want.sum() - 18 == (ids >= 0).sum()
