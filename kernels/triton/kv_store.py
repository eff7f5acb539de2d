"""Triton KV store (reshape-and-cache); reference: ``splitserve.kernels.kv_store``.

One program per (token, block of heads) reads its slot, returns at once for
slot -1, and writes the token's K and V rows at ``(slot // block_size, slot %
block_size)``. The layout (NHD or HND) only changes the cache strides that the
wrapper passes, so one kernel serves both. FP8 runs two kernels and no torch op
between them; the scale semantics are those of ``kv_store.store_kv_fp8``. A scale
tensor holds, between and during the two launches:

| value  | after the amax kernel                  | the store kernel                      |
|--------|----------------------------------------|---------------------------------------|
| s > 0  | calibrated, left as is                 | quantizes with s                      |
| 0      | uncalibrated, no non-zero written rows | writes x / 1 (only zeros), leaves 0   |
| -a < 0 | uncalibrated, a = amax of written rows | quantizes with a / 448, stores it     |

The amax kernel returns at once when both scales are set, so a calibrated store
reads K/V once, like a bf16 store, and neither kernel needs the host: the scale
on the device decides (CUDA-graph capturable). Every store program computes the
same ``a / 448`` from either state it may see, so program (0, 0) writing it back
races with none. A refused store (bad shapes) fails before either launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.kv_store import FP8_DTYPE, _check_layout, check_kv_cache_dtype

MAX_TILE = 2048  # elements of one program's [BLOCK_H, BLOCK_D] tile
AMAX_PROGRAMS = 512  # token-strided programs of the amax kernel (per block of heads)


@triton.jit
def _fp8_scale(scale_ptr, write_back):
    """The effective scale (see the table in the module docstring); ``write_back``
    stores it when the amax kernel left ``-amax`` there."""
    scale = tl.load(scale_ptr)
    if scale < 0:
        scale = tl.math.div_rn(-scale, 448.0)
        if write_back:
            tl.store(scale_ptr, scale)
    return scale


@triton.jit
def _store_row(src, dst, scale, mask, FP8: tl.constexpr):
    x = tl.load(src, mask=mask)
    if FP8:
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
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    block_size,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    k_scale = 1.0
    v_scale = 1.0
    if FP8:  # before the slot test: program (0, 0) writes a new scale back
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        k_scale = _fp8_scale(k_scale_ptr, first)
        v_scale = _fp8_scale(v_scale_ptr, first)
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
    _store_row(k_src, k_cache_ptr + dst, k_scale, mask, FP8)
    _store_row(v_src, v_cache_ptr + dst, v_scale, mask, FP8)


@triton.jit
def _amax_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    k_scale_ptr,  # [1] float32: > 0 calibrated (left as is), else gets -amax(|K|)
    v_scale_ptr,
    num_tokens,
    num_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    need_k = tl.load(k_scale_ptr) <= 0
    need_v = tl.load(v_scale_ptr) <= 0
    if not (need_k or need_v):
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    k_max = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    v_max = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for token in range(tl.program_id(0).to(tl.int64), num_tokens, tl.num_programs(0)):
        written_heads = tl.where(tl.load(slot_ptr + token) >= 0, num_heads, 0)
        row = (heads < written_heads) & (dims < head_dim)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, row, other=0.0)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, row, other=0.0)
        k_max = tl.maximum(k_max, tl.abs(k.to(tl.float32)))
        v_max = tl.maximum(v_max, tl.abs(v.to(tl.float32)))
    k_max = tl.max(tl.max(k_max, axis=1), axis=0)
    v_max = tl.max(tl.max(v_max, axis=1), axis=0)
    # only negative values go in: 0 stays 0 (all-zero rows), never -0.0
    if need_k and k_max > 0:
        tl.atomic_min(k_scale_ptr, -k_max)
    if need_v and v_max > 0:
        tl.atomic_min(v_scale_ptr, -v_max)


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
    geometry = _geometry(k, v, k_cache, v_cache, layout)
    _launch(k, v, k_cache, v_cache, slot_mapping, geometry, None, None)


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
    for scale in (k_scale, v_scale):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(f"FP8 scales are [1] float32, got {scale.dtype} {tuple(scale.shape)}")
    # checked before the amax kernel, which leaves -amax in an uncalibrated scale
    geometry = _geometry(k, v, k_cache, v_cache, layout)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens:
        k, v, slot_mapping = _rows(k), _rows(v), slot_mapping.contiguous()
        block_h, block_d = _tile(num_heads, head_dim)
        grid = (min(num_tokens, AMAX_PROGRAMS), triton.cdiv(num_heads, block_h))
        _amax_kernel[grid](
            k, v, slot_mapping, k_scale, v_scale, num_tokens, num_heads, head_dim,
            *k.stride()[:2], *v.stride()[:2], BLOCK_H=block_h, BLOCK_D=block_d,
        )  # fmt: skip
    _launch(k, v, k_cache, v_cache, slot_mapping, geometry, k_scale, v_scale)
    return k_scale, v_scale


def _geometry(k, v, k_cache, v_cache, layout) -> tuple[int, int, int, int]:
    """Checks shapes; returns the cache's (block_size, block, offset, head) strides."""
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
    stride_block, s1, s2, _ = k_cache.stride()
    stride_offset, stride_head = (s1, s2) if layout == "NHD" else (s2, s1)
    return block_size, stride_block, stride_offset, stride_head


def _launch(k, v, k_cache, v_cache, slot_mapping, geometry, k_scale, v_scale) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v, slot_mapping = _rows(k), _rows(v), slot_mapping.contiguous()
    block_h, block_d = _tile(num_heads, head_dim)
    fp8 = k_scale is not None
    _store_kv_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        num_heads, head_dim, *k.stride()[:2], *v.stride()[:2], *geometry,
        FP8=fp8, BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels index tokens and heads by stride but need a contiguous head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _tile(num_heads: int, head_dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE // block_d))
    return block_h, block_d
