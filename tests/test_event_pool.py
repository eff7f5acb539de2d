"""The KV hand-off's event pool: events exist when taken, come back when given, and
``record`` / ``wait`` through their handles order one stream after another.

Run on a GPU: ``python -m pytest -q -m gpu tests/test_event_pool.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from splitserve.workers.kv.transfer import event_pool  # noqa: E402
from splitserve.workers.kv.transfer.event_pool import EventPool, record, wait  # noqa: E402

pytestmark = pytest.mark.gpu

STALL_CYCLES = 1_000_000_000  # about half a second of GPU clock


def test_taken_events_exist_and_given_ones_are_reused():
    pool = EventPool(torch.cuda.Stream(), ready=3)
    assert pool.free == 3
    taken = pool.take(5)  # three from the pool, two made now
    assert pool.free == 0
    assert len({id(e) for e in taken}) == 5 and all(e.cuda_event != 0 for e in taken)
    pool.give(taken)
    again = pool.take(5)
    assert {id(e) for e in again} == {id(e) for e in taken}


def test_the_pool_keeps_at_most_its_cap(monkeypatch):
    monkeypatch.setattr(event_pool, "_KEEP", 4)
    pool = EventPool(torch.cuda.Stream())
    pool.give(pool.take(6))
    assert pool.free == 4


def test_a_wait_through_the_handles_holds_the_stream_until_the_record():
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    (event,) = EventPool(torch.cuda.Stream(), ready=1).take(1)
    value = torch.zeros(1, device="cuda")
    first.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(first):
        torch.cuda._sleep(STALL_CYCLES)
        value.fill_(7.0)
    record(event, first.cuda_stream)
    wait(second.cuda_stream, event)
    with torch.cuda.stream(second):
        seen = value.clone()
    assert not event.query()  # the stall still runs: the copy waits behind it
    second.synchronize()
    assert seen.item() == 7.0
