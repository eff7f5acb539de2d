"""Linear layer reference: ``y = x W^T + b``.

``weight`` is ``[N, K]`` row-major, as ``nn.Linear`` keeps it; ``x`` is
``[..., K]`` and ``y`` is ``[..., N]`` in ``x``'s dtype; ``bias`` is ``[N]`` or
None. This is ``torch.nn.functional.linear`` (cuBLAS on CUDA), the CPU path of
``ops.linear`` and the fallback of the Triton kernel for large batches.

``silu_and_mul_linear`` and ``rms_norm_linear`` are the compositions that the
Triton kernel fuses for few rows: a gated MLP's activation into its down
projection, a decoder layer's add-norm into the projection after it.
``linear_silu_and_mul`` is the activation fused into the gate_up projection
instead (``triton/gate_up_silu.py``, for decode batches of 17 to 64 rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.kernels.activation import silu_and_mul
from splitserve.kernels.rmsnorm import rms_norm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., K]``, ``weight [N, K]``, ``bias [N]``."""
    return F.linear(x, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight, bias)`` for ``x [..., 2K]`` (gate | up)."""
    return linear(silu_and_mul(x), weight, bias)


def linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight, bias))`` for a gate | up ``weight [2D, K]``."""
    return silu_and_mul(linear(x, weight, bias))


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual)), x + residual)``; without ``residual`` of x, and x."""
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight, bias), residual
