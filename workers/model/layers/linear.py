"""Linear layers whose one weight is filled from several checkpoint tensors.

Every fused parameter carries ``weight_loader(param, loaded_weight, shard_id)``;
the model's weight map (``workers/model/weights.py``) says which checkpoint
tensor is which shard. The matmul is ``kernels.ops.linear``: ``F.linear`` on
CPU, on CUDA a weight-streaming Triton kernel for decode-sized batches.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.kernels.ops import linear


class Linear(nn.Module):
    """``y = x W^T + b`` with uninitialized parameters: the checkpoint fills them."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(nn.Module):
    """One ``[sum(output_sizes), input_size]`` matmul standing for several projections."""

    def __init__(self, input_size: int, output_sizes: dict[str | int, int], bias: bool = False):
        super().__init__()
        self.offsets: dict[str | int, tuple[int, int]] = {}
        start = 0
        for shard_id, size in output_sizes.items():
            self.offsets[shard_id] = (start, size)
            start += size
        self.weight = nn.Parameter(torch.empty(start, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(start)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int) -> None:
        start, size = self.offsets[shard_id]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard_id!r} has {loaded.shape[0]} rows, expected {size}")
        param.data[start : start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class QKVLinear(MergedLinear):
    """Fused q/k/v projection: shards ``"q"``, ``"k"``, ``"v"``."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool):
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden, {"q": q, "k": kv, "v": kv}, bias)
        self.sizes = (q, kv, kv)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.split(super().forward(x))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` views of the fused projection's output."""
        return qkv.split(self.sizes, dim=-1)


class GateUpLinear(MergedLinear):
    """Fused gate/up projection of a gated MLP: shards ``0`` (gate) and ``1`` (up)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, {0: intermediate, 1: intermediate}, bias=False)
