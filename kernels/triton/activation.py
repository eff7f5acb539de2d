"""Triton SiLU-and-mul; reference: ``splitserve.kernels.activation``.

``x = [gate | up]`` along the last dim (``2 * d``); ``out = silu(gate) * up``,
``[..., d]``. As in the reference, ``silu(gate)`` is rounded to the input dtype
before the product. One program covers one row and a block of columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton.pdl import launch_options, wait_previous_kernel

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, d, stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]``; writes ``out [..., d]`` if given."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    block = min(BLOCK, triton.next_power_of_2(d))
    if x2.shape[0]:
        grid = (x2.shape[0], triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](
            x2,
            out2,
            d,
            x2.stride(0),
            out2.stride(0),
            BLOCK=block,
            **launch_options(x.device, starts_early=False, lets_next_start=True),
        )
    return out
