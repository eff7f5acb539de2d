"""Gated MLP (SwiGLU): ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.kernels.ops import silu_and_mul
from splitserve.workers.layers.linear import GateUpLinear, Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: silu")
        self.gate_up_proj = GateUpLinear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
