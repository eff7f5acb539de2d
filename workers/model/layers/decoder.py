"""The blocks every model composes: rope attention and the pre-norm decoder layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.workers.attention.base import QKNormRope
from splitserve.workers.model.layers.attention import Attention
from splitserve.workers.model.layers.layernorm import AddNorm, RMSNorm
from splitserve.workers.model.layers.linear import Linear, QKVLinear
from splitserve.workers.model.layers.rotary_embedding import RotaryEmbedding
from splitserve.workers.runner.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from splitserve.workers.model.layers.mlp import GatedMLP
    from splitserve.workers.model.layers.moe import MoEBlock


class RopeAttention(nn.Module):
    """qkv -> per-head q/k norm (optional) -> rotary -> paged attention -> o_proj.

    With q/k norm, one fused op norms and rotates the strided q/k views of the
    qkv output (inside the attention kernel where the step's plan says so:
    ``QKNormRope``); ``q_norm`` / ``k_norm`` only hold the weights the checkpoint fills.
    """

    def __init__(
        self,
        layer_id: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_emb: RotaryEmbedding,  # shared by all layers (one cos/sin cache)
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = QKVLinear(hidden, num_heads, num_kv_heads, head_dim, qkv_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(layer_id, num_heads, num_kv_heads, head_dim)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=o_bias)

    def forward(
        self, positions: torch.Tensor, x: AddNorm, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``x``'s normed rows, and their residual sum. The add-norm runs in
        the qkv projection's kernel. Where attention norms q/k itself nothing runs
        between the two, and at one row the projection lets attention launch as it
        starts (``StepPlan.qkv_starts_attention``)."""
        starts_attention = self.q_norm is not None and forward_batch.plan.qkv_starts_attention
        qkv, residual = x.project(self.qkv_proj, next_starts_at_once=starts_attention)
        q, k, v = self.qkv_proj.split(qkv)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            q, k = self.rotary_emb(positions, q, k)
            return self.o_proj(self.attn(q, k, v, forward_batch)), residual
        qw, kw, rope = self.q_norm.weight, self.k_norm.weight, self.rotary_emb
        norm_rope = QKNormRope(positions, qw, kw, self.q_norm.eps, rope.cos, rope.sin)
        return self.o_proj(self.attn(q, k, v, forward_batch, norm_rope)), residual


class DecoderLayer(nn.Module):
    """Pre-norm block: norm, attention, norm, MLP, the residual stream beside the hidden
    state.

    Each norm adds the residual in and is handed, not yet run, to the block after it
    (``AddNorm``): the block's first projection computes it in its own kernel where it
    can (one kernel for a one-row decode), and so the block returns the new residual
    too. Which fusions a step takes is its plan's (``forward_batch.plan``,
    ``workers/runner/step_plan.py``). ``forward`` leaves the last add for the next
    layer's norm (or the final norm).
    """

    def __init__(
        self, self_attn: RopeAttention, mlp: GatedMLP | MoEBlock, hidden: int, rms_norm_eps: float
    ):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = AddNorm(self.input_layernorm, hidden, residual)
        hidden, residual = self.self_attn(positions, x, forward_batch)
        x = AddNorm(self.post_attention_layernorm, hidden, residual)
        hidden, residual = self.mlp(x, forward_batch.plan)
        return hidden, residual
