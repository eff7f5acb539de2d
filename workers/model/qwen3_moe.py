"""Qwen3-MoE: Qwen3 attention; sparse layers route each token to top-k of ``num_experts``.

Layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; the dense ones use ``intermediate_size``.
"""

from __future__ import annotations

from torch import nn

from splitserve.workers.model.layers.mlp import GatedMLP
from splitserve.workers.model.layers.moe import MoEBlock, SoftmaxRouter
from splitserve.workers.model.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def is_sparse(self, layer_id: int) -> bool:
        c = self.config
        return (
            layer_id not in (c.mlp_only_layers or [])
            and c.num_experts > 0
            and (layer_id + 1) % c.decoder_sparse_step == 0
        )

    def make_mlp(self, layer_id: int) -> nn.Module:
        c = self.config
        if not self.is_sparse(layer_id):
            return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        gate = SoftmaxRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)
        return MoEBlock(
            gate, c.num_experts, c.hidden_size, c.moe_intermediate_size, shard=self.expert_shard
        )
