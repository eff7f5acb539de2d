"""Triton MoE routing; reference: ``splitserve.kernels.moe_routing``.

One program routes one token: the whole row of ``num_experts`` logits sits in
registers, and top-k is ``top_k`` rounds of "take the max, then remove it".
Ties go to the lowest expert index (``torch.topk`` leaves their order
unspecified, so the reference and the kernel agree whenever scores are
distinct). Both return ``(topk_weights float32 [num_tokens, top_k], topk_ids
int64 [num_tokens, top_k])`` with the experts in descending order of the
score that chose them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _take_max(remaining, index, BLOCK: tl.constexpr):
    """The max of ``remaining``, its lowest index, and ``remaining`` with it removed."""
    best = tl.max(remaining, axis=0)
    idx = tl.min(tl.where(remaining == best, index, BLOCK), axis=0)
    return best, idx, tl.where(index == idx, float("-inf"), remaining)


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(logits_ptr + token * stride_logits + experts, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    remaining = tl.where(valid, p, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for i in tl.static_range(TOP_K):
        best, idx, remaining = _take_max(remaining, experts, BLOCK_E)
        weights = tl.where(slots == i, best, weights)
        ids = tl.where(slots == i, idx.to(tl.int64), ids)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, ids, mask=slots < TOP_K)


@triton.jit
def _noaux_tc_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    group_size,
    stride_logits,
    routed_scaling_factor,
    TOP_K: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(logits_ptr + token * stride_logits + experts, mask=valid, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-x.to(tl.float32)))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    # group score = sum of the group's two best choice scores; [BLOCK_G, BLOCK_E] tile
    groups = tl.arange(0, BLOCK_G)
    in_group = (experts[None, :] // group_size) == groups[:, None]
    tile = tl.where(in_group, choice[None, :], float("-inf"))
    top1 = tl.max(tile, axis=1)
    first = tl.min(tl.where(tile == top1[:, None], experts[None, :], BLOCK_E), axis=1)
    top2 = tl.max(tl.where(experts[None, :] == first[:, None], float("-inf"), tile), axis=1)
    remaining = top1 + top2  # padded groups: -inf
    selected = groups < 0
    for _ in tl.static_range(TOPK_GROUP):
        _, g, remaining = _take_max(remaining, groups, BLOCK_G)
        selected = selected | (groups == g)
    allowed = tl.max((in_group & selected[:, None]).to(tl.int32), axis=0) > 0
    remaining = tl.where(allowed, choice, float("-inf"))

    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for i in tl.static_range(TOP_K):
        _, idx, remaining = _take_max(remaining, experts, BLOCK_E)
        weight = tl.sum(tl.where(experts == idx, scores, 0.0), axis=0)  # unbiased score
        weights = tl.where(slots == i, weight, weights)
        ids = tl.where(slots == i, idx.to(tl.int64), ids)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * routed_scaling_factor
    tl.store(weights_ptr + token * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, ids, mask=slots < TOP_K)


def softmax_topk(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over all experts, keep the top k."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    logits, weights, ids = _outputs(router_logits, top_k)
    if num_tokens:
        _softmax_topk_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=_num_warps(num_experts),
        )  # fmt: skip
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
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, grouped top-k, bias only for the choice."""
    num_tokens, num_experts = router_logits.shape
    _check_groups(num_experts, top_k, n_group, topk_group)
    logits, weights, ids = _outputs(router_logits, top_k)
    has_bias = correction_bias is not None
    if num_tokens:
        _noaux_tc_kernel[(num_tokens,)](
            logits, correction_bias.contiguous() if has_bias else logits, weights, ids,
            num_experts, num_experts // n_group, logits.stride(0), float(routed_scaling_factor),
            TOP_K=top_k, TOPK_GROUP=topk_group, HAS_BIAS=has_bias, RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_G=triton.next_power_of_2(n_group),
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=_num_warps(num_experts),
        )  # fmt: skip
    return weights, ids


def _check_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    if n_group < 1 or num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(
            f"num_experts={num_experts} must split into n_group={n_group} groups of >= 2 experts"
        )
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise ValueError(
            f"top_k={top_k} must be in [1, experts in the {topk_group} chosen groups="
            f"{topk_group * (num_experts // n_group)}]"
        )


def _outputs(router_logits: torch.Tensor, top_k: int):
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    num_tokens, device = logits.shape[0], logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    return logits, weights, ids


def _num_warps(num_experts: int) -> int:
    return 1 if num_experts <= 64 else 2 if num_experts <= 256 else 4
