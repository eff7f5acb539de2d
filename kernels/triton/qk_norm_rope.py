"""Triton per-head q/k RMSNorm + rotary, one launch; reference: ``splitserve.kernels.qk_norm_rope``.

q and k are read through their token and head strides (views of the fused qkv
output, last dim contiguous) and written to new contiguous ``[tokens, heads,
head_dim]`` outputs; the inputs are never written. One program takes one token
and a block of heads of q or of k (q's blocks first on grid axis 1), each head
row whole in registers. Rounding follows the reference step by step: the normed
row is rounded to the input dtype, its product with the weight to the output
dtype, and the rotation of that rounded value, in float32, is rounded once.

Rotary is neox style: dim ``d < rotary_dim / 2`` pairs with ``d + rotary_dim / 2``.
Each program loads its rows twice, once as they are and once permuted to each
dim's partner (the same bytes, from cache), so the norm sums whole rows and the
rotation needs no shuffle: ``y[d] = n[d] * cos[d] -/+ n[partner] * sin[d]``.
Dims from ``rotary_dim`` on pass through normed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton.pdl import launch_options, wait_previous_kernel

MAX_TILE = 1024  # elements of one program's [heads, head_dim] tile


@triton.jit
def norm_rope_rows(
    rows,  # [BLOCK_H, 1] pointers to head rows (unit stride along head_dim)
    mask,  # [BLOCK_H, BLOCK_D]: rows and dims to compute
    dims,  # [1, BLOCK_D]: tl.arange(0, BLOCK_D)
    w_ptr,
    cos_row,
    sin_row,
    head_dim,
    half,  # rotary_dim // 2
    eps,
    out_ty: tl.constexpr,
):
    """The rows, each RMS-normed over ``head_dim`` and rotated at one position, in
    ``out_ty`` (module docstring); masked entries are 0. Split-KV decode attention calls
    it too, to norm and rotate q and the new K row as it loads them."""
    dim_ok = dims < head_dim
    in_rot = dims < 2 * half
    partner = tl.where(dims < half, dims + half, tl.where(in_rot, dims - half, dims))
    x = tl.load(rows + dims, mask=mask, other=0.0)
    xp = tl.load(rows + partner, mask=mask, other=0.0).to(tl.float32)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / head_dim + eps)
    w = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=dim_ok, other=0.0).to(tl.float32)
    n = (w * (h * rstd[:, None]).to(x.dtype).to(tl.float32)).to(out_ty).to(tl.float32)
    n_part = (wp * (xp * rstd[:, None]).to(x.dtype).to(tl.float32)).to(out_ty).to(tl.float32)
    c = tl.load(cos_row + dims, mask=in_rot, other=1.0).to(tl.float32)
    s = tl.load(sin_row + dims, mask=in_rot, other=0.0).to(tl.float32)
    y = tl.where(in_rot, n * c + n_part * tl.where(dims < half, -s, s), n)
    return y.to(out_ty)


@triton.jit
def _norm_rope_heads(
    src,  # this token's first head
    stride_h,
    dst,  # this token's first output head (contiguous)
    w_ptr,
    cos_row,
    sin_row,
    first_head,
    num_heads,
    head_dim,
    half,  # rotary_dim // 2
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    y = norm_rope_rows(
        src + heads * stride_h, mask, dims, w_ptr, cos_row, sin_row, head_dim, half, eps,
        dst.dtype.element_ty,
    )  # fmt: skip
    tl.store(dst + heads * head_dim + dims, y, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    num_heads,
    num_kv_heads,
    head_dim,
    half,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    q_blocks = tl.cdiv(num_heads, BLOCK_H)
    if block < q_blocks:
        _norm_rope_heads(
            q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * num_heads * head_dim,
            q_weight_ptr, cos_row, sin_row, block * BLOCK_H, num_heads, head_dim, half, eps,
            BLOCK_H, BLOCK_D,
        )  # fmt: skip
    else:
        _norm_rope_heads(
            k_ptr + token * stride_kt, stride_kh, k_out_ptr + token * num_kv_heads * head_dim,
            k_weight_ptr, cos_row, sin_row, (block - q_blocks) * BLOCK_H, num_kv_heads, head_dim,
            half, eps, BLOCK_H, BLOCK_D,
        )  # fmt: skip


def qk_norm_rope(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], any token / head strides
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
    cos_cache: torch.Tensor,  # [max_position, rotary_dim] float32 (neox layout)
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous ``(q_out, k_out)``: each head RMS-normed, then rotated by ``positions``."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [num_tokens, heads, head_dim] "
            "with the same num_tokens and head_dim"
        )
    (num_tokens, num_heads, head_dim), num_kv_heads = q.shape, k.shape[1]
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight.shape != (head_dim,):
            raise ValueError(f"{name} {tuple(weight.shape)} does not match head_dim {head_dim}")
    rotary_dim = cos_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_dim or sin_cache.shape != cos_cache.shape:
        raise ValueError(
            f"rotary_dim {rotary_dim} (cos {tuple(cos_cache.shape)}, sin "
            f"{tuple(sin_cache.shape)}) must be even, <= head_dim {head_dim}, the same for both"
        )
    if cos_cache.stride(-1) != 1 or sin_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rope needs a contiguous last dim in cos and sin")
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    q_out, k_out = _output(q, q_weight), _output(k, k_weight)
    if num_tokens == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(max(num_heads, num_kv_heads)), max(1, MAX_TILE // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    _qk_norm_rope_kernel[grid](
        q, k, q_out, k_out, q_weight.contiguous(), k_weight.contiguous(), cos_cache, sin_cache,
        positions, num_heads, num_kv_heads, head_dim, rotary_dim // 2, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_cache.stride(0), sin_cache.stride(0),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 256)),
        **launch_options(q.device, starts_early=False, lets_next_start=True),
    )  # fmt: skip
    return q_out, k_out


def _output(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Contiguous, in the dtype of ``weight * x`` (as the reference's norm makes it)."""
    return torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
