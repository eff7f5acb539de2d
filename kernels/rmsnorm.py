"""RMSNorm reference, optionally fused with the residual add of a decoder layer."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)``, computed in float32.

    With ``residual``, first forms ``x + residual`` and returns
    ``(rms_norm(x + residual), x + residual)``: the normed input of the next
    sub-block and the new residual stream.
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)
