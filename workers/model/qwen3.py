"""Qwen3 (dense): Llama layout plus a per-head RMSNorm of q and k. Llama reuses it."""

from __future__ import annotations

from typing import Any

from torch import nn

from splitserve.workers.model.base import CausalLM
from splitserve.workers.model.layers.mlp import GatedMLP
from splitserve.workers.model.layers.moe import ExpertShard


def check_full_attention(config: Any) -> None:
    if getattr(config, "use_sliding_window", False) and "sliding_attention" in (
        getattr(config, "layer_types", None) or []
    ):
        raise ValueError(
            "sliding-window attention layers are not supported (use_sliding_window=true); "
            "only full attention is"
        )


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True

    def __init__(self, config: Any, expert_shard: ExpertShard | None = None):
        check_full_attention(config)
        super().__init__(config, expert_shard)

    def make_mlp(self, layer_id: int) -> nn.Module:
        c = self.config
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


class LlamaForCausalLM(Qwen3ForCausalLM):
    qk_norm = False

    def __init__(self, config: Any, expert_shard: ExpertShard | None = None):
        if getattr(config, "mlp_bias", False):
            raise ValueError("Llama with mlp_bias=true is not supported")
        super().__init__(config, expert_shard)
