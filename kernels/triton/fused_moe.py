"""Triton fused MoE; reference: ``splitserve.kernels.fused_moe``.

Three launches over the expert-sorted layout of ``kernels.moe_align`` (built by
``triton/moe_align.py``: one launch for small batches):

1. grouped GEMM ``hidden[token] @ w13[expert].T`` -> ``[num_tokens * top_k, 2I]``
   (rows indexed by entry ``token * top_k + j``);
2. SiLU-and-mul -> ``[num_tokens * top_k, I]``;
3. grouped GEMM ``act @ w2[expert].T``, scaled by the entry's routing weight
   -> ``[num_tokens * top_k, H]``, then summed over the top-k (float32 sum, one
   rounding).

A program of the grouped GEMM owns ``BLOCK_M`` sorted rows (one expert, by
construction) and ``BLOCK_N`` output columns; padding rows are masked, and
blocks past ``num_tokens_post_padded`` return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import tuning
from splitserve.kernels.triton.activation import silu_and_mul
from splitserve.kernels.triton.moe_align import moe_align_block_size
from splitserve.kernels.tuning import MoETiles, Tiles


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]
    b_ptr,  # [num_experts, N, K]
    c_ptr,  # [num_entries, N]
    weights_ptr,  # [num_entries] float32 routing weights
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    N,
    K,
    num_entries,
    entries_per_a_row,  # top_k when A is indexed by token, 1 when by entry
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no tf32), "tf32" (the default) else
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    entries = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = entries < num_entries
    a_rows = (entries // entries_per_a_row).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + entries, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + entries.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    block_sizes: tuple[int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, BLOCK_K)
    skip_negative_ids: bool = False,
    out_dtype: torch.dtype | None = None,
    tiles: MoETiles | None = None,  # both GEMMs' tiles (default: ``tuning.py``'s)
) -> torch.Tensor:  # [num_tokens, hidden]
    """Every token through its top-k experts (gate_up, SiLU-and-mul, down), weighted, summed.

    ``skip_negative_ids``: ``topk_ids`` may hold -1 (a choice another expert-parallel
    rank computes); no row computes it and it adds zero (its down rows start zeroed).
    ``out_dtype``: the dtype the float32 sum over the top-k is returned in (None: the
    hidden states'; float32: an expert-parallel rank's part, rounded once after combine)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden_size or w2.shape != (num_experts, hidden_size, two_i // 2):
        raise ValueError(
            f"expert weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit "
            f"hidden {hidden_size}"
        )
    if num_tokens == 0:
        return torch.zeros(hidden.shape, dtype=out_dtype or hidden.dtype, device=hidden.device)
    if tiles is None:
        tiles = MoETiles.of(*block_sizes) if block_sizes else None
        tiles = tiles or _tiles(num_tokens * top_k, num_experts, hidden.device)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(
        topk_ids, num_experts, tiles.block_m
    )
    layout = (sorted_ids, expert_ids, num_post_padded)
    num_entries = num_tokens * top_k
    gate_up = torch.empty(num_entries, two_i, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(_rows(hidden), w13, gate_up, None, top_k, *layout, tiles.block_m, tiles.gate_up)
    new_down = torch.zeros if skip_negative_ids else torch.empty
    down = new_down(num_entries, hidden_size, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.float().flatten().contiguous()
    _grouped_gemm(silu_and_mul(gate_up), w2, down, weights, 1, *layout, tiles.block_m, tiles.down)
    total = down.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32)
    return total.to(out_dtype or hidden.dtype)


def _grouped_gemm(
    a, b, c, weights, entries_per_a_row, sorted_ids, expert_ids, num_post, block_m, tiles: Tiles
):
    b = _rows(b)
    num_experts, n, k = b.shape
    grid = (expert_ids.numel(), triton.cdiv(n, tiles.block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, c if weights is None else weights, sorted_ids, expert_ids, num_post,
        n, k, c.shape[0], entries_per_a_row, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        MUL_WEIGHT=weights is not None, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def _tiles(num_entries: int, num_experts: int, device: torch.device) -> MoETiles:
    """Small BLOCK_M when experts get few rows each (decode: the GPU's tiles), larger for
    prefill."""
    rows_per_expert = num_entries / num_experts
    if rows_per_expert <= 16:
        return tuning.for_device(device).moe_decode_tiles
    block_m = 32 if rows_per_expert <= 48 else 64
    return MoETiles.of(block_m, 64 if block_m < 64 else 128, 64)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
