"""Per-head q/k RMSNorm then rotary (Qwen3, GLM-4.5 with ``use_qk_norm``) reference.

Defined as the composition of the two references, so it rounds as they do:
the normed row to the input dtype, its product with the weight to the output
dtype, then the rotation in float32 rounded once. Attention without q/k norm
(Llama) calls ``rotary_embedding`` alone.
"""

from __future__ import annotations

import torch

from splitserve.kernels.rmsnorm import rms_norm
from splitserve.kernels.rotary import rotary_embedding


def qk_norm_rope(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
    cos_cache: torch.Tensor,  # [max_position, rotary_dim] float32 (neox layout)
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding(positions, rms_norm(q), rms_norm(k), cos_cache, sin_cache)``."""
    q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return rotary_embedding(positions, q, k, cos_cache, sin_cache)
