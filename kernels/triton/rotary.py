"""Triton rotary embedding (neox style, partial rotary); reference: ``splitserve.kernels.rotary``.

For each head, dims ``[0, rotary_dim)`` rotate as two halves ``x1 = x[:r/2]``,
``x2 = x[r/2:r]``: ``(x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2)`` in float32,
rounded once to the input dtype; dims ``[rotary_dim, head_dim)`` pass through.
``cos``/``sin`` rows are in the neox layout (each frequency twice), as the
reference takes them. One program handles one token and a block of heads;
``positions`` picks the token's cos/sin row, so a cache can be passed whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton.pdl import launch_options, wait_previous_kernel

MAX_TILE = 2048


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    num_heads,
    head_dim,
    half,  # rotary_dim // 2
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    COPY_PASS: tl.constexpr,  # out of place: copy the dims that do not rotate
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    head_ok = heads < num_heads
    mask = head_ok & (dims < half)
    c1 = tl.load(cos_ptr + pos * stride_cos + dims, mask=dims < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + half + dims, mask=dims < half, other=0.0)
    s1 = tl.load(sin_ptr + pos * stride_sin + dims, mask=dims < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_sin + half + dims, mask=dims < half, other=0.0)
    src = x_ptr + token * stride_xt + heads * stride_xh
    dst = out_ptr + token * stride_ot + heads * stride_oh
    x1 = tl.load(src + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + dims, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2.to(tl.float32) + x1 * s2.to(tl.float32)
    tl.store(dst + dims, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half + dims, y2.to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_PASS:
        rest = 2 * half + tl.arange(0, BLOCK_PASS)[None, :]
        rest_mask = head_ok & (rest < head_dim)
        tl.store(dst + rest, tl.load(src + rest, mask=rest_mask), mask=rest_mask)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, rotary_dim] (neox layout)
    sin: torch.Tensor,  # [num_tokens, rotary_dim]
    inplace: bool = False,
) -> torch.Tensor:
    """The reference's ``apply_rotary``; ``inplace`` rotates ``x`` itself and returns it."""
    positions = torch.arange(x.shape[0], device=x.device)
    return _rotate(x, cos, sin, positions, inplace)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_position, rotary_dim] float32 (neox layout)
    sin_cache: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RotaryEmbedding.forward``: rotate q and k by ``cache[positions]`` without a gather."""
    return (
        _rotate(q, cos_cache, sin_cache, positions, inplace),
        _rotate(k, cos_cache, sin_cache, positions, inplace),
    )


def _rotate(x, cos, sin, positions, inplace: bool) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_dim or sin.shape[-1] != rotary_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary needs a contiguous last dim in x, cos and sin")
    out = x if inplace else torch.empty_like(x)
    if num_tokens == 0:
        return out
    block_half = triton.next_power_of_2(rotary_dim // 2)
    block_pass = triton.next_power_of_2(max(1, head_dim - rotary_dim))
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE // (2 * block_half)))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, out, cos, sin, positions, num_heads, head_dim, rotary_dim // 2,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        COPY_PASS=not inplace and rotary_dim < head_dim,
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        **launch_options(x.device, starts_early=False, lets_next_start=True),
    )  # fmt: skip
    return out
