"""MoE routing references: which experts each token goes to, and with what weight.

Both return ``(topk_weights float32 [num_tokens, top_k], topk_ids int64 [num_tokens, top_k])``.
"""

from __future__ import annotations

import torch


def softmax_topk(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over all experts, keep the top k."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def noaux_tc_topk(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    correction_bias: torch.Tensor | None,  # [num_experts]; None: choose by plain scores
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, grouped top-k, bias only for the choice.

    The experts split into ``n_group`` groups; a group's score is the sum of its
    two best (biased) scores; only the ``topk_group`` best groups compete for
    the ``top_k`` experts. The weights come from the unbiased scores.
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    grouped = choice.view(num_tokens, n_group, num_experts // n_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [num_tokens, n_group]
    group_ids = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
