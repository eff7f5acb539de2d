"""Paged KV cache: per layer, one K and one V tensor of fixed-size blocks.

Layout (NHD): ``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's
slot is ``block_id * block_size + offset``. Block 0 is the null page: the
block manager never hands it out and it stays zero, so padded rows of a
block table (and of a CUDA graph) can point at it without touching live KV.
"""

from __future__ import annotations

import torch

from splitserve.scheduler.block_manager import NULL_BLOCK
from splitserve.workers.kv.layout import KVLayout


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str):
        if num_blocks < 2:
            raise ValueError(
                f"KV cache needs at least 2 blocks (block 0 is the null page), got {num_blocks}"
            )
        if layout.block_size < 1 or layout.dtype is None:
            raise ValueError(f"a KV cache needs a block size and a dtype, got {layout}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, *layout.block_shape)
        self.k = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def null_page_is_zero(self) -> bool:
        return all(not t[NULL_BLOCK].any().item() for pair in zip(self.k, self.v) for t in pair)
