"""The GPU properties the kernel wrappers size their launches by, read once per device.

Which GPU takes which kernel is ``kernels/tuning.py``'s table. Nothing here imports triton."""

from __future__ import annotations

import functools

import torch


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
    """The CUDA device's name (``torch.cuda.get_device_name``); ``""`` off the GPU."""
    return _properties(_index(device)).name if device.type == "cuda" else ""


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)
