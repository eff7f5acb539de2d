"""The kernels the model layers call: Triton on CUDA tensors, the torch reference otherwise.

Each op has one signature, shared by its reference (``kernels/<name>.py``) and
its Triton version (``kernels/triton/<name>.py``); the device of the op's first
tensor picks the implementation, so CPU results are exactly the reference's.
Triton modules are imported on the first CUDA call (``_triton``): a CPU-only
process never imports triton.

On CUDA every op launches kernels only: no host sync, and every output and
scratch buffer is sized from the input shapes (MoE: from ``num_tokens * top_k``
and the expert count, never from the routing). A forward built from these ops
can be captured in a CUDA graph, whole or in pieces between attention calls.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from splitserve.kernels import activation, ep_rows, kv_store, moe_routing, rmsnorm, rotary, tuning
from splitserve.kernels import argmax as greedy
from splitserve.kernels import decode_inputs as staging
from splitserve.kernels import fused_moe as moe
from splitserve.kernels import linear as dense
from splitserve.kernels import qk_norm_rope as norm_rope


def use_triton(x: torch.Tensor | torch.device) -> bool:
    """Whether ops on tensors like ``x`` (or on the device ``x``) run the Triton kernels."""
    return x.type == "cuda" if type(x) is torch.device else x.is_cuda


@functools.cache
def _triton() -> SimpleNamespace:
    """The Triton kernel modules, imported at the first CUDA call: a CPU-only process
    never imports triton."""
    from splitserve.kernels.triton import activation as t_activation
    from splitserve.kernels.triton import argmax as t_argmax
    from splitserve.kernels.triton import decode_inputs as t_decode_inputs
    from splitserve.kernels.triton import ep_rows as t_ep_rows
    from splitserve.kernels.triton import fused_moe as t_fused_moe
    from splitserve.kernels.triton import gate_up_silu as t_gate_up_silu
    from splitserve.kernels.triton import kv_store as t_kv_store
    from splitserve.kernels.triton import linear as t_linear
    from splitserve.kernels.triton import moe_routing as t_moe_routing
    from splitserve.kernels.triton import qk_norm_rope as t_qk_norm_rope
    from splitserve.kernels.triton import rmsnorm as t_rmsnorm
    from splitserve.kernels.triton import rotary as t_rotary

    return SimpleNamespace(
        activation=t_activation,
        argmax=t_argmax,
        decode_inputs=t_decode_inputs,
        ep_rows=t_ep_rows,
        fused_moe=t_fused_moe,
        gate_up_silu=t_gate_up_silu,
        kv_store=t_kv_store,
        linear=t_linear,
        moe_routing=t_moe_routing,
        qk_norm_rope=t_qk_norm_rope,
        rmsnorm=t_rmsnorm,
        rotary=t_rotary,
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)``; with ``residual``: ``(rms_norm(x + residual), x + residual)``."""
    kernels = _triton().rmsnorm if use_triton(x) else rmsnorm
    return kernels.rms_norm(x, weight, eps, residual)


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # NHD [blocks, block_size, heads, dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 skips the row
) -> None:
    """Write each token's K/V at its slot (reshape-and-cache); slot -1 is skipped."""
    kernels = _triton().kv_store if use_triton(k) else kv_store
    kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)


def store_kv_fp8(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # float8_e4m3fn NHD [blocks, block_size, heads, dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 skips the row
    k_scale: torch.Tensor,  # [1] float32, 0 = not calibrated yet; set by the first store
    v_scale: torch.Tensor,
    calibrated: bool = False,  # both scales known > 0: skip the amax pass
) -> None:
    """``store_kv`` into an FP8 cache, quantized with per-tensor scales (``kv_store.py``)."""
    kernels = _triton().kv_store if use_triton(k) else kv_store
    kernels.store_kv_fp8(
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, calibrated=calibrated
    )


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_position, rotary_dim] (neox layout)
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the cache rows of ``positions`` (partial when rotary_dim < head_dim)."""
    kernels = _triton().rotary if use_triton(q) else rotary
    return kernels.rotary_embedding(positions, q, k, cos_cache, sin_cache)


def qk_norm_rope(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,
    eps: float,
    cos_cache: torch.Tensor,  # [max_position, rotary_dim] (neox layout)
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding`` of the per-head ``rms_norm`` of q and k; new contiguous outputs."""
    kernels = _triton().qk_norm_rope if use_triton(q) else norm_rope
    return kernels.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos_cache, sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim."""
    kernels = _triton().activation if use_triton(x) else activation
    return kernels.silu_and_mul(x)


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32, topk_ids int64)``, both ``[num_tokens, top_k]``."""
    kernels = _triton().moe_routing if use_triton(router_logits) else moe_routing
    return kernels.softmax_topk(router_logits, top_k, renormalize)


def noaux_tc_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped sigmoid routing; ``(topk_weights float32, topk_ids int64)``."""
    kernels = _triton().moe_routing if use_triton(router_logits) else moe_routing
    return kernels.noaux_tc_topk(
        router_logits,
        correction_bias,
        top_k,
        n_group,
        topk_group,
        renormalize,
        routed_scaling_factor,
    )


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    skip_negative_ids: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Every token through its top-k experts, weighted and summed.

    On CUDA: the block-padded layout of ``kernels/moe_align.py`` (at most
    ``num_tokens * top_k + num_experts * (block_m - 1)`` rows) and two grouped GEMMs.
    ``skip_negative_ids``: an id of -1 is a choice computed elsewhere (expert
    parallelism) and adds nothing. ``out_dtype``: the sum's dtype (None: the hidden
    states'; an expert-parallel rank's part is float32, rounded once after combine).
    """
    kernels = _triton().fused_moe if use_triton(hidden) else moe
    return kernels.fused_moe(
        hidden, w13, w2, topk_weights, topk_ids,
        skip_negative_ids=skip_negative_ids, out_dtype=out_dtype,
    )  # fmt: skip


