"""Rotary position embedding with a precomputed cos/sin cache (float32, per position).

``get_rope`` reads the HF config: transformers 5 keeps ``rope_theta``,
``rope_type`` and ``partial_rotary_factor`` in ``config.rope_parameters``;
older configs have top-level ``rope_theta`` / ``partial_rotary_factor`` /
``rope_scaling``. Static scaling types (linear, llama3, yarn) reuse
transformers' inverse-frequency functions; types that depend on the sequence
length (dynamic, longrope) are refused.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from splitserve.kernels.ops import rotary_embedding

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,  # [rotary_dim // 2]
        attention_scaling: float = 1.0,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float().to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = nn.Buffer(emb.cos() * attention_scaling, persistent=False)
        self.sin = nn.Buffer(emb.sin() * attention_scaling, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(positions, q, k, self.cos, self.sin)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of either config generation, as one dict."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = dict(getattr(config, "rope_scaling", None) or {})
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in params and getattr(config, key, None) is not None:
            params[key] = getattr(config, key)
    params.setdefault("rope_theta", 10000.0)
    params.setdefault("partial_rotary_factor", 1.0)
    return params


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    rotary_dim = int(head_dim * params["partial_rotary_factor"])
    if rope_type == "default":
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
    elif rope_type in STATIC_ROPE_TYPES:
        inv_freq, scaling = _transformers_inv_freq(config, params, head_dim)
    else:
        supported = ", ".join(STATIC_ROPE_TYPES)
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {supported}")
    return RotaryEmbedding(head_dim, rotary_dim, config.max_position_embeddings, inv_freq, scaling)


def _transformers_inv_freq(
    config: Any, params: dict[str, Any], head_dim: int
) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = copy.deepcopy(config)  # never touch the caller's config
    config.rope_parameters = params
    if getattr(config, "head_dim", None) is None:
        config.head_dim = head_dim
    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return inv_freq, float(scaling)
