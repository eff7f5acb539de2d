"""Triton gated-MLP projection with its activation; reference:
``splitserve.kernels.linear.linear_silu_and_mul``.

``out [M, D] = silu(x @ gate^T) * (x @ up^T)`` for a gate | up weight ``[2D, K]``
(``GateUpLinear``): the SiLU-and-mul runs in the projection's epilogue, so the
``[M, 2D]`` projection output is never written, read back or launched for. A
program owns ``BLOCK_N`` columns of the activation: it streams the matching gate
rows and up rows (``[BLOCK_N, BLOCK_K]`` tiles through a ``num_stages``-deep
pipeline), keeps two float32 ``tl.dot`` accumulators over all of K (no K split,
so the epilogue sees whole sums), and rounds as the two kernels would: each
projection to x's dtype, ``silu(gate)`` to x's dtype, then the product.

Used by ``ops.linear_silu_and_mul`` for ``MIN_M`` to ``MAX_M`` rows (a decode
step of that many requests) on the GPUs whose ``tuning.GpuTuning`` takes the
medium-batch kernels, with that table's tiles. Alone it beats cuBLAS with the SiLU
kernel on each GPU timed, but on some a whole decode step still took longer with it
than with them, so those keep the two. Fewer rows go through ``linear.py`` (one row
fuses the SiLU into the down projection instead); more rows through cuBLAS and
``activation.py``. Figures: ``docs/perf/TUNING.md``.

Computing the layer's add-norm on load as well (the input scaled by the norm
weight before ``tl.dot``) stopped Triton's pipelining of the weight loads, with
pointer loads and with TMA descriptors alike, so the norm stays a kernel of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton.activation import silu_and_mul
from splitserve.kernels.triton.linear import linear
from splitserve.kernels.triton.pdl import launch_options, loop_done, wait_previous_kernel
from splitserve.kernels.tuning import (
    MEDIUM_BATCH_ROWS,
    SMALL_BATCH_ROWS,
    for_device,
    medium_batch_kernels,
)

MIN_M, MAX_M = SMALL_BATCH_ROWS + 1, MEDIUM_BATCH_ROWS  # the rows it runs for (docstring)
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [2D, K]: gate rows, then up rows; unit stride along K
    out_ptr,  # [M, D]
    M,
    D,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    # columns past D re-read row D - 1 (in bounds) and are dropped on store
    rows = tl.minimum(offs_n, D - 1).to(tl.int64)
    gate_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + D.to(tl.int64) * stride_wn
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            gate = tl.load(gate_ptrs + k)
            up = tl.load(up_ptrs + k)
            x = tl.load(x_ptrs + k, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = offs_k[None, :] < K - k
            gate = tl.load(gate_ptrs + k, mask=k_ok, other=0.0)
            up = tl.load(up_ptrs + k, mask=k_ok, other=0.0)
            x = tl.load(x_ptrs + k, mask=m_ok[:, None] & k_ok, other=0.0)
        acc_gate = tl.dot(x, tl.trans(gate), acc_gate)
        acc_up = tl.dot(x, tl.trans(up), acc_up)
    loop_done(PDL)
    dtype = out_ptr.dtype.element_ty
    g = acc_gate.to(dtype).to(tl.float32)  # as the projection's output, then activation.py
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
    mask = m_ok[:, None] & (offs_n < D)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=mask)


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear_silu_and_mul`` runs the fused kernel: ``MIN_M`` to ``MAX_M`` rows
    on a GPU that takes the medium-batch kernels (``tuning.GpuTuning``) and ``fits``."""
    width = x.shape[-1] if x.dim() else 0
    m = x.numel() // width if width else 0
    return MIN_M <= m <= MAX_M and medium_batch_kernels(x.device) and fits(x, weight, bias)


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``fused_linear_silu_and_mul`` takes these operands: at most ``MAX_M`` rows,
    bf16 / fp16, a 2-D ``[2D, K]`` weight with unit stride along K, and no bias."""
    width = x.shape[-1] if x.dim() else 0
    return (
        width > 0
        and 1 <= x.numel() // width <= MAX_M
        and bias is None
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[0] % 2 == 0
        and weight.shape[1] == width
        and weight.stride(-1) == 1
    )


def linear_silu_and_mul(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [2D, K]: gate | up
    bias: torch.Tensor | None = None,  # [2D]
) -> torch.Tensor:  # [..., D]
    """``silu_and_mul(linear(x, weight, bias))``: one kernel where ``supported``, else
    ``F.linear`` (or ``linear.py``'s kernel for a few rows) and the SiLU kernel."""
    if not supported(x, weight, bias):
        return silu_and_mul(linear(x, weight, bias))
    return fused_linear_silu_and_mul(x, weight)


def fused_linear_silu_and_mul(
    x: torch.Tensor,  # [..., K], at most MAX_M rows
    weight: torch.Tensor,  # [2D, K]: gate | up
) -> torch.Tensor:  # [..., D]
    """The fused kernel on any GPU (``linear_silu_and_mul`` picks where it runs)."""
    if not fits(x, weight, None):
        raise ValueError(
            f"the fused gate_up projection takes 1 to {MAX_M} rows of bf16 / fp16 and a "
            f"[2D, K] weight of x's dtype with unit stride along K; got x "
            f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} "
            f"strides {weight.stride()}"
        )
    *lead, k = x.shape
    d = weight.shape[0] // 2
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, d, dtype=x.dtype, device=x.device)
    tiles = for_device(x.device).gate_up_silu_tiles
    _gate_up_silu_kernel[(triton.cdiv(d, tiles.block_n),)](
        x2, weight, out, m, d, k, x2.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, EVEN_K=k % tiles.block_k == 0, NUM_STAGES=tiles.num_stages,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options(x.device, starts_early=True, lets_next_start=False, after_loop=True),
    )  # fmt: skip
    return out.view(*lead, d)
