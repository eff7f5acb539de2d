"""Top-k / top-p sampling from probabilities: reference.

The kept set follows the engine's sampler (``workers.sampler.filter_logits``):
top-k first (``top_k`` 0 or >= vocab: off), then top-p over the renormalized
top-k distribution: the smallest head of tokens, in descending probability,
whose mass reaches ``top_p`` (1.0: off). The most probable token always stays.
A token is then drawn from the kept probabilities, renormalized, by an
exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` per token.
"""

from __future__ import annotations

import torch


def top_k_top_p_mask(
    probs: torch.Tensor,  # [batch, vocab], rows sum to 1
    top_k: torch.Tensor,  # [batch] int; 0 or >= vocab: off
    top_p: torch.Tensor,  # [batch] float in (0, 1]; 1.0: off
) -> torch.Tensor:  # [batch, vocab] bool
    """True for the tokens that survive top-k, then top-p."""
    vocab = probs.shape[1]
    sorted_probs, order = probs.float().sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    keep = rank[None, :] < k[:, None]
    kept = sorted_probs * keep
    mass_before = kept.cumsum(dim=-1) - kept  # exclusive: 0 at rank 0
    in_head = mass_before < top_p[:, None].float() * kept.sum(dim=-1, keepdim=True)
    keep &= in_head | (top_p[:, None] >= 1.0)
    keep[:, 0] = True
    return torch.empty_like(keep).scatter_(1, order, keep)


def top_k_top_p_sample(
    probs: torch.Tensor,  # [batch, vocab]
    top_k: torch.Tensor,  # [batch] int
    top_p: torch.Tensor,  # [batch] float
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [batch] int64
    """One token per row from the kept set, with probability proportional to ``probs``."""
    kept = probs.float() * top_k_top_p_mask(probs, top_k, top_p)
    q = torch.empty_like(kept).exponential_(generator=generator)
    return (kept / q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)
