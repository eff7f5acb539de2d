"""Triton KV store (reshape-and-cache); reference: ``splitserve.kernels.kv_store``.

One program per (token, block of heads) reads its slot, returns at once for
slot -1, and writes the token's K and V rows at ``(slot // block_size, slot %
block_size)``. The layout (NHD or HND) only changes the cache strides that the
wrapper passes, so one kernel serves both. FP8 runs two kernels: an amax over
the written rows (atomic max), then the quantizing store; the scale semantics
are those of ``kv_store.store_kv_fp8``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.kv_store import (
    FP8_DTYPE,
    _check_layout,
    calibrate_fp8_scale,
    check_kv_cache_dtype,
)

MAX_TILE = 2048  # elements of one program's [BLOCK_H, BLOCK_D] tile


@triton.jit
def _store_row(src, dst, scale_ptr, mask, FP8: tl.constexpr):
    x = tl.load(src, mask=mask)
    if FP8:
        scale = tl.load(scale_ptr)
        scale = tl.where(scale > 0, scale, 1.0)
        x = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_heads,
    head_dim,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    dst = (
        (slot // block_size) * stride_cache_block
        + (slot % block_size) * stride_cache_offset
        + heads * stride_cache_head
        + dims
    )
    k_src = k_ptr + token * stride_kt + heads * stride_kh + dims
    v_src = v_ptr + token * stride_vt + heads * stride_vh + dims
    _store_row(k_src, k_cache_ptr + dst, k_scale_ptr, mask, FP8)
    _store_row(v_src, v_cache_ptr + dst, v_scale_ptr, mask, FP8)


@triton.jit
def _amax_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    amax_ptr,  # [2] float32: amax of K, amax of V
    num_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if tl.load(slot_ptr + token) < 0:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(k.to(tl.float32)), axis=1), axis=0))
    tl.atomic_max(amax_ptr + 1, tl.max(tl.max(tl.abs(v.to(tl.float32)), axis=1), axis=0))


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # NHD [blocks, block_size, heads, dim] or HND [blocks, heads, bs, dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 skips the row
    layout: str = "NHD",
) -> None:
    """Write K/V rows at their slots, cast to the cache dtype (bf16, fp16 or fp32)."""
    if k_cache.dtype == FP8_DTYPE:
        raise ValueError("an FP8 KV cache needs a scale: call store_kv_fp8")
    _launch(k, v, k_cache, v_cache, slot_mapping, layout, None, None)


def store_kv_fp8(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,  # float8_e4m3fn, NHD or HND
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,  # [1] float32, 0 = not calibrated yet; updated in place
    v_scale: torch.Tensor,
    layout: str = "NHD",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizing store; scale semantics as ``kv_store.store_kv_fp8`` (calibrated once)."""
    if k_cache.dtype != FP8_DTYPE or v_cache.dtype != FP8_DTYPE:
        raise ValueError(f"store_kv_fp8 needs {FP8_DTYPE} caches, got {k_cache.dtype}")
    check_kv_cache_dtype(k_cache.dtype, k_cache.device)
    num_tokens, num_heads, head_dim = k.shape
    amax = torch.zeros(2, dtype=torch.float32, device=k.device)
    if num_tokens:
        block_h, block_d = _tile(num_heads, head_dim)
        grid = (num_tokens, triton.cdiv(num_heads, block_h))
        k, v, slot_mapping = _rows(k), _rows(v), slot_mapping.contiguous()
        _amax_kernel[grid](
            k, v, slot_mapping, amax, num_heads, head_dim, *k.stride()[:2], *v.stride()[:2],
            BLOCK_H=block_h, BLOCK_D=block_d,
        )  # fmt: skip
    calibrate_fp8_scale(k_scale, amax[0])
    calibrate_fp8_scale(v_scale, amax[1])
    _launch(k, v, k_cache, v_cache, slot_mapping, layout, k_scale, v_scale)
    return k_scale, v_scale


def _launch(k, v, k_cache, v_cache, slot_mapping, layout, k_scale, v_scale) -> None:
    _check_layout(layout)
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"K/V shapes differ: {tuple(k.shape)} / {tuple(v.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches need equal strides and a contiguous head_dim")
    _, s1, s2, cache_dim = k_cache.shape
    block_size, cache_heads = (s1, s2) if layout == "NHD" else (s2, s1)
    if (cache_heads, cache_dim) != (num_heads, head_dim):
        raise ValueError(
            f"{layout} cache {tuple(k_cache.shape)} does not hold {num_heads} heads of {head_dim}"
        )
    if num_tokens == 0:
        return
    k, v, slot_mapping = _rows(k), _rows(v), slot_mapping.contiguous()
    stride_block, s1, s2, _ = k_cache.stride()
    stride_offset, stride_head = (s1, s2) if layout == "NHD" else (s2, s1)
    block_h, block_d = _tile(num_heads, head_dim)
    fp8 = k_scale is not None
    _store_kv_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        num_heads, head_dim, block_size, *k.stride()[:2], *v.stride()[:2],
        stride_block, stride_offset, stride_head,
        FP8=fp8, BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels index tokens and heads by stride but need a contiguous head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _tile(num_heads: int, head_dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE // block_d))
    return block_h, block_d
