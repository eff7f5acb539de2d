"""HF architecture name (``config.json: architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from splitserve.workers.model.glm4_moe import Glm4MoeForCausalLM
from splitserve.workers.model.qwen3 import LlamaForCausalLM, Qwen3ForCausalLM
from splitserve.workers.model.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The first supported architecture of the list."""
    for arch in architectures or []:
        if arch in MODELS:
            return MODELS[arch]
    name = ", ".join(architectures or []) or "<none: config.json has no architectures>"
    raise ValueError(f"unknown architecture '{name}'; supported: {', '.join(MODELS)}")
