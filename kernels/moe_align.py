"""Token layout of the grouped MoE GEMM: (token, expert) pairs sorted by expert, padded.

Each token picks ``top_k`` experts, giving ``num_tokens * top_k`` entries; entry
``i`` is token ``i // top_k``'s ``i % top_k``-th choice (``topk_ids.flatten()``).
``moe_align_block_size`` sorts the entries by expert (stable, so tokens keep
their order within an expert) and pads each expert's run to a multiple of
``block_m``, so every ``block_m`` rows of the result belong to one expert:

- ``sorted_ids [max_blocks * block_m]`` entry indices; padding holds
  ``num_tokens * top_k`` (one past the last entry);
- ``expert_ids [max_blocks]``: the expert of each block; ``-1`` past the end;
- ``num_tokens_post_padded [1]``: rows in use (a tensor: no host sync).

An entry whose expert id is -1 (a choice an expert-parallel rank does not hold) is
left out of the layout: no row computes it.

``max_blocks`` is an upper bound known on the host (every expert that gets a
token may add ``block_m - 1`` padding rows), so the layout never syncs with the
device and can be captured in a CUDA graph. Plain torch, any device.
"""

from __future__ import annotations

import torch


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int; -1: skipped (not in the layout)
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids int32, expert_ids int32, num_tokens_post_padded int32 [1])``."""
    flat = topk_ids.flatten().long()
    num_entries, device = flat.numel(), flat.device
    key = flat.masked_fill(flat < 0, num_experts)  # skipped entries: one past the last expert
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.sort(key, stable=True).indices
    experts = key[order]
    rank = torch.arange(num_entries, device=device) - (counts.cumsum(0) - counts)[experts]
    max_rows = num_entries + min(num_experts, num_entries) * (block_m - 1)
    max_blocks = (max_rows + block_m - 1) // block_m
    discard = max_blocks * block_m  # where skipped entries go: a row cut off below
    sorted_ids = torch.full((discard + 1,), num_entries, dtype=torch.long, device=device)
    start = torch.cat([padded_start, padded_start.new_full((1,), discard)])
    row = torch.where(experts < num_experts, start[experts] + rank, discard)
    sorted_ids.scatter_(0, row, order)
    block_start = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids[:discard].int(), expert_ids.int(), padded_end[-1:].int()
