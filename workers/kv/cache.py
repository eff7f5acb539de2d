"""Paged KV cache: per layer, one K and one V tensor of fixed-size blocks.

Layout (NHD): ``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's
slot is ``block_id * block_size + offset``. Block 0 is the null page: the
block manager never hands it out and it stays zero, so padded rows of a
block table (and of a CUDA graph) can point at it without touching live KV.

An FP8 cache (``float8_e4m3fn``) has a K and a V scale a layer (``scales``,
``scales.py``); ``store`` quantizes with them. A device that cannot hold FP8
(a CUDA GPU before compute capability 8.9) is refused here, at start-up.
"""

from __future__ import annotations

import torch

from splitserve.kernels import ops
from splitserve.kernels.kv_store import FP8_DTYPE, check_kv_cache_dtype
from splitserve.scheduler.block_manager import NULL_BLOCK
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.kv.scales import KVScales


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str):
        if num_blocks < 2:
            raise ValueError(
                f"KV cache needs at least 2 blocks (block 0 is the null page), got {num_blocks}"
            )
        if layout.block_size < 1 or layout.dtype is None:
            raise ValueError(f"a KV cache needs a block size and a dtype, got {layout}")
        check_kv_cache_dtype(layout.dtype, device)
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, *layout.block_shape)
        self.k = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.scales: KVScales | None = None  # FP8 only
        if layout.dtype == FP8_DTYPE:
            self.scales = KVScales(layout.num_layers, device)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def is_fp8(self) -> bool:
        return self.scales is not None

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def layer_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``([1], [1])`` float32 K and V scales of an FP8 cache's layer; None otherwise."""
        return None if self.scales is None else self.scales.layer(layer_id)

    def store(
        self,
        layer_id: int,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int, -1 skips the row
    ) -> None:
        """Write the layer's new K/V rows at their slots (FP8: quantized with the layer's
        scales, which the first store that writes non-zero rows calibrates)."""
        k_cache, v_cache = self.layer(layer_id)
        if self.scales is None:
            ops.store_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        k_scale, v_scale = self.scales.layer(layer_id)
        ops.store_kv_fp8(
            k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, self.scales.calibrated
        )

    def scales_to_wire(self) -> list[float]:
        """An FP8 cache's K then V scales for a hand-off's done message; [] otherwise."""
        return [] if self.scales is None else self.scales.to_wire()

    def receive_scales(self, wire: list[float], num_layers: int, slots: torch.Tensor) -> None:
        """Decode side of a hand-off into an FP8 cache: the sender's scales (``to_wire``)
        for the rows that arrived at ``slots`` of layers ``0 .. num_layers - 1``. A layer
        without a scale adopts the sender's (the bytes stay as sent); one calibrated to
        another scale has those rows requantized to its own. ValueError when ``wire`` does
        not fit this cache."""
        if self.scales is None:
            return
        if not wire:
            raise ValueError(
                "the prefill worker sent no FP8 KV scales: both workers need "
                "cache.kv_cache_dtype fp8_e4m3"
            )
        self.scales.receive(wire, self.k[:num_layers], self.v[:num_layers], slots)

    def null_page_is_zero(self) -> bool:
        return all(
            not t[NULL_BLOCK].view(torch.uint8).any().item()
            for pair in zip(self.k, self.v)
            for t in pair
        )
