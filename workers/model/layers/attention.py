"""The attention call inside a model: hands q/k/v to the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.workers.attention.base import AttentionSpec, QKNormRope
from splitserve.workers.runner.forward_batch import ForwardBatch


class Attention(nn.Module):
    """Paged attention over the KV cache; the backend comes with the batch."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.spec = AttentionSpec(layer_id, num_heads, head_dim**-0.5)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        norm_rope: QKNormRope | None = None,
    ) -> torch.Tensor:
        """Attention of q over the paged KV with k and v stored; with ``norm_rope``, q and k
        are normed and rotated first (by the backend's kernel where the step's plan says
        it does: ``StepPlan.attention_norms_qk``)."""
        s, backend = self.spec, forward_batch.attn_backend
        q = q.reshape(-1, s.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if norm_rope is not None and not forward_batch.plan.attention_norms_qk:
            q, k = norm_rope(q, k)
            norm_rope = None
        out = backend.forward(q, k, v, s, forward_batch, norm_rope)
        if forward_batch.on_layer_stored is not None:
            forward_batch.on_layer_stored(s.layer_id)
        return out.reshape(-1, s.num_heads * self.head_dim)
