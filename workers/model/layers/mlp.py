"""Gated MLP (SwiGLU): ``down(silu(gate(x)) * up(x))`` with gate and up fused.

Where the SiLU-and-mul runs depends on the rows (``kernels.ops``): in the gate_up
projection's epilogue for a decode batch of 17 to 64 rows
(``activation_in_gate_up``), on the down projection's loads for one row, as a kernel
of its own otherwise."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.kernels.ops import activation_in_gate_up, linear_silu_and_mul, silu_and_mul_linear
from splitserve.workers.model.layers.layernorm import RMSNorm
from splitserve.workers.model.layers.linear import GateUpLinear, Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: silu")
        self.gate_up_proj = GateUpLinear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._activation_in_gate_up(x):
            return self._fused_gate_up_down(x)
        return self.down(self.gate_up_proj(x))

    def forward_normed(
        self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(hidden + residual)), hidden + residual)``, the add-norm fused into
        the gate_up projection (``RMSNorm.project``) unless the activation is."""
        if self._activation_in_gate_up(hidden):
            normed, residual = norm(hidden, residual)
            return self._fused_gate_up_down(normed), residual
        gate_up, residual = norm.project(hidden, residual, self.gate_up_proj)
        return self.down(gate_up), residual

    def _activation_in_gate_up(self, x: torch.Tensor) -> bool:
        return activation_in_gate_up(x, self.gate_up_proj.weight, self.gate_up_proj.bias)

    def _fused_gate_up_down(self, x: torch.Tensor) -> torch.Tensor:
        """The down projection of gate_up with the SiLU-and-mul in its epilogue."""
        act = linear_silu_and_mul(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return self.down_proj(act)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The down projection of ``silu(gate) * up``, the activation fused into it."""
        return silu_and_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias)