def ep_send_rows(
    hidden: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, top_k] global expert ids
    topk_weights: torch.Tensor,  # [T, top_k]
    slot_mapping: torch.Tensor | None,  # [T]; -1: padding, not sent
    experts_per_rank: int,
    ranks: int,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert parallelism, DECODE mode: the fixed-capacity send buffer ``[N * C, row
    bytes]`` and where each token went, ``row [T, N]`` (``kernels/ep_rows.py``)."""
    kernels = _triton().ep_rows if use_triton(hidden) else ep_rows
    args = (hidden, topk_ids, topk_weights, slot_mapping, experts_per_rank, ranks, capacity)
    return kernels.send_rows(*args)


def ep_count_choices(counts: torch.Tensor, ids: torch.Tensor) -> None:
    """Expert parallelism: add each local expert's choices in ``ids`` (-1: none) to
    ``counts``, without a host sync (one launch on CUDA)."""
    kernels = _triton().ep_rows if use_triton(ids) else ep_rows
    kernels.count_choices(counts, ids)


def ep_sum_rows(
    back: torch.Tensor, row: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Expert parallelism, DECODE mode: each token's returned rows summed in float32,
    in ``out_dtype`` (None: ``back``'s)."""
    kernels = _triton().ep_rows if use_triton(back) else ep_rows
    return kernels.sum_rows(back, row, out_dtype)


def linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    """``x @ weight.T + bias``. On CUDA: a weight-streaming kernel for up to 16 rows
    (decode) in bf16 / fp16, on the GPUs that take the medium-batch kernels
    (``tuning.py``) also up to 64 where the weight fits one wave
    (``triton.linear.one_wave``), ``F.linear`` (cuBLAS) for anything else."""
    kernels = _triton().linear if use_triton(x) else dense
    return kernels.linear(x, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor,  # [..., 2K]: gate | up
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [..., N]
    """``linear(silu_and_mul(x), weight, bias)``; on CUDA one kernel for one row."""
    kernels = _triton().linear if use_triton(x) else dense
    return kernels.silu_and_mul_linear(x, weight, bias)


def linear_silu_and_mul(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [2D, K]: gate | up
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [..., D]
    """``silu_and_mul(linear(x, weight, bias))``; on CUDA one kernel for 17 to 64 rows
    (``activation_in_gate_up``)."""
    kernels = _triton().gate_up_silu if use_triton(x) else dense
    return kernels.linear_silu_and_mul(x, weight, bias)


def activation_in_gate_up(num_rows: int, device: torch.device) -> bool:
    """Whether a gated MLP of ``num_rows`` rows on ``device`` runs its SiLU-and-mul inside
    the gate_up projection (``linear_silu_and_mul``, one kernel) rather than inside or
    before the down projection (``silu_and_mul_linear``): 17 to 64 rows, on the GPUs
    that take the medium-batch kernels (``tuning.py``). A step's plan asks once a step
    (``workers/runner/step_plan.py``)."""
    return (
        tuning.SMALL_BATCH_ROWS < num_rows <= tuning.MEDIUM_BATCH_ROWS
        and use_triton(device)
        and tuning.medium_batch_kernels(device)
    )


def rms_norm_linear(
    x: torch.Tensor,  # [..., K]
    residual: torch.Tensor | None,  # like x
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    next_starts_at_once: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., N], [..., K]
    """``(linear(rms_norm(x + residual)), x + residual)``, or of x alone without a
    residual; on CUDA one kernel for one row (a decode step of one request), which with
    ``next_starts_at_once`` lets the next kernel launch as it starts (``pdl.py``)."""
    if not use_triton(x):
        return dense.rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    return _triton().linear.rms_norm_linear(
        x, residual, norm_weight, eps, weight, bias, next_starts_at_once=next_starts_at_once
    )


def argmax(
    logits: torch.Tensor,  # [rows, vocab]
    host_out: torch.Tensor | None = None,  # [rows] int64 on the host
) -> torch.Tensor:  # [rows] int64
    """Greedy tokens: each row's first largest index (NaN largest), also into
    ``host_out`` where given. On CUDA one launch that stores the tokens into
    ``host_out`` itself (page-locked memory the GPU maps): no copy to the host."""
    kernels = _triton().argmax if use_triton(logits) else greedy
    return kernels.argmax(logits, host_out)


def stage_decode_inputs(
    staged: torch.Tensor,  # [n, STAGED_COLUMNS + width] int32 (page-locked on CUDA)
    previous: torch.Tensor | None,  # [rows] int64: the tokens of the step in flight
    input_ids: torch.Tensor,  # [size] int64, a decode graph's static buffers from here on
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor | None = None,  # [size] int32
    block_tables: torch.Tensor | None = None,  # [size, >= width] int32
    pad_seq_len: int = 1,
) -> None:
    """A decode step's packed rows and padding into a decode graph's static buffers
    (``decode_inputs.py``); on CUDA one launch that reads the rows from mapped host
    memory: no copy launches."""
    kernels = _triton().decode_inputs if use_triton(input_ids) else staging
    kernels.stage_decode_inputs(
        staged, previous, input_ids, positions, slot_mapping, seq_lens, block_tables, pad_seq_len
    )
