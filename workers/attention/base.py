"""The attention seam: every model calls attention through this interface.

``plan(forward_batch)`` runs once per step and prepares whatever the backend
needs (index tensors, masks, kernel plans); ``forward`` runs once per layer:
it stores the new K/V into the paged cache at ``slot_mapping`` and attends
the query rows over each request's paged KV. The CUDA-graph hooks let a graph
runner own static metadata buffers; backends that cannot run inside a graph
say so through ``supports_cuda_graphs``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from splitserve.workers.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend needs to know about one attention layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class AttentionBackend(ABC):
    name: str = "abstract"
    supports_cuda_graphs: bool = False

    @abstractmethod
    def plan(self, forward_batch: ForwardBatch) -> None:
        """Prepare per-step metadata; sets ``forward_batch.attn_metadata``."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer: AttentionSpec,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v for the new tokens and attend q over the paged KV."""

    # CUDA-graph hooks: called by the graph runners, never by models.
    def supports_decode_graphs(self, max_num_tokens: int, max_blocks_per_seq: int) -> bool:
        """Whether whole decode steps up to this size can be captured."""
        return self.supports_cuda_graphs

    def init_graph_buffers(self, max_num_tokens: int, max_blocks_per_seq: int) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot run in CUDA graphs")

    def prepare_capture(self, num_tokens: int, forward_batch: ForwardBatch) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot run in CUDA graphs")

    def prepare_replay(self, num_tokens: int, forward_batch: ForwardBatch) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot run in CUDA graphs")

    def clear_graphs(self) -> None:
        """Drop every per-graph buffer and plan (the graph owner is clearing its graphs)."""
