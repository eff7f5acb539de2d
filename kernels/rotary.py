"""Rotary position embedding reference (neox style: the two halves rotate together)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, rotary_dim] (each frequency twice: neox layout)
    sin: torch.Tensor,  # [num_tokens, rotary_dim]
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of every head; the rest pass through.

    ``rotary_dim < head_dim`` is partial rotary (GLM-4.5 rotates half of each head).
    """
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = (x_rot.float() * cos + rotate_half(x_rot.float()) * sin).to(x.dtype)
    return torch.cat((rotated, x_pass), dim=-1)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_position, rotary_dim] (neox layout)
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the cache rows of ``positions``."""
    cos, sin = cos_cache[positions], sin_cache[positions]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
