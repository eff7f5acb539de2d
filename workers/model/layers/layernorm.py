"""RMSNorm, and a decoder layer's add-norm handed to the block after it (``AddNorm``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitserve.kernels.ops import rms_norm, rms_norm_linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        return rms_norm(x, self.weight, self.eps, residual)


@dataclass(frozen=True, slots=True)
class AddNorm:
    """``norm(x + residual)`` and the sum ``x + residual`` (without a residual: of x, and
    x), not computed yet: a decoder layer hands its norm to the block after it, whose
    first projection can compute it in its own kernel (``project``)."""

    norm: RMSNorm
    x: torch.Tensor
    residual: torch.Tensor | None

    def apply(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed rows, sum)`` from the norm's own kernel."""
        if self.residual is None:
            return self.norm(self.x), self.x
        return self.norm(self.x, self.residual)

    def project(
        self, proj: nn.Module, next_starts_at_once: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(proj's matmul of the normed rows, sum)``: one kernel for one row
        (``ops.rms_norm_linear``). ``proj`` is a ``Linear`` or ``MergedLinear`` (its raw
        output). ``next_starts_at_once``: let the next kernel launch as that kernel starts
        (``StepPlan.qkv_starts_attention``)."""
        n = self.norm
        return rms_norm_linear(
            self.x, self.residual, n.weight, n.eps, proj.weight, proj.bias, next_starts_at_once
        )
