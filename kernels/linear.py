"""Linear layer reference: ``y = x W^T + b``.

``weight`` is ``[N, K]`` row-major, as ``nn.Linear`` keeps it; ``x`` is
``[..., K]`` and ``y`` is ``[..., N]`` in ``x``'s dtype; ``bias`` is ``[N]`` or
None. This is ``torch.nn.functional.linear`` (cuBLAS on CUDA), the CPU path of
``ops.linear`` and the fallback of the Triton kernel for large batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., K]``, ``weight [N, K]``, ``bias [N]``."""
    return F.linear(x, weight, bias)
