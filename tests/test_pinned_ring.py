"""Page-locked slots that kernels read or write in place: a slot comes round again only
after the device ran the work queued on it."""

import pytest
import torch

from splitserve.workers.runner.pinned_ring import PinnedRing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_a_slot_comes_round_only_after_its_queued_work_ran():
    ring = PinnedRing(torch.int64, slots=2)
    values = torch.arange(1000, device="cuda")
    first = ring.take(1000)
    first.tensor.fill_(-1)
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time before the copy
    first.tensor.copy_(values, non_blocking=True)
    first.queued()
    ring.take(10)
    again = ring.take(1000)  # the first slot: waits for the copy
    assert torch.equal(again.tensor, values.cpu())
    with pytest.raises(RuntimeError, match="overwritten"):
        first.check()
    again.check()


def test_slots_grow_and_keep_their_page_lock():
    ring = PinnedRing(torch.int32, slots=2)
    small, large = ring.take(4), ring.take(3000)
    assert small.tensor.numel() == 4 and large.tensor.numel() == 3000
    assert small.tensor.is_pinned() and large.tensor.is_pinned()
    assert ring.take(5000).tensor.numel() == 5000


def test_a_ring_needs_two_slots():
    with pytest.raises(ValueError, match="at least 2"):
        PinnedRing(torch.int64, slots=1)
