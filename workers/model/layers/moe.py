"""Mixture-of-experts block: a router, stacked experts, optional shared experts.

Experts are stacked into ``w13 [E, 2I, H]`` (gate rows, then up rows) and
``w2 [E, H, I]``; checkpoints carry them per expert
(``experts.{e}.gate_proj.weight``, ...) or already stacked (transformers 5's
``experts.gate_up_proj`` / ``experts.down_proj``).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.kernels.ops import fused_moe, noaux_tc_topk, softmax_topk
from splitserve.workers.model.layers.layernorm import AddNorm
from splitserve.workers.model.layers.mlp import GatedMLP
from splitserve.workers.runner.step_plan import StepPlan

W13_SHARDS = {"w1": 0, "w3": 1}  # gate_proj, up_proj


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE: softmax over experts, top-k, optionally renormalized."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(x @ self.weight.t(), self.top_k, self.renormalize)


class GroupedTopKRouter(nn.Module):
    """GLM-4.5 / DeepSeek-V3 ``noaux_tc``: sigmoid scores, grouped top-k, correction bias.

    ``e_score_correction_bias`` is a float32 buffer; the loader sets it to None
    when the checkpoint has none (plain scores choose the experts).
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        renormalize: bool,
        routed_scaling_factor: float,
    ):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(
                f"n_routed_experts={num_experts} is not a multiple of n_group={n_group}"
            )
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias: torch.Tensor | None
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x.float() @ self.weight.float().t()
        return noaux_tc_topk(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.renormalize,
            self.routed_scaling_factor,
        )


class Experts(nn.Module):
    """Routed experts stacked: ``w13_weight [E, 2I, H]`` (gate | up), ``w2_weight [E, H, I]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[str, int | None]
    ) -> None:
        """``shard_id``: ``("w1" | "w3" | "w2", expert)`` or ``(name, None)`` for all experts."""
        name, expert = shard_id
        target = param.data if expert is None else param.data[expert]
        if name in W13_SHARDS:
            n = self.intermediate
            target = target[..., W13_SHARDS[name] * n : (W13_SHARDS[name] + 1) * n, :]
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert shard {shard_id} has shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class MoEBlock(nn.Module):
    """``experts(x, gate(x)) + shared_experts(x)``; names follow the HF checkpoints."""

    def __init__(
        self,
        gate: nn.Module,
        num_experts: int,
        hidden: int,
        intermediate: int,
        shared_intermediate: int = 0,  # 0: no shared experts
    ):
        super().__init__()
        self.gate = gate
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_experts = GatedMLP(hidden, shared_intermediate) if shared_intermediate else None

    def forward(self, x: AddNorm, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on ``x``'s normed rows, and their residual sum: the router and the
        experts all read the normed rows, so the add-norm runs on its own."""
        normed, residual = x.apply()
        return self.on_normed(normed, plan), residual

    def on_normed(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The block on rows already normed."""
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts.on_normed(x, plan)
        return out
