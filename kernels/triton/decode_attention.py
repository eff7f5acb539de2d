"""Triton split-KV paged decode attention; reference: ``splitserve.kernels.decode_attention``.

For small decode batches, where a KV head's context alone cannot fill the GPU:
each request's tokens are cut into ``num_splits`` equal runs (whole tiles of
``BLOCK_N`` tokens, sized on the device from its length), one program per
(request, KV head, split) attends every query head of that KV head's group to
its run, page by page through the block table, with an online softmax, and
writes the normalized partial output and its log-sum-exp. A second launch
merges a query head's partials; with one split a request (a batch whose requests
and KV heads alone give two programs an SM: ``num_splits``) the split kernel writes
the output itself and there is no merge.
With ``new_kv`` the split kernel also stores each request's new K/V row (the
last split's program writes it at its slot), and the program whose run holds
the last token attends that row from its inputs after its tiles of cached
tokens, so no program reads the slot being written: the KV store costs no
launch of its own. The grid depends on the batch size only, so a decode CUDA
graph can be captured once per batch size and replayed for any lengths. A
split with no tokens writes a log-sum-exp of -inf and no weight; a
request with no tokens gets zeros.

With ``norm_rope`` (Qwen3's per-head q/k RMSNorm and rotary) q and the new K
rows come raw from the qkv projection: each program norms and rotates its
group's q rows and the new K row as it loads them, in ``qk_norm_rope.py``'s
rounding steps, so that kernel's launch goes too. The norm's sum may add up in
another order than there (one unit in the last place apart at most). It made small
decode steps faster; at 64 requests (one split) the kernel needs more registers,
fits fewer programs an SM and lost (capped registers, it spilled). So the backend
asks for it up to ``NORM_ROPE_MAX_BATCH`` requests.

At one request with ``new_kv`` each program loads its first tile of cached
tokens before it waits for the previous kernel (``pdl.py``): no kernel of the
step writes those rows. The one-row qkv projection lets this kernel launch as
soon as it starts (``next_starts_at_once``, which a step's plan asks for when
this kernel norms q/k itself: ``StepPlan.qkv_starts_attention``), so the tile's
latency hides behind the projection. Only both together gained: the early launch
alone lost (its programs wait beside the projection), and at eight requests the
preload lost, so it runs at one request only. Figures: ``docs/perf/TUNING.md``.

Tiles (tokens a tile, pipeline stages, warps) come from the tuning table
(``tuning.DecodeTiles``), one for a cache in the model's dtype and one for FP8. An
int64 block table is read as its entries' low int32 words: with int64 loads Triton
compiled a loop 1.38x slower at 64 requests x 8k (``docs/perf/TUNING.md``).

An FP8 cache (``kv_scales``) is read at half the bytes: each tile of K and V is
widened as it is loaded (to float16, q cast to it too, where the tiles say
``fp8_f16_dot`` and q is 16-bit: 1.3x faster than bfloat16 on an H200; both hold e4m3
exactly), K's scale joins the softmax scale and V's multiplies the output; a new row
is stored quantized with the scales and attended as a later step will read it. A
scale still 0 (not calibrated: in practice never in a decode step, whose prompts set
it) is set as ``store_kv_fp8`` sets it: every
program that reads 0 takes the amax over all the step's stored new rows (the same
loop, so the same ``amax / 448``) and program (0, 0, 0) writes it back; a program
that reads it written gets that same value. Rows normed here (``norm_rope``) are
not in that amax: with ``norm_rope`` the caller must have seen the scales set.

The group's query heads are the rows of one ``tl.dot`` (padded to 16 rows):
q and K in their dtype, scores and sums in float32, the probabilities cast to
V's dtype for the second product, as FlashAttention does; float32 inputs
multiply in full float32 (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import tuning
from splitserve.kernels.decode_attention import check_shapes
from splitserve.kernels.triton.device import sm_count
from splitserve.kernels.triton.pdl import launch_options, loop_done, wait_previous_kernel
from splitserve.kernels.triton.qk_norm_rope import norm_rope_rows
from splitserve.kernels.tuning import DecodeTiles

MAX_SPLITS = 32
# Both launches start early (``pdl.py``) up to this batch; at 64 requests that made a
# decode step slower (TUNING.md), for reasons not pinned down.
PDL_MAX_BATCH = 16
NORM_ROPE_MAX_BATCH = 16  # q/k norm and rotary on load up to this batch (module docstring)


@triton.jit
def _load_tile(
    k_cache_ptr,
    v_cache_ptr,
    table,  # the request's block table row
    first,
    end,
    head_off,
    dims,
    dim_ok,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    stride_cache_block,
    stride_cache_offset,
    LOW_WORDS: tl.constexpr,  # an int64 table: read its entries' low int32 words
):
    """K and V of tokens ``[first, first + BLOCK_N)`` below ``end``, through the block table."""
    tokens = first + tl.arange(0, BLOCK_N)
    valid = tokens < end
    if LOW_WORDS:  # block ids < 2**31, little-endian
        low = table.to(tl.pointer_type(tl.int32), bitcast=True)
        block = tl.load(low + 2 * (tokens // BLOCK_SIZE), mask=valid, other=0).to(tl.int64)
    else:
        block = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = block * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_offset + head_off
    kv_mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    return k, v, valid


@triton.jit
def _attend_tile(q, k, v, valid, m, denom, acc, scale, PRECISION: tl.constexpr):
    """One tile's step of the online softmax: the running max, sum and output updated."""
    k, v = k.to(q.dtype), v.to(q.dtype)  # FP8 caches: widened to q's dtype (else as is)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, N] float32
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit
def _quantize(x, scale, dtype):
    """``x`` as an FP8 cache stores it (``kv_store.quantize_fp8``): ``fp8(x / scale)``."""
    scale = tl.where(scale > 0, scale, 1.0)
    return tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0).to(dtype)


