"""Triton KV store (reshape-and-cache); reference: ``splitserve.kernels.kv_store``.

One program per (block of ``BLOCK_T`` tokens, block of heads) issues its slot,
K and V loads together, then writes each row at ``(slot // block_size, slot %
block_size)``; a row whose slot is -1 is loaded but not stored, so no load waits
for a slot. The layout (NHD or HND) only changes the cache strides that the
wrapper passes, so one kernel serves both. Heads, head dim and block size are
compile-time constants (one compile per model): the slot split is a shift, and a
head or dim mask exists only where the tile overhangs. The tiling (``BLOCK_T``,
``num_warps``) comes from ``default_tiling`` unless the launcher is given one;
every tiling writes the same bytes.

FP8 runs two kernels and no torch op between them; the scale semantics are those
of ``kv_store.store_kv_fp8``. A scale tensor holds, between and during the two
launches:

| value  | after the amax kernel                  | the store kernel                      |
|--------|----------------------------------------|---------------------------------------|
| s > 0  | calibrated, left as is                 | quantizes with s                      |
| 0      | uncalibrated, no non-zero written rows | writes x / 1 (only zeros), leaves 0   |
| -a < 0 | uncalibrated, a = amax of written rows | quantizes with a / 448, stores it     |

The amax kernel returns at once when both scales are set, so a calibrated store
reads K/V once, like a bf16 store, and neither kernel needs the host: the scale
on the device decides (CUDA-graph capturable). Every store program computes the
same ``a / 448`` from either state it may see, so program (0, 0) writing it back
races with none. A refused store (bad shapes) fails before either launch. With
``calibrated=True`` the amax kernel is not launched at all (one launch, as for
bf16); a scale still 0 then stays 0 and the rows are written unscaled, hence the
caller's promise in ``store_kv_fp8``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.kv_store import FP8_DTYPE, _check_layout, check_kv_cache_dtype
from splitserve.kernels.triton.pdl import launch_options, wait_previous_kernel

MAX_TILE = 2048  # elements of one token's [BLOCK_H, BLOCK_D] tile
AMAX_PROGRAMS = 512  # token-strided programs of the amax kernel (per block of heads)
# default tiling: programs of up to TOKEN_TILE elements, but no fewer than MIN_PROGRAMS
# programs (about 8 per SM of a 132-SM GPU) while tokens last
TOKEN_TILE = 4096
MIN_PROGRAMS = 1024


@triton.jit
def _fp8_scale(raw):
    """The effective scale of a loaded scale (see the table in the module docstring)."""
    return tl.where(raw < 0, tl.math.div_rn(-raw, 448.0), raw)


@triton.jit
def _to_cache(x, scale, cache_ptr, FP8: tl.constexpr):
    if FP8:
        scale = tl.where(scale > 0, scale, 1.0)
        x = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    # every load is issued before the first store (which could alias K or V to the
    # compiler): slots, K and V rows, then the scales, then the stores
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    tokens, slots = tokens[:, None, None], slots[:, None, None]  # [BLOCK_T, 1, 1]
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :, None]
    dims = tl.arange(0, BLOCK_D)[None, None, :]
    rows = tokens < num_tokens  # widened only where the tile overhangs the heads or dims
    if NUM_HEADS % BLOCK_H != 0:
        rows = rows & (heads < NUM_HEADS)
    if HEAD_DIM != BLOCK_D:
        rows = rows & (dims < HEAD_DIM)
    k = tl.load(k_ptr + tokens * stride_kt + heads * stride_kh + dims, mask=rows)
    v = tl.load(v_ptr + tokens * stride_vt + heads * stride_vh + dims, mask=rows)
    k_scale = 1.0
    v_scale = 1.0
    if FP8:  # both loaded before program (0, 0) writes a new scale back
        k_raw, v_raw = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
        k_scale, v_scale = _fp8_scale(k_raw), _fp8_scale(v_raw)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            if k_raw < 0:
                tl.store(k_scale_ptr, k_scale)
            if v_raw < 0:
                tl.store(v_scale_ptr, v_scale)
    dst = (
        (slots // BLOCK_SIZE) * stride_cache_block
        + (slots % BLOCK_SIZE) * stride_cache_offset
        + heads * stride_cache_head
        + dims
    )
    written = rows & (slots >= 0)
    tl.store(k_cache_ptr + dst, _to_cache(k, k_scale, k_cache_ptr, FP8), mask=written)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_scale, v_cache_ptr, FP8), mask=written)


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
    *,
    calibrated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizing store; scale semantics as ``kv_store.store_kv_fp8`` (calibrated once).

    ``calibrated=True`` skips the amax kernel: one launch instead of two. Pass it
    only once both scales are known to be > 0 (e.g. read once on the host, outside
    any CUDA graph, after a first store); the result is then that of a plain call.
    """
    if k_cache.dtype != FP8_DTYPE or v_cache.dtype != FP8_DTYPE:
        raise ValueError(f"store_kv_fp8 needs {FP8_DTYPE} caches, got {k_cache.dtype}")
    check_kv_cache_dtype(k_cache.dtype, k_cache.device)
    for scale in (k_scale, v_scale):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(f"FP8 scales are [1] float32, got {scale.dtype} {tuple(scale.shape)}")
    # checked before the amax kernel, which leaves -amax in an uncalibrated scale
    geometry = _geometry(k, v, k_cache, v_cache, layout)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens and not calibrated:
        k, v, slot_mapping = _rows(k), _rows(v), slot_mapping.contiguous()
        block_h, block_d = _tile(num_heads, head_dim)
        grid = (min(num_tokens, AMAX_PROGRAMS), triton.cdiv(num_heads, block_h))
        _amax_kernel[grid](
            k, v, slot_mapping, k_scale, v_scale, num_tokens, num_heads, head_dim,
            *k.stride()[:2], *v.stride()[:2], BLOCK_H=block_h, BLOCK_D=block_d,
        )  # fmt: skip
    _launch(k, v, k_cache, v_cache, slot_mapping, geometry, k_scale, v_scale)
    return k_scale, v_scale


def default_tiling(num_tokens: int, num_heads: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_T, num_warps)`` of the store kernel: the most tokens per program (a power
    of 2) that keeps its tile within ``TOKEN_TILE`` elements and ``MIN_PROGRAMS`` programs
    busy; one token per program below ``2 * MIN_PROGRAMS`` tokens."""
    block_h, block_d = _tile(num_heads, head_dim)
    limit = max(1, min(TOKEN_TILE // (block_h * block_d), num_tokens // MIN_PROGRAMS))
    return 1 << (limit.bit_length() - 1), 4


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


def _launch(
    k, v, k_cache, v_cache, slot_mapping, geometry, k_scale, v_scale,
    *, block_t: int | None = None, num_warps: int | None = None,
) -> None:  # fmt: skip
    """The store kernel alone; ``block_t`` (a power of 2) and ``num_warps`` default to
    ``default_tiling``'s."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v, slot_mapping = _rows(k), _rows(v), slot_mapping.contiguous()
    block_h, block_d = _tile(num_heads, head_dim)
    default_t, default_warps = default_tiling(num_tokens, num_heads, head_dim)
    block_t, num_warps = block_t or default_t, num_warps or default_warps
    block_size, *strides = geometry
    fp8 = k_scale is not None
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        num_tokens, *k.stride()[:2], *v.stride()[:2], *strides,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, FP8=fp8,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
        **launch_options(k.device, starts_early=False, lets_next_start=False),
    )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels index tokens and heads by stride but need a contiguous head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _tile(num_heads: int, head_dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE // block_d))
    return block_h, block_d
