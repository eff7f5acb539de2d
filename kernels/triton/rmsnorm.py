"""Triton RMSNorm and fused residual-add + RMSNorm; reference: ``splitserve.kernels.rmsnorm``.

One program normalizes ``ROWS`` rows ``[hidden]`` held whole in registers
(many rows per program when rows are short, e.g. per-head q/k norms). Rows
are addressed as (outer, inner) pairs with their own strides, so a per-head
view of a fused qkv output, ``[tokens, heads, head_dim]`` with a token stride
wider than ``heads * head_dim``, is read in place, without a copy. Rounding
follows the reference step by step: the residual sum is rounded to its dtype
before it is normed, and the normed row is rounded to that dtype before the
weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    n_rows,
    n_inner,
    hidden,
    eps,
    stride_x_outer,
    stride_x_inner,
    stride_residual_outer,
    stride_residual_inner,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    outer, inner = rows // n_inner, rows % n_inner
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < hidden)[None, :]
    x_rows = (outer * stride_x_outer + inner * stride_x_inner)[:, None]
    out_rows = (rows * hidden)[:, None]  # the outputs are contiguous
    x = tl.load(x_ptr + x_rows + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_rows = (outer * stride_residual_outer + inner * stride_residual_inner)[:, None]
        r = tl.load(residual_ptr + r_rows + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + out_rows + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / hidden + eps)
    normed = (h * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    out = (w[None, :] * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_rows + cols[None, :], out, mask=mask)


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
    x, n_inner, x_strides = _row_layout(x)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    shape = x.shape
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    if residual is None:
        res, res_strides, res_out = x, x_strides, out
    else:
        res, res_n_inner, res_strides = _row_layout(residual)
        if res_n_inner != n_inner:
            res, res_strides = residual.contiguous(), (n_inner * hidden, hidden)
        res_out = torch.empty(shape, dtype=sum_dtype, device=x.device)
    n_rows = x.numel() // hidden if hidden else 0
    block = triton.next_power_of_2(hidden)
    rows = max(1, min(64, ROW_TILE // block))
    if n_rows:
        _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x, res, weight.contiguous(), out, res_out, n_rows, n_inner, hidden, eps,
            *x_strides, *res_strides,
            HAS_RESIDUAL=residual is not None, BLOCK=block, ROWS=rows,
            num_warps=min(16, max(1, rows * block // 256)),
        )  # fmt: skip
    return out, None if residual is None else res_out


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, int]]:
    """``(x, rows per outer index, (outer stride, inner stride))`` addressing every row in place.

    Rows that flatten to one stride are one row per outer index; a 3-d tensor
    such as ``[tokens, heads, head_dim]`` with its own token and head strides
    is read as it is; anything else, or a strided hidden dim, is copied first.
    """
    hidden = x.shape[-1]
    if x.stride(-1) == 1:
        try:
            return x, 1, (x.view(-1, hidden).stride(0), 0)
        except RuntimeError:  # the leading dims do not flatten without a copy
            if x.dim() == 3:
                return x, x.shape[1], (x.stride(0), x.stride(1))
    return x.contiguous(), 1, (hidden, 0)


ROW_TILE = 4096  # elements of one program's [ROWS, BLOCK] tile when rows are short
