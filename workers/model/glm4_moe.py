"""GLM-4.5 (``Glm4MoeForCausalLM``): dense first layers, then MoE with sigmoid ``noaux_tc``
routing and shared experts; partial rotary, optional qk-norm, q/k/v bias; one MTP layer.

The MTP (next-token prediction) layer sits in the checkpoint at
``model.layers.{num_hidden_layers}`` and is loaded into ``self.mtp``; its
attention uses KV layer ``num_hidden_layers``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from splitserve.workers.model.base import CausalLM
from splitserve.workers.model.layers.decoder import DecoderLayer
from splitserve.workers.model.layers.embedding import LMHead, VocabEmbedding
from splitserve.workers.model.layers.layernorm import RMSNorm
from splitserve.workers.model.layers.linear import Linear
from splitserve.workers.model.layers.mlp import GatedMLP
from splitserve.workers.model.layers.moe import ExpertShard, GroupedTopKRouter, MoEBlock
from splitserve.workers.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = LMHead(vocab_size, hidden)


class MTPLayer(DecoderLayer):
    """A decoder layer fed ``eh_proj(enorm(embed(next tokens)) ‖ hnorm(previous hidden))``."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module):
        h, eps = config.hidden_size, config.rms_norm_eps
        super().__init__(self_attn, mlp, h, eps)
        self.embed_tokens = VocabEmbedding(config.vocab_size, h)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h)
        self.shared_head = SharedHead(h, config.vocab_size, eps)

    def forward_mtp(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        embeds = torch.where(positions[:, None] == 0, 0, embeds)  # as vLLM: nothing precedes 0
        x = torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1)
        hidden, residual = self(positions, self.eh_proj(x), None, forward_batch)
        return self.shared_head.norm(hidden, residual)[0]


class Glm4MoeForCausalLM(CausalLM):
    o_proj_bias = False

    def __init__(self, config: Any, expert_shard: ExpertShard | None = None):
        super().__init__(config, expert_shard)
        n = config.num_hidden_layers
        self.mtp: MTPLayer | None = None
        if (getattr(config, "num_nextn_predict_layers", 0) or 0) >= 1:
            attn = self.make_attention(n, self.model.rotary_emb)
            self.mtp = MTPLayer(config, attn, self.make_mlp(n))
        self.mtp_prefix = f"model.layers.{n}."  # where the checkpoint keeps the MTP layer

    def make_mlp(self, layer_id: int) -> nn.Module:
        c = self.config
        if layer_id < c.first_k_dense_replace:
            return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        gate = GroupedTopKRouter(
            c.hidden_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        shared = c.moe_intermediate_size * c.n_shared_experts
        return MoEBlock(
            gate,
            c.n_routed_experts,
            c.hidden_size,
            c.moe_intermediate_size,
            shared,
            shard=self.expert_shard,
        )

    @property
    def num_kv_layers(self) -> int:
        return self.config.num_hidden_layers + (self.mtp is not None)

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """MTP hidden states (after ``shared_head.norm``); logits: ``mtp_compute_logits``."""
        if self.mtp is None:
            raise ValueError(
                "this model has no MTP layer (num_nextn_predict_layers=0 or none loaded)"
            )
        return self.mtp.forward_mtp(input_ids, positions, previous_hidden, forward_batch)

    def mtp_compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.shared_head.head(hidden)

    # ---- weights: the MTP layer is model.layers.{N} in the checkpoint, mtp.* here
    def checkpoint_to_model(self, name: str) -> str | None:
        name = super().checkpoint_to_model(name)
        if name is not None and self.mtp is not None and name.startswith(self.mtp_prefix):
            return "mtp." + name.removeprefix(self.mtp_prefix)
        return name

    def model_to_checkpoint(self, name: str) -> str:
        return self.mtp_prefix + name.removeprefix("mtp.") if name.startswith("mtp.") else name

    def is_optional(self, param_name: str) -> bool:
        return param_name.endswith(".e_score_correction_bias") or param_name.startswith("mtp.")

    def finish_loading(self, taken: set[str]) -> None:
        for name, module in self.named_modules():
            bias = self.model_to_checkpoint(f"{name}.e_score_correction_bias")
            if isinstance(module, GroupedTopKRouter) and bias not in taken:
                module.e_score_correction_bias = None  # plain sigmoid scores choose
        if self.mtp is None:
            return
        mtp_names = self.checkpoint_names(
            lambda name: name.startswith("mtp.") and not name.endswith(".e_score_correction_bias")
        )
        if not mtp_names & taken:
            logger.warning(
                "checkpoint has no MTP layer at model.layers.%d: MTP disabled",
                self.config.num_hidden_layers,
            )
            self.mtp = None
        elif missing := sorted(mtp_names - taken):
            raise ValueError(
                f"checkpoint has an incomplete MTP layer: missing {len(missing)} weights, "
                f"e.g. {', '.join(missing[:5])}"
            )
