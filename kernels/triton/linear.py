"""Triton linear for a few rows (decode); reference: ``splitserve.kernels.linear``.

``out [M, N] = x [M, K] @ weight [N, K]^T + bias``. At decode M is small, so the
matmul is a stream of the weight: the kernel's job is to read it once, at the
memory's rate. A program owns ``BLOCK_N`` weight rows and one of ``split_k``
slices of K (whole ``BLOCK_K`` tiles); it walks its slice in
``[BLOCK_N, BLOCK_K]`` tiles, loaded 16 bytes a lane along K through a
``num_stages``-deep pipeline (``cp.async`` into shared memory on sm80+), and
accumulates in float32:

- one row (``use_dot=False``): a GEMV. Per-lane partial products are kept in
  the weight tile's own layout and summed over K once, after the loop;
- more rows (``use_dot=True``): ``tl.dot`` on tensor cores, rows padded to 16
  (the padding is masked: it costs no memory traffic).

With ``split_k == 1`` the program adds the bias and writes the output. Otherwise
it writes float32 partial sums to a ``[split_k, M, N]`` buffer and a second
small kernel sums them in split order (the same result every run), adds the
bias and casts. Buffers are sized from the shapes only and nothing reads back
to the host, so a call can be captured in a CUDA graph. Tiles come from
``default_config``, not from autotuning (which syncs and times kernels, also
during capture); ``benchmarks/linear_roofline.py --sweep`` times alternatives.

Measured on an H200 (Qwen3-8B shapes). Alone (``linear_roofline.py --sweep``):
at one row the GEMV on ``[16, 512]`` tiles without a K split beats cuBLAS by
4-10% per projection (5% on the LM head), and splitting its K was slower in
every case (a 6144 x 4096 GEMV: 59 us split in two, 22 us unsplit). In a
decode step's CUDA graph (``decode_linears.py``, 36 layers): 1.07x the weight
bytes at one row against cuBLAS's 1.18x, and with ``tl.dot`` tiles and the K
split of ``default_config`` 1.17-1.18x at 8 and 16 rows against 1.22-1.26x; at
32 rows they tie and at 64 cuBLAS is faster (1.25x against 1.33x), so
``linear`` takes the kernel up to 16 rows.

Weight rows past N are not masked on load: they re-read row ``N - 1`` (always
in bounds) and are dropped on store, so loads stay unmasked when
``K % BLOCK_K == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitserve.kernels.triton.device import sm_count
from splitserve.kernels.triton.pdl import launch_options, wait_previous_kernel

MAX_M = 16  # ``linear`` uses the kernel up to this many rows, cuBLAS above (measured)
DTYPES = (torch.bfloat16, torch.float16)
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class LinearConfig:
    """Tiling of one launch; ``num_warps`` and ``num_stages`` go to Triton."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True  # tensor cores (rows padded to 16); False: the one-row GEMV

    def __post_init__(self):
        sizes = {"block_n": self.block_n, "block_k": self.block_k}
        for name, v in sizes.items():
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.use_dot and min(sizes.values()) < 16:
            raise ValueError(f"use_dot needs block_n and block_k >= 16, got {sizes}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")

    def block_m(self, m: int) -> int:
        """Rows per program: all ``m`` of them, padded to a power of two >= 16 for ``tl.dot``."""
        if not self.use_dot and m != 1:
            raise ValueError(f"use_dot=False is the one-row GEMV; got {m} rows")
        return max(triton.next_power_of_2(m), 16) if self.use_dot else 1


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    b_ptr,  # [N] or a placeholder
    out_ptr,  # [M, N] in x's dtype, or with PARTIAL [split_k, M, N] float32 partial sums
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    split_k,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split_k > 1
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks along K
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split_k) * BLOCK_K  # whole tiles per split
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if USE_DOT:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:  # one row: per-lane partial products in the weight's layout, summed after the loop
        x_ptrs = x_ptr + offs_k
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k)
        else:
            w = tl.load(w_ptrs + k, mask=offs_k[None, :] < K - k, other=0.0)
        if USE_DOT:
            x_mask = m_ok[:, None] if EVEN_K else m_ok[:, None] & (offs_k[None, :] < K - k)
            x = tl.load(x_ptrs + k, mask=x_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            if EVEN_K:
                x = tl.load(x_ptrs + k)
            else:
                x = tl.load(x_ptrs + k, mask=offs_k < K - k, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    sums = acc if USE_DOT else tl.sum(acc, axis=1)[None, :]

    n_ok = offs_n < N
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        part_ptrs = out_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part_ptrs, sums, mask=mask)
    else:
        if HAS_BIAS:
            sums += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = sums.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], out, mask=mask)


