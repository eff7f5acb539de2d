"""The blocks every model composes: rope attention and the pre-norm decoder layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.workers.attention.base import QKNormRope
from splitserve.workers.model.layers.attention import Attention
from splitserve.workers.model.layers.layernorm import RMSNorm
from splitserve.workers.model.layers.linear import Linear, QKVLinear
from splitserve.workers.model.layers.rotary_embedding import RotaryEmbedding
from splitserve.workers.runner.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from splitserve.workers.model.layers.mlp import GatedMLP
    from splitserve.workers.model.layers.moe import MoEBlock


class RopeAttention(nn.Module):
    """qkv -> per-head q/k norm (optional) -> rotary -> paged attention -> o_proj.

    With q/k norm, one fused op norms and rotates the strided q/k views of the
    qkv output (inside the attention kernel where the backend can:
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
        self, positions: torch.Tensor, x: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x), forward_batch)

    def attend(
        self,
        positions: torch.Tensor,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Everything after the qkv projection, from its ``(q, k, v)``."""
        q, k, v = qkv
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            q, k = self.rotary_emb(positions, q, k)
            return self.o_proj(self.attn(q, k, v, forward_batch))
        qw, kw, rope = self.q_norm.weight, self.k_norm.weight, self.rotary_emb
        norm_rope = QKNormRope(positions, qw, kw, self.q_norm.eps, rope.cos, rope.sin)
        return self.o_proj(self.attn(q, k, v, forward_batch, norm_rope))

    def attention_follows_qkv(self, forward_batch: ForwardBatch) -> bool:
        """Whether the attention kernel is the qkv projection's next: the backend norms and
        rotates q/k inside it. Then, at one request, split-KV attention loads KV before its
        wait, and the projection lets it launch at once (``next_starts_at_once``)."""
        return self.q_norm is not None and forward_batch.attn_backend.fuses_norm_rope(forward_batch)


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream travels beside the hidden state.

    ``forward`` returns ``(hidden, residual)`` with the last add left for the
    next layer's fused add-norm (or the final norm). Each add-norm goes with the
    projection after it (``RMSNorm.project``: one kernel for a one-row decode): the
    qkv projection's here, the MLP's in its ``forward_normed`` (a gated MLP fuses it
    into gate_up and its activation into down; an MoE block norms on its own).
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
        attn = self.self_attn
        early = attn.attention_follows_qkv(forward_batch)
        qkv, residual = self.input_layernorm.project(
            hidden, residual, attn.qkv_proj, next_starts_at_once=early
        )
        hidden = attn.attend(positions, attn.qkv_proj.split(qkv), forward_batch)
        return self.mlp.forward_normed(self.post_attention_layernorm, hidden, residual)
