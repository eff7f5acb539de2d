"""GPU signals between streams: a wait holds its stream's later work until the write."""

import pytest
import torch

from splitserve.workers.kv_transfer import stream_signal

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def streams():
    if not stream_signal.available(0):
        pytest.skip("stream memory operations are not supported by this driver")
    device = torch.device("cuda", 0)
    return torch.cuda.Stream(device), torch.cuda.Stream(device)


def test_work_behind_a_wait_runs_only_after_the_write(streams):
    writer, waiter = streams
    signal = stream_signal.new_signal(writer)
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    stream_signal.wait_at_least(waiter, signal, 3)
    with torch.cuda.stream(waiter):
        dst.copy_(src)
    with torch.cuda.stream(writer):
        torch.cuda._sleep(200_000_000)  # about 0.1 s, then the write
    stream_signal.write(writer, signal, 2)  # below the wait's value: still held
    stream_signal.write(writer, signal, 3)
    assert not waiter.query()  # held by the wait while the writer sleeps
    waiter.synchronize()
    assert writer.query()  # the copy ran only after the writes
    assert torch.equal(dst, src)


def test_open_releases_every_wait(streams):
    writer, waiter = streams
    signal = stream_signal.new_signal(writer)
    for value in (1, 8, 36):
        stream_signal.wait_at_least(waiter, signal, value)
    stream_signal.write(writer, signal, stream_signal.OPEN)
    waiter.synchronize()
    writer.synchronize()
    assert int(signal.item()) == stream_signal.OPEN