@triton.jit
def _new_rows_amax(
    k_new_ptr, v_new_ptr, slot_ptr, batch, stride_kb, stride_kh, stride_vb, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """max |K| and max |V| over the batch's new rows that are stored (slot >= 0)."""
    heads = tl.arange(0, BLOCK_KV)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    k_max = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    v_max = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    for row in range(0, batch):
        written_heads = tl.where(tl.load(slot_ptr + row) >= 0, NUM_KV_HEADS, 0)
        rows = (heads < written_heads) & (dims < HEAD_DIM)
        k = tl.load(k_new_ptr + row * stride_kb + heads * stride_kh + dims, mask=rows, other=0.0)
        v = tl.load(v_new_ptr + row * stride_vb + heads * stride_vh + dims, mask=rows, other=0.0)
        k_max = tl.maximum(k_max, tl.abs(k.to(tl.float32)))
        v_max = tl.maximum(v_max, tl.abs(v.to(tl.float32)))
    return tl.max(tl.max(k_max, axis=1), axis=0), tl.max(tl.max(v_max, axis=1), axis=0)


@triton.jit
def _split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_len_ptr,
    part_out_ptr,  # [batch, num_heads, NUM_SPLITS, HEAD_DIM] float32
    part_lse_ptr,  # [batch, num_heads, NUM_SPLITS] float32
    out_ptr,  # [batch, num_heads, HEAD_DIM]: written here with one split, else by the merge
    stride_ob,
    stride_oh,
    k_new_ptr,  # [batch, num_kv_heads, HEAD_DIM]: the last token's K/V (with NEW_KV)
    v_new_ptr,
    slot_ptr,  # [batch] int, -1: not stored
    k_scale_ptr,  # FP8: [1] float32 K and V scales of the cache (read as float(q) * scale)
    v_scale_ptr,
    pos_ptr,  # NORM_ROPE: [batch] int positions, the q/k norm weights, cos / sin caches
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    stride_sin,
    half,  # rotary_dim // 2
    eps,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_bt,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    NEW_KV: tl.constexpr,
    NORM_ROPE: tl.constexpr,  # q and the new K row: RMS-normed per head and rotated first
    FP8: tl.constexpr,  # the cache holds float8_e4m3fn with a K and a V scale
    CALIBRATE: tl.constexpr,  # FP8 with new rows, not normed here: a scale of 0 is set
    GROUP_KV: tl.constexpr,  # KV heads (for the new rows' amax)
    BLOCK_KV: tl.constexpr,
    PRELOAD: tl.constexpr,  # load the first tile before waiting for the previous kernel
    PDL: tl.constexpr,
    F16_DOT: tl.constexpr,  # FP8: q and the widened tiles in float16 (``DecodeTiles``)
    LOW_WORDS: tl.constexpr,  # an int64 block table read as its low int32 words
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_len_ptr + b).to(tl.int32)
    run = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * run
    end = tl.minimum(start + run, seq_len)
    last = seq_len - 1
    cached_end = tl.minimum(end, last) if NEW_KV else end  # the new row: after the loop
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    head_off = kv_head * stride_cache_head
    if PRELOAD:  # the first tile of cached tokens, which no kernel of this step writes
        k0, v0, valid0 = _load_tile(
            k_cache_ptr, v_cache_ptr, table, start, cached_end, head_off, dims, dim_ok,
            BLOCK_SIZE, BLOCK_N, stride_cache_block, stride_cache_offset, LOW_WORDS,
        )  # fmt: skip
    wait_previous_kernel(PDL)

    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_mask = row_ok[:, None] & dim_ok[None, :]
    if NORM_ROPE:  # as qk_norm_rope.py, in the same rounding steps
        pos = tl.load(pos_ptr + b).to(tl.int64)
        cos_row, sin_row = cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin
        q = norm_rope_rows(
            q_rows, q_mask, dims[None, :], q_norm_ptr, cos_row, sin_row, HEAD_DIM, half, eps,
            q_ptr.dtype.element_ty,
        )  # fmt: skip
    else:
        q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)
    if F16_DOT:  # float16 holds e4m3 and bfloat16's 8 bits of q exactly, within its range
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if FP8:  # K's scale joins the softmax scale; V's scales the output
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        if CALIBRATE:  # noqa: SIM102 - a compile-time branch around a run-time one
            if (k_scale <= 0) | (v_scale <= 0):  # this step's new rows set it (docstring)
                k_amax, v_amax = _new_rows_amax(
                    k_new_ptr, v_new_ptr, slot_ptr, tl.num_programs(0), stride_kb, stride_kh,
                    stride_vb, stride_vh, GROUP_KV, HEAD_DIM, BLOCK_KV, BLOCK_D,
                )  # fmt: skip
                first = (b == 0) & (kv_head == 0) & (split == 0)
                if k_scale <= 0:
                    k_scale = tl.math.div_rn(k_amax, 448.0)
                    if first:
                        tl.store(k_scale_ptr, k_scale)
                if v_scale <= 0:
                    v_scale = tl.math.div_rn(v_amax, 448.0)
                    if first:
                        tl.store(v_scale_ptr, v_scale)
        scale = scale * k_scale
    if NEW_KV:
        k_row = k_new_ptr + b * stride_kb + kv_head * stride_kh
        if NORM_ROPE:
            k_new = norm_rope_rows(
                k_row + tl.arange(0, 1)[:, None], dim_ok[None, :], dims[None, :], k_norm_ptr,
                cos_row, sin_row, HEAD_DIM, half, eps, k_new_ptr.dtype.element_ty,
            )  # fmt: skip
            k_new = tl.reshape(k_new, [BLOCK_D])
        else:
            k_new = tl.load(k_row + dims, mask=dim_ok)
        v_new = tl.load(v_new_ptr + b * stride_vb + kv_head * stride_vh + dims, mask=dim_ok)
        if FP8:  # stored as the store kernel would, and attended as a reader sees it
            k_new = _quantize(k_new, k_scale, k_cache_ptr.dtype.element_ty)
            v_new = _quantize(v_new, v_scale, v_cache_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if (split == NUM_SPLITS - 1) & (slot >= 0):
            dst = (
                (slot // BLOCK_SIZE) * stride_cache_block
                + (slot % BLOCK_SIZE) * stride_cache_offset
                + head_off
                + dims
            )
            tl.store(k_cache_ptr + dst, k_new, mask=dim_ok)
            tl.store(v_cache_ptr + dst, v_new, mask=dim_ok)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    first_tile = start
    if PRELOAD:
        if start < cached_end:  # an empty split attends nothing (all -inf would give NaN)
            m, denom, acc = _attend_tile(q, k0, v0, valid0, m, denom, acc, scale, PRECISION)
        first_tile = start + BLOCK_N
    for first in range(first_tile, cached_end, BLOCK_N):
        k, v, valid = _load_tile(
            k_cache_ptr, v_cache_ptr, table, first, cached_end, head_off, dims, dim_ok,
            BLOCK_SIZE, BLOCK_N, stride_cache_block, stride_cache_offset, LOW_WORDS,
        )  # fmt: skip
        m, denom, acc = _attend_tile(q, k, v, valid, m, denom, acc, scale, PRECISION)
    loop_done(PDL)
    if NEW_KV:  # noqa: SIM102 - a compile-time branch around a run-time one
        if (start <= last) & (last < end):  # this run holds the new row: from the inputs
            score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
            m_new = tl.maximum(m, score)
            p = tl.exp(score - m_new)
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
            m = m_new

    some = denom > 0
    out = acc / tl.where(some, denom, 1.0)[:, None]
    if FP8:
        out = out * v_scale
    lse = tl.where(some, m + tl.log(tl.where(some, denom, 1.0)), float("-inf"))
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:  # the whole context: the output itself (what the merge would write)
        dst = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (b * NUM_HEADS + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < NUM_SPLITS
    first = (b * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + first + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # every split empty: no weight at all
    weight = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
    parts = tl.load(
        part_out_ptr + (first + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per request: enough (request, KV head, split) programs for two per SM, as a
    power of 2 up to ``MAX_SPLITS``; depends on the batch size only (graph-static)."""
    want = -(-2 * num_sms // max(batch * num_kv_heads, 1))
    return min(MAX_SPLITS, triton.next_power_of_2(want))


def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # NHD [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int32 or int64
    seq_lens: torch.Tensor,  # [batch] int32 or int64
    scale: float,
    splits: int | None = None,  # default: ``num_splits`` for this device
    out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # k, v, slots
    norm_rope: tuple | None = None,  # positions, q / k norm weights, eps, cos, sin caches
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8 caches: [1] K, V scales
    tiles: DecodeTiles | None = None,  # default: the tuning table's for this device and cache
) -> torch.Tensor:
    """Attend each request's query row over its paged KV; same result as the reference
    (with ``new_kv``: the new rows stored first; with ``norm_rope``: q and the new K rows
    normed and rotated as they are loaded, as ``qk_norm_rope`` would first; with
    ``kv_scales``: an FP8 cache read as ``float(q) * scale``, and new rows stored with
    those scales, a scale of 0 set from the new rows first as ``store_kv_fp8`` does;
    with ``norm_rope`` too, the scales must be set already: that case never sets them)."""
    check_shapes(q, k_cache, v_cache, block_tables, seq_lens, new_kv, norm_rope, kv_scales)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head_dim and equal cache strides")
    if norm_rope is not None and (
        any(w.dtype != q.dtype for w in norm_rope[1:3])
        or any(c.stride(-1) != 1 for c in norm_rope[4:])
    ):
        raise ValueError("norm_rope needs norm weights in q's dtype and contiguous cos / sin rows")
    if tiles is None:
        tuned = tuning.for_device(q.device)
        tiles = tuned.split_kv_fp8_tiles if kv_scales is not None else tuned.split_kv_tiles
    if splits is None:
        splits = num_splits(batch, num_kv_heads, sm_count(q.device, off_gpu=1))  # CPU: one split
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    part_out = part_lse = out  # one split: the split kernel writes the output itself
    if splits > 1:
        f32 = {"dtype": torch.float32, "device": q.device}
        part_out = torch.empty(batch, num_heads, splits, head_dim, **f32)
        part_lse = torch.empty(batch, num_heads, splits, **f32)
    block_d = triton.next_power_of_2(head_dim)
    stride_block, stride_offset, stride_head, _ = k_cache.stride()
    k_new, v_new, slots = new_kv if new_kv is not None else (k_cache, v_cache, seq_lens)
    # the kernel indexes rows and heads by stride but needs a contiguous head_dim
    k_new, v_new = (x if x.stride(-1) == 1 else x.contiguous() for x in (k_new, v_new))
    # without norm_rope: placeholders the kernel never reads
    positions, q_norm, k_norm, eps, cos, sin = norm_rope or (seq_lens, q, q, 0.0, q, q)
    _split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out, out.stride(0),
        out.stride(1), k_new, v_new, slots, *(kv_scales or (seq_lens, seq_lens)),
        positions, q_norm, k_norm, cos, sin, cos.stride(0), sin.stride(0), cos.shape[-1] // 2,
        eps, scale, q.stride(0), q.stride(1), *k_new.stride()[:2], *v_new.stride()[:2],
        block_tables.stride(0), stride_block, stride_offset, stride_head,
        GROUP=group, NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        NUM_SPLITS=splits, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=tiles.block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NEW_KV=new_kv is not None, NORM_ROPE=norm_rope is not None, FP8=kv_scales is not None,
        CALIBRATE=kv_scales is not None and new_kv is not None and norm_rope is None,
        GROUP_KV=num_kv_heads, BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        F16_DOT=tiles.fp8_f16_dot and kv_scales is not None and q.dtype != torch.float32,
        LOW_WORDS=block_tables.dtype == torch.int64,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        PRELOAD=batch == 1 and new_kv is not None,  # the new row is not among the cached
        **launch_options(
            q.device, starts_early=batch <= PDL_MAX_BATCH, lets_next_start=False,
            after_loop=batch <= PDL_MAX_BATCH,
        ),
    )  # fmt: skip
    if splits == 1:
        return out
    return merge_splits(part_out, part_lse, out)


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` ([batch, num_heads, head_dim]) from the splits' normalized partial outputs
    (``part_out`` [batch, num_heads, splits, head_dim] float32) and their natural-log
    log-sum-exps (``part_lse`` [batch, num_heads, splits], -inf for an empty split)."""
    batch, num_heads, splits, head_dim = part_out.shape
    _merge_kernel[(batch, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
        **launch_options(out.device, starts_early=batch <= PDL_MAX_BATCH, lets_next_start=True),
    )  # fmt: skip
    return out
