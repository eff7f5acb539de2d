"""Pick the attention backend for a device."""

from __future__ import annotations

import torch

from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.attention.torch_backend import TorchAttentionBackend

BACKENDS = ("auto", "torch")


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks the fastest backend available on the device (torch for now)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; accepted: {', '.join(BACKENDS)}")
    return TorchAttentionBackend()
