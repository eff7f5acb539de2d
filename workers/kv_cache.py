"""Paged KV cache: per layer, one K and one V tensor of fixed-size blocks.

Layout (NHD): ``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's
slot is ``block_id * block_size + offset``. Block 0 is the null page: the
block manager never hands it out and it stays zero, so padded rows of a
block table (and of a CUDA graph) can point at it without touching live KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_BLOCK = 0


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str):
        if num_blocks < 2:
            raise ValueError(
                f"KV cache needs at least 2 blocks (block 0 is the null page), got {num_blocks}"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def null_page_is_zero(self) -> bool:
        return all(not t[NULL_BLOCK].any().item() for pair in zip(self.k, self.v) for t in pair)
