"""Triton MoE align for small batches; reference: ``splitserve.kernels.moe_align``.

At decode sizes the reference's dozen small torch ops cost more than the MoE
GEMMs they feed. Up to ``MAX_ENTRIES`` (token, expert) entries one program
builds the whole layout in one launch, by one-hot reductions over
``[entries, experts]`` tiles:

1. per-expert counts, padded to ``block_m``; their cumsum gives each expert's
   padded start and end, and the total is ``num_tokens_post_padded``;
2. each entry goes to ``start[expert] + (earlier entries of its expert)``
   (an exclusive cumsum down the tile plus the counts of earlier chunks), so
   tokens keep their order within an expert, as the reference's stable sort;
3. each block's expert is the number of experts whose padded end is at or
   before the block's start (the reference's ``searchsorted``), ``-1`` past the
   end, and its rows past its expert's count get the padding value.

Steps 2 and 3 write disjoint rows of ``sorted_ids``, so the program needs no
barrier. Outputs are sized from ``num_tokens`` only, as the reference's, and
equal them exactly; larger batches (and a ``block_m`` that is not a power of
two) go to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import moe_align

MAX_ENTRIES = 1024  # num_tokens * top_k handled by the one-program kernel
MAX_TILE = 8192  # elements of one [rows, experts] tile


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [num_entries] int, flattened
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int32
    expert_ids_ptr,  # [max_blocks] int32
    num_post_ptr,  # [1] int32
    num_entries,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,  # entries per tile
    BLOCK_B: tl.constexpr,  # blocks per tile
):
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for first in range(0, num_entries, CHUNK):
        entries = first + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + entries, mask=entries < num_entries, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    tl.store(num_post_ptr, tl.sum(padded, axis=0))

    seen = tl.zeros([BLOCK_E], dtype=tl.int32)  # entries of each expert in earlier chunks
    for first in range(0, num_entries, CHUNK):
        entries = first + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + entries, mask=entries < num_entries, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit + seen[None, :]
        row = tl.sum(hit * (padded_start[None, :] + rank), axis=1)
        placed = (entries < num_entries) & (tl.sum(hit, axis=1) > 0)  # -1: left out
        tl.store(sorted_ids_ptr + row, entries, mask=placed)
        seen += tl.sum(hit, axis=0)

    for first in range(0, max_blocks, BLOCK_B):
        blocks = first + tl.arange(0, BLOCK_B)
        block_start = blocks * BLOCK_M
        expert = tl.sum((padded_end[None, :] <= block_start[:, None]).to(tl.int32), axis=1)
        valid = expert < num_experts  # lanes past num_experts end at the total, like the last
        tl.store(expert_ids_ptr + blocks, tl.where(valid, expert, -1), mask=blocks < max_blocks)
        own = experts[None, :] == expert[:, None]
        own_start = tl.sum(tl.where(own, padded_start[None, :], 0), axis=1)
        own_count = tl.sum(tl.where(own, counts[None, :], 0), axis=1)
        rows = block_start[:, None] + tl.arange(0, BLOCK_M)[None, :]
        padding = rows - own_start[:, None] >= own_count[:, None]  # no own expert: count 0
        tl.store(sorted_ids_ptr + rows, num_entries, mask=padding & (blocks < max_blocks)[:, None])


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``moe_align.moe_align_block_size``: one launch up to ``MAX_ENTRIES`` entries."""
    num_entries = topk_ids.numel()
    if not 0 < num_entries <= MAX_ENTRIES or block_m & (block_m - 1):
        return moe_align.moe_align_block_size(topk_ids, num_experts, block_m)
    max_rows = num_entries + min(num_experts, num_entries) * (block_m - 1)
    max_blocks = triton.cdiv(max_rows, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    chunk = min(triton.next_power_of_2(num_entries), max(16, MAX_TILE // block_e))
    block_b = min(triton.next_power_of_2(max_blocks), max(16, MAX_TILE // max(block_e, block_m)))
    _moe_align_kernel[(1,)](
        topk_ids.reshape(-1).contiguous(), sorted_ids, expert_ids, num_post,
        num_entries, num_experts, max_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, BLOCK_B=block_b, num_warps=8,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_post
