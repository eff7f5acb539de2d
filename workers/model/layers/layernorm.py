"""RMSNorm with the residual add of a decoder layer fused in, and into the projection
that reads it where the kernels allow (``project``)."""

from __future__ import annotations

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

    def project(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        proj: nn.Module,
        next_starts_at_once: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(proj's matmul of norm(x + residual), x + residual)``; without ``residual``
        of x, and x. ``proj`` is a ``Linear`` or ``MergedLinear``: its raw output.
        ``next_starts_at_once``: see ``kernels.ops.rms_norm_linear``."""
        return rms_norm_linear(
            x, residual, self.weight, self.eps, proj.weight, proj.bias, next_starts_at_once
        )
