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

The GEMV on ``[16, 512]`` tiles beats cuBLAS at one row, and splitting its K only
added a launch. Up to ``SPLIT_K_MAX_M`` rows ``tl.dot`` tiles with a K split keep
every SM streaming. From there to ``MAX_M`` rows the K split and its second launch
lose; what wins is one wave: at most one program an SM, each streaming whole-K
``[32, 256]`` weight tiles four deep (``[64, 128]`` five deep when N needs wider
tiles to fit one wave), so every SM reads one equal share and no program waits for
a second round. Wider projections (gate_up, the LM head) take no single wave and
stay with cuBLAS; a gated MLP's gate_up runs ``gate_up_silu.py`` instead. These
rows take the kernel only on the GPUs whose ``tuning.GpuTuning`` says so (the tiles
need 160-192 KB of shared memory, and a decode step gained only on some GPUs).
Figures: ``docs/perf/TUNING.md``.

For one row the GEMV also computes its input from what the step's previous
kernel wrote, so that input costs no launch of its own:

- ``silu_and_mul_linear``: ``silu(gate) * up`` from a gated MLP's gate | up
  halves, rounded as ``activation.py`` rounds (bitwise the two kernels' result);
- ``rms_norm_linear``: a decoder layer's add-norm. Each program adds the
  residual to its tiles of x (rounded as ``rmsnorm.py`` does; the first program
  hands the sum on), multiplies them by the norm's weight, and sums their
  squares beside the products; ``1 / rms`` scales its outputs after the loop. So
  no program reads the row twice or waits for it before the weight streams, but
  the normed row is not rounded to x's dtype before the matmul as the two
  kernels round it (a fraction of a percent of the largest output apart, in bf16).

With ``tl.dot`` tiles, computing either input on load stopped the loads'
pipelining, and norming the row before the loop cost each program a wait; neither
is used above one row.

Weight rows past N are not masked on load: they re-read row ``N - 1`` (always
in bounds) and are dropped on store, so loads stay unmasked when
``K % BLOCK_K == 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitserve.kernels.triton.activation import silu_and_mul
from splitserve.kernels.triton.device import sm_count
from splitserve.kernels.triton.linear_tiles import (
    MAX_M,
    SPLIT_K_MAX_M,
    LinearConfig,
    default_config,
)
from splitserve.kernels.triton.pdl import launch_options, loop_done, wait_previous_kernel
from splitserve.kernels.triton.rmsnorm import rms_norm
from splitserve.kernels.tuning import INTERPRETER_SMS, medium_batch_kernels

DTYPES = (torch.bfloat16, torch.float16)
REDUCE_BLOCK = 1024


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K], unit stride along K (ACT: [M, 2K], gate | up)
    w_ptr,  # [N, K], unit stride along K
    b_ptr,  # [N] or a placeholder
    out_ptr,  # [M, N] in x's dtype, or with PARTIAL [split_k, M, N] float32 partial sums
    residual_ptr,  # NORM == 2: [1, K], added to x before the norm
    norm_w_ptr,  # NORM: [K], the RMSNorm weight
    residual_out_ptr,  # NORM == 2: [1, K], x + residual
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    split_k,
    eps,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split_k > 1
    ACT: tl.constexpr,  # the input is silu(gate) * up of x's halves (one row)
    NORM: tl.constexpr,  # 1: the input is rms_norm(x); 2: rms_norm(x + residual) (one row)
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
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)  # NORM: per-lane sums of x^2
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
            k_ok = offs_k < K - k
            x = _load(x_ptrs + k, k_ok, EVEN_K)
            if ACT:  # as activation.py: silu(gate) rounded, then times up
                up = _load(x_ptrs + K + k, k_ok, EVEN_K).to(tl.float32)
                g = x.to(tl.float32)
                x = ((g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32) * up).to(x.dtype)
            if NORM == 2:  # as rmsnorm.py: the sum rounded; the first program hands it on
                r = _load(residual_ptr + offs_k + k, k_ok, EVEN_K)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
                if pid_n == 0:
                    tl.store(residual_out_ptr + offs_k + k, x, mask=k_ok)
            x = x.to(tl.float32)
            if NORM:  # weight * x now, 1 / rms(x) after the loop
                squares += x * x
                x *= _load(norm_w_ptr + offs_k + k, k_ok, EVEN_K).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
    loop_done(PDL)
    if USE_DOT:
        sums = acc
    else:
        sums = tl.sum(acc, axis=1)[None, :]
        if NORM:
            sums *= 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)

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


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """``ptrs``' values; unless ``EVEN``, 0 where ``mask`` is false."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


def supported(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k: int | None = None
) -> bool:
    """Whether ``linear`` runs the kernel (else ``F.linear``): 1 to ``SPLIT_K_MAX_M`` rows,
    or up to ``MAX_M`` where one wave covers N (``one_wave``); bf16 / fp16 throughout, a
    2-D contiguous weight and a contiguous bias. ``k``: the matmul's K when x holds more
    per row (the gate and up halves of ``silu_and_mul_linear``)."""
    width = x.shape[-1] if x.dim() else 0
    m = x.numel() // width if width else 0
    return (
        1 <= m <= MAX_M
        and (m <= SPLIT_K_MAX_M or one_wave(x.device, weight.shape[0]))
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == (width if k is None else k)
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


def silu_and_mul_linear(
    x: torch.Tensor,  # [..., 2K]: gate | up
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:  # [..., N]
    """``linear(silu_and_mul(x), weight, bias)``; for one row one kernel that computes
    the activation as it loads its input (no launch, no buffer of its own)."""
    if x.shape[-1] % 2:
        raise ValueError(f"x must hold gate | up halves; got an odd last dim {x.shape[-1]}")
    k = x.shape[-1] // 2
    gemv = x.numel() == 2 * k and (config is None or not config.use_dot)
    if not (gemv and supported(x, weight, bias, k=k)):
        return linear(silu_and_mul(x), weight, bias, config)
    return small_m_linear(x, weight, bias, config, gated=True)


def rms_norm_linear(
    x: torch.Tensor,  # [..., K]
    residual: torch.Tensor | None,  # like x
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
    next_starts_at_once: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., N], [..., K]
    """``(linear(rms_norm(x + residual)), x + residual)`` (without ``residual``: of x, and
    x). For one row one kernel: each program norms the row for itself as it streams it
    (the module docstring), and the first stores the sum; ``rmsnorm.py`` otherwise.
    ``next_starts_at_once``: as ``small_m_linear``'s, for the one-row kernel."""
    k = x.shape[-1]
    fused = (
        supported(x, weight, bias)
        and x.numel() == k
        and (config is None or (not config.use_dot and config.split_k == 1))
        and norm_weight.shape == (k,)
        and norm_weight.dtype == x.dtype
        and norm_weight.is_contiguous()
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
    )
    if not fused:
        if residual is None:
            return linear(rms_norm(x, norm_weight, eps), weight, bias, config), x
        normed, residual = rms_norm(x, norm_weight, eps, residual)
        return linear(normed, weight, bias, config), residual
    residual_out = x if residual is None else torch.empty_like(x)
    norm = (residual, norm_weight, eps, residual_out)
    out = small_m_linear(
        x, weight, bias, config, norm=norm, next_starts_at_once=next_starts_at_once
    )
    return out, residual_out


