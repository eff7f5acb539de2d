import pytest
import torch

from splitserve.kernels import decode_inputs as reference
from splitserve.kernels.decode_inputs import SOURCE, STAGED_COLUMNS
from splitserve.kernels.triton import decode_inputs as triton_inputs
from tests.kernels.utils import DEVICE, ON_GPU

CASES = [  # (requests, graph size, table width, tokens in flight)
    (3, 4, 5, True),
    (4, 4, 300, False),  # tables wider than one copy block
    (1, 8, 2, True),
    pytest.param(64, 64, 257, True, marks=pytest.mark.gpu),
]


def staged_rows(n: int, width: int, in_flight: bool) -> torch.Tensor:
    rows = torch.randint(0, 1000, (n, STAGED_COLUMNS + width), dtype=torch.int32)
    rows[:, SOURCE] = -1
    if in_flight:
        rows[::2, SOURCE] = torch.randperm(n)[: len(rows[::2])].to(torch.int32)
    return rows.pin_memory() if ON_GPU else rows


def static_buffers(size: int, width: int) -> list[torch.Tensor]:
    """A graph's static buffers full of stale values."""
    long = {"dtype": torch.long, "device": DEVICE}
    return [
        torch.full((size,), 77, **long),
        torch.full((size,), 78, **long),
        torch.full((size,), 79, **long),
        torch.full((size,), 55, dtype=torch.int32, device=DEVICE),
        torch.full((size, width + 3), 99, dtype=torch.int32, device=DEVICE),
    ]


@pytest.mark.parametrize("n, size, width, in_flight", CASES)
@pytest.mark.parametrize("index", [True, False])
def test_staging_matches_reference(n, size, width, in_flight, index):
    staged = staged_rows(n, width, in_flight)
    previous = torch.randint(0, 150000, (n,), device=DEVICE) if in_flight else None
    got, want = static_buffers(size, width), static_buffers(size, width)
    for module, buffers in ((triton_inputs, got), (reference, want)):
        ids, pos, slots, seq_lens, tables = buffers
        index_buffers = (seq_lens, tables) if index else (None, None)
        module.stage_decode_inputs(staged, previous, ids, pos, slots, *index_buffers, 3)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    ids, pos, slots, seq_lens, tables = got
    assert slots[n:].eq(-1).all() and ids[n:].eq(0).all()
    if in_flight:
        sources = staged[:, SOURCE].long().to(DEVICE)
        pending = sources >= 0
        assert torch.equal(ids[:n][pending], previous[sources[pending]])
    if index:
        assert seq_lens[n:].eq(3).all() and tables[n:, :width].eq(0).all()
        assert tables[:, width:].eq(99).all()  # past the step's width: left as it was
    else:
        assert seq_lens.eq(55).all() and tables.eq(99).all()


def test_staging_rejects_what_it_cannot_stage():
    ids, pos, slots, seq_lens, tables = static_buffers(4, 5)
    with pytest.raises(ValueError, match="int32"):
        triton_inputs.stage_decode_inputs(staged_rows(3, 5, False).long(), None, ids, pos, slots)
    with pytest.raises(ValueError, match=r"n <= 4"):
        triton_inputs.stage_decode_inputs(staged_rows(5, 5, False), None, ids, pos, slots)
    with pytest.raises(ValueError, match=r"\[size, >= width\]"):
        triton_inputs.stage_decode_inputs(
            staged_rows(3, 9, False), None, ids, pos, slots, seq_lens, tables
        )
