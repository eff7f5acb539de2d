"""Paged decode attention reference: one query row per request over its KV blocks.

``q`` is ``[batch, num_heads, head_dim]``; the caches are NHD
(``[num_blocks, block_size, num_kv_heads, head_dim]``); request ``i`` attends
its first ``seq_lens[i]`` tokens, token ``t`` at block ``block_tables[i, t //
block_size]``, offset ``t % block_size``. Query head ``h`` reads KV head ``h //
(num_heads // num_kv_heads)`` (grouped-query attention). A request with no
tokens gets zeros. Computed in float32, returned in ``q``'s dtype.

``new_kv = (k, v, slot_mapping)`` first stores each request's new K/V row (its
last token) at its slot, as ``kv_store.store_kv`` does (slot -1: not stored).
``norm_rope = (positions, q_weight, k_weight, eps, cos_cache, sin_cache)`` (with
``new_kv``) first norms and rotates q and the new K rows as ``qk_norm_rope`` does.
``kv_scales = (k_scale, v_scale)``: the caches are FP8 (``float8_e4m3fn``), read as
``float(q) * scale`` and written (``new_kv``) as ``kv_store.store_kv_fp8`` does.
"""

from __future__ import annotations

import torch

from splitserve.kernels.kv_store import FP8_DTYPE, dequantize_fp8, store_kv, store_kv_fp8
from splitserve.kernels.qk_norm_rope import qk_norm_rope


def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int, block ids
    seq_lens: torch.Tensor,  # [batch] int
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    norm_rope: tuple | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_shapes(q, k_cache, v_cache, block_tables, seq_lens, new_kv, norm_rope, kv_scales)
    if norm_rope is not None:
        positions, q_weight, k_weight, eps, cos, sin = norm_rope
        q, k = qk_norm_rope(positions, q, new_kv[0], q_weight, k_weight, eps, cos, sin)
        new_kv = (k, *new_kv[1:])
    if new_kv is not None and kv_scales is not None:
        store_kv_fp8(*new_kv[:2], k_cache, v_cache, new_kv[2], *kv_scales)
    elif new_kv is not None:
        store_kv(*new_kv[:2], k_cache, v_cache, new_kv[2])
    max_len = max(int(seq_lens.max()), 1) if batch else 1
    positions = torch.arange(max_len, device=q.device)
    block_index = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long()[:, block_index]  # [batch, max_len]
    keys = k_cache[blocks, positions % block_size].float()  # [batch, max_len, kv_heads, dim]
    values = v_cache[blocks, positions % block_size].float()
    if kv_scales is not None:
        keys, values = dequantize_fp8(keys, kv_scales[0]), dequantize_fp8(values, kv_scales[1])
    group = num_heads // num_kv_heads
    keys, values = (x.repeat_interleave(group, dim=2) for x in (keys, values))
    scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * scale
    valid = positions[None, :] < seq_lens.long()[:, None]  # [batch, max_len]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no tokens: zeros
    return torch.einsum("bhl,blhd->bhd", probs, values).to(q.dtype)


def check_shapes(
    q, k_cache, v_cache, block_tables, seq_lens, new_kv=None, norm_rope=None, kv_scales=None
) -> None:
    """Raise ValueError, naming what is wrong, unless the arguments fit together."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 != (kv_scales is not None):
        raise ValueError(
            f"a {k_cache.dtype} cache " + ("needs kv_scales" if fp8 else "takes no kv_scales")
        )
    if fp8 and any(s.dtype != torch.float32 or s.numel() != 1 for s in kv_scales):
        raise ValueError("kv_scales are two [1] float32 tensors (K's and V's)")
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
    if norm_rope is not None:
        _check_norm_rope(norm_rope, batch, head_dim, new_kv is not None)


def _check_norm_rope(norm_rope, batch: int, head_dim: int, has_new_kv: bool) -> None:
    positions, q_weight, k_weight, _, cos, sin = norm_rope
    if not has_new_kv:
        raise ValueError("norm_rope norms the new K rows: it needs new_kv")
    if positions.shape != (batch,):
        raise ValueError(f"norm_rope needs one position a request; got {tuple(positions.shape)}")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(
            f"q/k norm weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} do not match "
            f"head_dim {head_dim}"
        )
    rotary_dim = cos.shape[-1]
    if sin.shape != cos.shape or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary caches cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: the same shape, "
            f"an even rotary_dim <= head_dim {head_dim}"
        )
