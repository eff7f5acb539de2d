"""Pick the attention backend for a device and a model's attention shape."""

from __future__ import annotations

import logging

import torch

from splitserve.config import KernelConfig
from splitserve.kernels.kv_store import FP8_DTYPE
from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.attention.torch_backend import TorchAttentionBackend
from splitserve.workers.kv.layout import KVLayout

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "flashinfer")


def make_attention_backend(
    name: str,
    device: torch.device,
    num_heads: int,
    layout: KVLayout,
    kernels: KernelConfig | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """``auto``: FlashInfer on a GPU when it serves this shape and dtype, else torch.
    ``num_heads``: query heads; ``layout``: the KV cache the backend reads; ``kernels``:
    the config's kernel choices (default: ``KernelConfig()``); ``dtype``: the model's
    (q's) dtype, by default the cache's (an FP8 cache needs it given)."""
    kernels = kernels or KernelConfig()
    head_dim, dtype = layout.head_dim, dtype or layout.dtype
    if dtype == FP8_DTYPE:
        raise ValueError("an FP8 KV cache's attention backend needs the model's dtype")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; accepted: {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if device.type != "cuda":
        raise ValueError("attention_backend 'flashinfer' needs a CUDA device")
    from splitserve.workers.attention.flashinfer_backend import (
        FlashInferAttentionBackend,
        flashinfer_supports,
    )

    if name == "auto":
        fits = dtype in (torch.float16, torch.bfloat16) and flashinfer_supports(head_dim, device)
        if not fits:
            logger.info(
                "attention: torch backend (flashinfer needs head_dim 64/128/256 and "
                "float16/bfloat16; this model has head_dim %d, %s)",
                head_dim,
                dtype,
            )
            return TorchAttentionBackend()
    return FlashInferAttentionBackend(
        num_heads,
        layout.num_kv_heads,
        head_dim,
        dtype,
        device,
        split_kv_max_batch=kernels.split_kv_max_batch,
        kv_dtype=layout.dtype,
        fp8_decode=kernels.fp8_decode,
    )
