"""Reference attention in plain torch, reading the paged KV cache.

Works on CPU and GPU for every phase. Decode steps (one query row per request)
run batched: each request's blocks are gathered into a padded ``[batch,
max_len]`` view and masked by sequence length. Prefill and mixed steps run per
request, so a chunk attends its cached prefix plus itself under a causal mask.
Attention runs in float32 through torch SDPA (grouped-query heads, boolean mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.kernels.kv_store import store_kv
from splitserve.workers.attention.base import AttentionBackend, AttentionSpec
from splitserve.workers.forward_batch import ForwardBatch, Phase


@dataclass
class TorchAttentionMetadata:
    gather_index: torch.Tensor  # [batch, max_seq_len] slot of every KV token (0-padded)
    key_mask: torch.Tensor  # [batch, max_seq_len] True where the key is real
    query_spans: list[tuple[int, int]]  # rows of each request in the packed query


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        block_size = fb.kv_cache.block_size
        max_len = max(fb.seq_lens)
        offsets = torch.arange(max_len, device=fb.block_tables.device)
        blocks = fb.block_tables.long().gather(1, (offsets // block_size).expand(fb.batch_size, -1))
        gather_index = blocks * block_size + offsets % block_size
        key_mask = offsets[None, :] < fb.seq_lens_tensor[:, None]
        starts = fb.query_start_loc.tolist()
        spans = list(zip(starts[:-1], starts[1:]))
        fb.attn_metadata = TorchAttentionMetadata(gather_index, key_mask, spans)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionSpec,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        k_cache, v_cache = forward_batch.kv_cache.layer(layer.layer_id)
        store_kv(k, v, k_cache, v_cache, forward_batch.slot_mapping)
        meta: TorchAttentionMetadata = forward_batch.attn_metadata
        flat_k = k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
        flat_v = v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
        if forward_batch.phase == Phase.DECODE:
            keys, values = flat_k[meta.gather_index], flat_v[meta.gather_index]
            return _attend(q[:, None], keys, values, meta.key_mask[:, None, :], layer)[:, 0]
        out = torch.empty_like(q)
        for i, (start, end) in enumerate(meta.query_spans):
            seq_len = forward_batch.seq_lens[i]
            index = meta.gather_index[i, :seq_len]
            q_len = end - start
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            out[start:end] = _attend(
                q[None, start:end], flat_k[index][None], flat_v[index][None], mask[None], layer
            )[0]
        return out


def _attend(
    q: torch.Tensor,  # [batch, q_len, num_heads, head_dim]
    k: torch.Tensor,  # [batch, kv_len, num_kv_heads, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor,  # [batch, q_len, kv_len] bool
    layer: AttentionSpec,
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).float(),
        k.transpose(1, 2).float(),
        v.transpose(1, 2).float(),
        attn_mask=mask[:, None],
        scale=layer.scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).to(v.dtype)