@triton.jit
def _split_k_sum_kernel(
    part_ptr,  # [split_k, M, N] float32
    b_ptr,
    out_ptr,  # [M, N]
    M,
    N,
    split_k,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in range(1, split_k):  # in split order: the same sum every run
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` runs the kernel (else ``F.linear``): 1 to ``MAX_M`` rows,
    bf16 / fp16 throughout, a 2-D contiguous weight and a contiguous bias."""
    k = x.shape[-1] if x.dim() else 0
    m = x.numel() // k if k else 0
    return (
        1 <= m <= MAX_M
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == k
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: LinearConfig | None = None,
) -> torch.Tensor:  # [..., N]
    """``x @ weight.T + bias``: the kernel for few rows (``supported``), ``F.linear`` otherwise."""
    if not supported(x, weight, bias):
        return F.linear(x, weight, bias)
    return small_m_linear(x, weight, bias, config)


def small_m_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K], unit stride along K
    bias: torch.Tensor | None = None,  # [N]
    config: LinearConfig | None = None,
) -> torch.Tensor:  # [..., N]
    """The kernel at any row count, with ``config`` or ``default_config``'s tiles."""
    *lead, k = x.shape
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(
            f"weight must be [N, {k}] with unit stride along K to fit x [..., {k}]; "
            f"got shape {tuple(weight.shape)}, strides {weight.stride()}"
        )
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return F.linear(x, weight, bias) if k == 0 else out.view(*lead, n)
    cfg = config or default_config(m, n, k, sm_count(x.device, off_gpu=132))  # CPU: an H200's
    block_m = cfg.block_m(m)
    has_bias, partial = bias is not None, cfg.split_k > 1
    b = bias if has_bias else out  # a placeholder when there is none: never read
    dest = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if partial else out
    _linear_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x2, weight, b, dest, m, n, k, x2.stride(0), weight.stride(0), cfg.split_k,
        HAS_BIAS=has_bias, PARTIAL=partial, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot, EVEN_K=k % cfg.block_k == 0,
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(x.device, starts_early=True, lets_next_start=False),
    )  # fmt: skip
    if partial:
        _split_k_sum_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            dest, b, out, m, n, cfg.split_k, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK,
            num_warps=4,
            **launch_options(x.device, starts_early=False, lets_next_start=True),
        )  # fmt: skip
    return out.view(*lead, n)


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> LinearConfig:
    """Tiles for ``[m, k] @ [n, k]^T`` on a GPU of ``num_sms`` SMs (module docstring).

    One row: the GEMV on ``[16, 512]`` tiles, no K split. More rows: ``tl.dot`` on
    ``[32, 128]`` tiles (``[64, 128]`` when N alone gives two programs an SM), with
    K split in 2, 4, ... until the grid has over 1.5 programs an SM. Four warps, four
    stages.
    """
    block_k = max(triton.next_power_of_2(k), 16)
    if m == 1:
        return LinearConfig(16, min(512, block_k), num_warps=4, num_stages=4, use_dot=False)
    block_n = 64 if triton.cdiv(n, 64) >= 2 * num_sms else 32
    block_k = min(128, block_k)
    split = 1
    while 2 * triton.cdiv(n, block_n) * split <= 3 * num_sms and k >= 4 * split * block_k:
        split *= 2
    return LinearConfig(block_n, block_k, split, num_warps=4, num_stages=4, use_dot=True)