def small_m_linear(
    x: torch.Tensor,  # [..., K] (gated: [..., 2K])
    weight: torch.Tensor,  # [N, K], unit stride along K
    bias: torch.Tensor | None = None,  # [N]
    config: LinearConfig | None = None,
    gated: bool = False,
    norm: tuple | None = None,  # (residual or None, norm weight, eps, residual out): one row
    next_starts_at_once: bool = False,
) -> torch.Tensor:  # [..., N]
    """The kernel at any row count, with ``config`` or ``default_config``'s tiles; the
    input computed on load as ``silu_and_mul_linear`` and ``rms_norm_linear`` describe.

    ``next_starts_at_once``: let the next kernel launch as this one starts, not after its
    main loop (``pdl.py``); for a kernel that has work to do before its wait (split-KV
    attention at one request loads its first KV tile)."""
    *lead, width = x.shape
    k = width // 2 if gated else width
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(
            f"weight must be [N, {k}] with unit stride along K to fit x [..., {width}]; "
            f"got shape {tuple(weight.shape)}, strides {weight.stride()}"
        )
    x2 = _rows(x, width)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return F.linear(x, weight, bias) if k == 0 else out.view(*lead, n)
    cfg = config or default_config(m, n, k, sm_count(x.device, off_gpu=INTERPRETER_SMS))
    if (gated or norm is not None) and (m != 1 or cfg.use_dot or (norm and cfg.split_k > 1)):
        raise ValueError(
            f"the fused activation and norm run on the one-row GEMV (the norm without a K "
            f"split); got {m} rows, {cfg}"
        )
    residual, norm_weight, eps, residual_out = norm or (None, None, 0.0, None)
    has_bias, partial = bias is not None, cfg.split_k > 1
    b = bias if has_bias else out  # placeholders where there is none: never read
    dest = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if partial else out
    _linear_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x2, weight, b, dest, out if residual is None else _rows(residual, k),
        out if norm_weight is None else norm_weight, out if residual is None else residual_out,
        m, n, k, x2.stride(0), weight.stride(0), cfg.split_k, eps, HAS_BIAS=has_bias,
        PARTIAL=partial, ACT=gated, NORM=0 if norm is None else 1 + (residual is not None),
        BLOCK_M=cfg.block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot, EVEN_K=k % cfg.block_k == 0,
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(
            x.device, starts_early=True, lets_next_start=next_starts_at_once,
            after_loop=not next_starts_at_once,
        ),
    )  # fmt: skip
    if partial:
        _split_k_sum_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            dest, b, out, m, n, cfg.split_k, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK,
            num_warps=4,
            **launch_options(x.device, starts_early=False, lets_next_start=True),
        )  # fmt: skip
    return out.view(*lead, n)


def one_wave(device: torch.device, n: int) -> bool:
    """Whether ``n`` weight rows fit one wave of ``[64, K]`` tiles, one program an SM, on
    a ``device`` that takes the medium-batch kernels (``tuning.GpuTuning``; the CPU
    interpreter stands in with ``INTERPRETER_SMS`` SMs)."""
    if not medium_batch_kernels(device):
        return False
    return triton.cdiv(n, 64) <= sm_count(device, off_gpu=INTERPRETER_SMS)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]`` with unit stride along the row (a view when possible)."""
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
