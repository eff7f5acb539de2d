"""Paged decode attention reference: one query row per request over its KV blocks.

``q`` is ``[batch, num_heads, head_dim]``; the caches are NHD
(``[num_blocks, block_size, num_kv_heads, head_dim]``); request ``i`` attends
its first ``seq_lens[i]`` tokens, token ``t`` at block ``block_tables[i, t //
block_size]``, offset ``t % block_size``. Query head ``h`` reads KV head ``h //
(num_heads // num_kv_heads)`` (grouped-query attention). A request with no
tokens gets zeros. Computed in float32, returned in ``q``'s dtype.

``new_kv = (k, v, slot_mapping)`` first stores each request's new K/V row (its
last token) at its slot, as ``kv_store.store_kv`` does (slot -1: not stored).
"""

from __future__ import annotations

import torch

from splitserve.kernels.kv_store import store_kv


def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int, block ids
    seq_lens: torch.Tensor,  # [batch] int
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_shapes(q, k_cache, v_cache, block_tables, seq_lens, new_kv)
    if new_kv is not None:
        store_kv(*new_kv[:2], k_cache, v_cache, new_kv[2])
    max_len = max(int(seq_lens.max()), 1) if batch else 1
    positions = torch.arange(max_len, device=q.device)
    block_index = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long()[:, block_index]  # [batch, max_len]
    keys = k_cache[blocks, positions % block_size].float()  # [batch, max_len, kv_heads, dim]
    values = v_cache[blocks, positions % block_size].float()
    group = num_heads // num_kv_heads
    keys, values = (x.repeat_interleave(group, dim=2) for x in (keys, values))
    scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * scale
    valid = positions[None, :] < seq_lens.long()[:, None]  # [batch, max_len]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no tokens: zeros
    return torch.einsum("bhl,blhd->bhd", probs, values).to(q.dtype)


def check_shapes(q, k_cache, v_cache, block_tables, seq_lens, new_kv=None) -> None:
    """Raise ValueError, naming what is wrong, unless the arguments fit together."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q is [batch, heads, dim] and the caches NHD [blocks, block_size, kv_heads, dim]; "
            f"got q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != head_dim:
        raise ValueError(
            f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
            f"do not hold head_dim {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"batch {batch} needs block_tables [batch, blocks] and seq_lens [batch]; got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    if new_kv is not None:
        k, v, slots = new_kv
        want = (batch, num_kv_heads, head_dim)
        if k.shape != want or v.shape != want or slots.shape != (batch,):
            raise ValueError(
                f"new K/V rows are [batch, kv_heads, dim] = {want} with one slot each; got "
                f"{tuple(k.shape)}, {tuple(v.shape)}, slots {tuple(slots.shape)}"
            )
