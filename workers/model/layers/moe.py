"""Mixture-of-experts block: a router, stacked experts, optional shared experts.

Experts are stacked into ``w13 [E, 2I, H]`` (gate rows, then up rows) and
``w2 [E, H, I]``; checkpoints carry them per expert
(``experts.{e}.gate_proj.weight``, ...) or already stacked (transformers 5's
``experts.gate_up_proj`` / ``experts.down_proj``).

Under expert parallelism (``workers/parallel``) a rank holds only its shard of the
routed experts (``ExpertShard``), and the experts send each token to the ranks that
hold its choices and sum what comes back (``Dispatcher``: dispatch, the local
experts, combine), in the mode the step's plan says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.kernels.ops import ep_count_choices, fused_moe, noaux_tc_topk, softmax_topk
from splitserve.workers.model.layers.layernorm import AddNorm
from splitserve.workers.model.layers.mlp import GatedMLP
from splitserve.workers.runner.step_plan import StepPlan

if TYPE_CHECKING:
    from splitserve.workers.parallel.dispatch import Dispatcher

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


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts one expert-parallel rank holds: ``first .. first + count - 1``
    of ``total``."""

    first: int
    count: int
    total: int

    @classmethod
    def whole(cls, num_experts: int) -> ExpertShard:
        return cls(0, num_experts, num_experts)

    @property
    def ids(self) -> range:
        return range(self.first, self.first + self.count)


class Experts(nn.Module):
    """Routed experts stacked: ``w13_weight [E, 2I, H]`` (gate | up), ``w2_weight [E, H, I]``.

    With a ``shard`` only its experts are allocated and loaded (``E`` = its count);
    ``dispatcher`` (set when the rank joins its group) moves the tokens to them.
    ``tokens_per_expert`` counts the (token, expert) pairs each local expert computed.
    """

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, shard: ExpertShard | None = None
    ):
        super().__init__()
        self.shard = shard or ExpertShard.whole(num_experts)
        self.num_experts, self.intermediate = self.shard.count, intermediate
        self.w13_weight = nn.Parameter(torch.empty(self.shard.count, 2 * intermediate, hidden))
        self.w2_weight = nn.Parameter(torch.empty(self.shard.count, hidden, intermediate))
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
            param.expert_shard = self.shard
        self.dispatcher: Dispatcher | None = None
        self.register_buffer(
            "tokens_per_expert", torch.zeros(self.shard.count, dtype=torch.long), persistent=False
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[str, int | None]
    ) -> None:
        """``shard_id``: ``("w1" | "w3" | "w2", expert)`` or ``(name, None)`` for all experts;
        experts outside this rank's shard are skipped."""
        name, expert = shard_id
        if expert is None:
            target = param.data
            if loaded.shape[0] == self.shard.total:
                loaded = loaded[self.shard.first : self.shard.first + self.shard.count]
        elif expert in self.shard.ids:
            target = param.data[expert - self.shard.first]
        else:
            return
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
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        plan: StepPlan | None = None,  # expert parallelism: its moe_dispatch
    ) -> torch.Tensor:
        if self.dispatcher is None:
            return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        dispatch = plan.moe_dispatch if plan is not None else None
        here = self.dispatcher.dispatch(x, topk_weights, topk_ids, dispatch)
        self.count_tokens(here.topk_ids)
        w13, w2, part = self.w13_weight, self.w2_weight, self.dispatcher.part_dtype
        out = fused_moe(
            here.hidden, w13, w2, here.topk_weights, here.topk_ids,
            skip_negative_ids=True, out_dtype=part,
        )  # fmt: skip
        return self.dispatcher.combine(out, here)

    def count_tokens(self, local_ids: torch.Tensor) -> None:
        """Add the pairs each local expert got (id -1: none); no host sync."""
        ep_count_choices(self.tokens_per_expert, local_ids)


class MoEBlock(nn.Module):
    """``experts(x, gate(x)) + shared_experts(x)``; names follow the HF checkpoints."""

    def __init__(
        self,
        gate: nn.Module,
        num_experts: int,
        hidden: int,
        intermediate: int,
        shared_intermediate: int = 0,  # 0: no shared experts
        shard: ExpertShard | None = None,  # expert parallelism: this rank's routed experts
    ):
        super().__init__()
        self.gate = gate
        self.experts = Experts(num_experts, hidden, intermediate, shard)
        self.shared_experts = GatedMLP(hidden, shared_intermediate) if shared_intermediate else None

    def forward(self, x: AddNorm, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on ``x``'s normed rows, and their residual sum: the router and the
        experts all read the normed rows, so the add-norm runs on its own."""
        normed, residual = x.apply()
        return self.on_normed(normed, plan), residual

    def on_normed(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The block on rows already normed."""
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids, plan)
        if self.shared_experts is not None:
            out = out + self.shared_experts.on_normed(x, plan)
        return out
