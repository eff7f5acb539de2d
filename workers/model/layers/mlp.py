"""Gated MLP (SwiGLU): ``down(silu(gate(x)) * up(x))`` with gate and up fused.

Where the SiLU-and-mul runs is the step's plan's (``StepPlan.activation``): handed
to the down projection (on its loads for one row, a kernel of its own before it
otherwise), or in the gate_up projection's epilogue."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.kernels.ops import linear_silu_and_mul, silu_and_mul_linear
from splitserve.workers.model.layers.layernorm import AddNorm
from splitserve.workers.model.layers.linear import GateUpLinear, Linear
from splitserve.workers.runner.step_plan import Activation, StepPlan


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: silu")
        self.gate_up_proj = GateUpLinear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: AddNorm, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of ``x``'s normed rows, and their residual sum. The add-norm runs in the
        gate_up projection's kernel, unless the SiLU-and-mul does (that kernel cannot
        take both) and it runs alone."""
        if plan.activation is Activation.IN_GATE_UP:
            normed, residual = x.apply()
            return self.on_normed(normed, plan), residual
        gate_up, residual = x.project(self.gate_up_proj)
        return self.down(gate_up), residual

    def on_normed(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The MLP of rows already normed (an MoE block's shared experts)."""
        if plan.activation is Activation.IN_GATE_UP:
            gate_up = self.gate_up_proj
            return self.down_proj(linear_silu_and_mul(x, gate_up.weight, gate_up.bias))
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The down projection of ``silu(gate) * up``, the activation handed to it."""
        return silu_and_mul_linear(gate_up, self.down_proj.weight, self.down_proj.bias)
