"""The GPU properties the kernel wrappers size their launches by, read once per device,
and the GPUs on which the kernels for 17 to 64 rows are used (``medium_batch_kernels``)."""

from __future__ import annotations

import functools

import torch

# GPUs (a substring of the name) on which the kernels for 17 to 64 rows
# (``gate_up_silu.py``, ``linear.py``'s one wave) made a batch-64 decode step faster
# than cuBLAS, both trees measured in one call through the engine loop. Not the H200:
# there the step took 0.06-0.1 ms longer with them, although each kernel alone beat
# cuBLAS in a 36-layer chain.
MEDIUM_BATCH_GPUS = ("H100",)


def medium_batch_kernels(device: torch.device) -> bool:
    """Whether 17 to 64 rows take the Triton kernels on ``device`` (``MEDIUM_BATCH_GPUS``);
    True off the GPU, where the tests run them through Triton's interpreter."""
    return device.type != "cuda" or any(gpu in name(device) for gpu in MEDIUM_BATCH_GPUS)


def sm_count(device: torch.device, off_gpu: int) -> int:
    """The device's SM count; ``off_gpu`` for a CPU tensor (Triton's interpreter)."""
    if device.type != "cuda":
        return off_gpu
    return _properties(_index(device)).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, e.g. ``(9, 0)``."""
    props = _properties(_index(device))
    return props.major, props.minor


def name(device: torch.device) -> str:
    """The CUDA device's name, e.g. ``"NVIDIA H100 80GB HBM3"``; ``""`` off the GPU."""
    return _properties(_index(device)).name if device.type == "cuda" else ""


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)
