"""Triton RMSNorm and fused residual-add + RMSNorm; reference: ``splitserve.kernels.rmsnorm``.

One program normalizes one row ``[hidden]`` held whole in registers. Rounding
follows the reference step by step: the residual sum is rounded to its dtype
before it is normed, and the normed row is rounded to that dtype before the
weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton.pdl import launch_options, wait_previous_kernel

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(
    x: torch.Tensor,  # [..., hidden], hidden contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # like x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)``; with ``residual``: ``(rms_norm(x + residual), x + residual)``."""
    if residual is not None:
        return fused_add_rms_norm(x, residual, weight, eps)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; the inputs are not modified."""
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    return _launch(x, residual, weight, eps)


def _launch(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} > {MAX_HIDDEN}: one row must fit one program")
    x2 = _rows(x)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    res2 = x2 if residual is None else _rows(residual)
    res_out = x2 if residual is None else torch.empty(x2.shape, dtype=sum_dtype, device=x.device)
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, res_out, hidden, eps,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
            **launch_options(x.device, starts_early=False, lets_next_start=True),
        )  # fmt: skip
    out = out.view(x.shape)
    return out, None if residual is None else res_out.view(x.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[rows, hidden]`` with a contiguous hidden dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
