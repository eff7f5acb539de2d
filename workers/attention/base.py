"""The attention seam: every model calls attention through this interface.

``plan(forward_batch)`` runs once per step and prepares whatever the backend
needs (index tensors, masks, kernel plans); ``kernel(forward_batch)`` then says
what the planned attention does beyond attending (``AttentionKernel``), which the
runner folds into the step's plan once; ``forward`` runs once per layer: it
stores the new K/V into the paged cache at ``slot_mapping`` and attends the
query rows over each request's paged KV. The CUDA-graph hooks let a graph
runner own static metadata buffers; backends that cannot run inside a graph
say so through ``supports_cuda_graphs``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from splitserve.kernels.ops import qk_norm_rope
from splitserve.workers.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend needs to know about one attention layer beyond the KV cache's
    layout (``KVLayout``, on ``forward_batch.kv_cache``): which layer, its query heads
    and its softmax scale."""

    layer_id: int
    num_heads: int
    scale: float


@dataclass(frozen=True)
class QKNormRope:
    """Per-head q/k RMSNorm then rotary (Qwen3): what the layer does to q and k before
    attention. ``Attention`` applies it unless the backend does it inside its kernel."""

    positions: torch.Tensor  # [num_tokens]
    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor
    eps: float
    cos: torch.Tensor  # [max_position, rotary_dim] float32
    sin: torch.Tensor

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qk_norm_rope(self.positions, q, k, *self.kernel_args()[1:])

    def kernel_args(self) -> tuple:
        """``(positions, q_weight, k_weight, eps, cos, sin)``, as the kernels take them."""
        return self.positions, self.q_weight, self.k_weight, self.eps, self.cos, self.sin


@dataclass(frozen=True)
class AttentionKernel:
    """What a backend's attention does in a planned step besides attending
    (``AttentionBackend.kernel``)."""

    # ``forward`` takes the layer's ``QKNormRope`` and applies it in its own kernel.
    norms_qk: bool = False
    # A decode graph's kernel reads the runner's static block tables and lengths as
    # they are, and has nothing else to prepare: the runner writes them itself and
    # skips ``prepare_replay``.
    reads_batch_index: bool = False


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
        norm_rope: QKNormRope | None = None,  # only where ``kernel(...).norms_qk``
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v for the new tokens and attend q over the paged KV (with ``norm_rope``:
        q and k normed and rotated first)."""

    def kernel(self, forward_batch: ForwardBatch) -> AttentionKernel:
        """What ``forward`` does in this step as planned (after ``plan`` or
        ``prepare_capture``); a step's plan reads it once."""
        return AttentionKernel()

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
