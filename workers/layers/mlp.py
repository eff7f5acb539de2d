"""Gated MLP (SwiGLU): ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.kernels.ops import silu_and_mul_linear
from splitserve.workers.layers.layernorm import RMSNorm
from splitserve.workers.layers.linear import GateUpLinear, Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: silu")
        self.gate_up_proj = GateUpLinear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def forward_normed(
        self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(hidden + residual)), hidden + residual)``, the add-norm fused into
        the gate_up projection (``RMSNorm.project``)."""
        gate_up, residual = norm.project(hidden, residual, self.gate_up_proj)
        return self.down(gate_up), residual

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The down projection of ``silu(gate) * up``, the activation fused into it."""
        return silu_and_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias)
