"""The one description of a paged KV cache's shape.

A model states what it needs (layers, KV heads, head size); the engine adds
how it is stored (block size, dtype); the cache allocates it, the attention
backends read it, and a KV hand-off ticket carries it so that the two sides
can check that they agree. Per layer the cache is K and V of
``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int  # decoder layers + MTP layers; attention layer ids are 0..num_layers-1
    num_kv_heads: int
    head_dim: int
    block_size: int = 0  # tokens a block; 0 until the engine chooses
    dtype: torch.dtype | None = None  # None until the engine chooses

    def with_storage(self, block_size: int, dtype: torch.dtype) -> KVLayout:
        """This layout stored in blocks of ``block_size`` tokens of ``dtype``."""
        return dataclasses.replace(self, block_size=block_size, dtype=dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(block_size, num_kv_heads, head_dim)``: one block of one layer's K (or V)."""
        return self.block_size, self.num_kv_heads, self.head_dim

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def bytes_per_token(self, num_layers: int | None = None) -> int:
        """K and V of one token over ``num_layers`` layers (all of them by default)."""
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * self.element_size

    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token()

    def check_matches(self, other: KVLayout) -> None:
        """Raise ValueError naming every field where a sender's layout (self) and a
        receiver's disagree. Block sizes may differ: the KV travels token by token."""
        diffs = [
            f"{name}: sender {getattr(self, name)!r}, receiver {getattr(other, name)!r}"
            for name in ("num_kv_heads", "head_dim", "dtype")
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            hint = ""
            if self.dtype != other.dtype:
                hint = " (both workers need the same dtype and cache.kv_cache_dtype)"
            raise ValueError("KV layouts of the two workers differ: " + "; ".join(diffs) + hint)

    def to_wire(self) -> dict[str, Any]:
        """Plain fields for msgpack: the dtype by name (``"bfloat16"``)."""
        fields = dataclasses.asdict(self)
        fields["dtype"] = str(self.dtype).removeprefix("torch.") if self.dtype else None
        return fields

    @classmethod
    def from_wire(cls, fields: dict[str, Any]) -> KVLayout:
        dtype = fields.get("dtype")
        if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown KV dtype {dtype!r} in a KV layout")
        return cls(**{**fields, "dtype": getattr(torch, dtype) if dtype else None})
