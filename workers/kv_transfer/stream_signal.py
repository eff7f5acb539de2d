"""A GPU-side signal between streams: an int32 in device memory that one stream
writes and another waits on, with no host in between.

CUDA's stream memory operations (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``,
driver API, through ctypes). The NCCL sender queues a transfer's gathers and
sends when it announces it, each gather behind ``wait_at_least(copy stream,
signal, layers)``; the compute stream then ``write``\\ s the number of layers
stored, so a message leaves as soon as its layers are on the GPU, without a
host round trip per message. ``available()`` says whether this driver and
device support it (probed once per device).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

logger = logging.getLogger(__name__)

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT

OPEN = 1 << 30  # a value above any layer count: every wait on the signal passes


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    functions = []
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        functions.append(fn)
    return tuple(functions)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def write(stream: torch.cuda.Stream, signal: torch.Tensor, value: int) -> None:
    """Queue ``signal[0] = value`` on ``stream``."""
    _check(_driver()[0](stream.cuda_stream, signal.data_ptr(), value, _WRITE_DEFAULT), "write")


def wait_at_least(stream: torch.cuda.Stream, signal: torch.Tensor, value: int) -> None:
    """Make ``stream`` wait until ``signal[0] >= value`` (the work queued after waits)."""
    _check(_driver()[1](stream.cuda_stream, signal.data_ptr(), value, _WAIT_GEQ), "wait")


def new_signal(stream: torch.cuda.Stream) -> torch.Tensor:
    """A zeroed int32 signal on ``stream``'s device, zeroed in ``stream``'s order."""
    with torch.cuda.stream(stream):
        return torch.zeros(1, dtype=torch.int32, device=stream.device)


@functools.cache
def available(device_index: int) -> bool:
    """Whether stream memory operations work on this device: one write and one wait,
    on two streams, must complete."""
    try:
        device = torch.device("cuda", device_index)
        first, second = torch.cuda.Stream(device), torch.cuda.Stream(device)
        signal = new_signal(first)
        write(first, signal, 1)
        wait_at_least(second, signal, 1)
        second.synchronize()
        first.synchronize()
        return int(signal.item()) == 1
    except (OSError, AttributeError, RuntimeError) as e:
        logger.info("stream memory operations unavailable: %s", e)
        return False
