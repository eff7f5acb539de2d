"""Fused MoE reference: every token through its top-k experts, weighted and summed.

An expert id of -1 is a choice that is not computed here (an expert-parallel rank
receives a token with its other ranks' choices blanked out): it adds nothing.
"""

from __future__ import annotations

import torch

from splitserve.kernels.activation import silu_and_mul


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]; -1: skipped
    skip_negative_ids: bool = False,  # the reference always skips them
    out_dtype: torch.dtype | None = None,  # the sum's dtype (None: the hidden states')
) -> torch.Tensor:  # [num_tokens, hidden]
    """Loop over the experts that received tokens (one host sync for the expert list)."""
    out = torch.zeros(hidden.shape, dtype=out_dtype or hidden.dtype, device=hidden.device)
    for expert in topk_ids.unique().tolist():
        if expert < 0:
            continue
        token_idx, slot = torch.where(topk_ids == expert)
        x = silu_and_mul(hidden[token_idx] @ w13[expert].t())
        y = (x @ w2[expert].t()) * topk_weights[token_idx, slot, None].to(hidden.dtype)
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
