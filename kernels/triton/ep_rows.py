"""Triton DECODE-mode send rows and their sum; reference: ``splitserve.kernels.ep_rows``.

``send_rows`` is three launches whatever the batch: the buffer filled with 0xFF, one
program that walks the tokens in chunks and gives each (token, rank) its row (a
running count per rank, as the reference's cumsum), and a program per (token, rank)
that writes the row: the hidden state as int32 words, then the ids in the
receiver's numbering and the weights. ``sum_rows`` is one launch: a program per
token and column block adds the ranks' rows in float32, rank by rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.ep_rows import PAD_BYTE, RowLayout

CHUNK = 64  # tokens per step of the row-numbering program
WORDS = 512  # int32 words a program copies per step


@triton.jit
def _number_rows_kernel(
    ids_ptr,  # [T, TOP_K]
    slots_ptr,  # [T] or a dummy
    row_ptr,  # [T, RANKS] int64
    counts_ptr,  # PEER: [RANKS] int32, the rows sent each rank (else a dummy)
    num_tokens,
    experts_per_rank,
    capacity,
    HAS_SLOTS: tl.constexpr,
    TOP_K: tl.constexpr,
    RANKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr,
    PEER: tl.constexpr = False,
):
    ranks = tl.arange(0, BLOCK_R)
    seen = tl.zeros([BLOCK_R], dtype=tl.int32)  # tokens each rank got in earlier chunks
    for first in range(0, num_tokens, CHUNK):
        t = first + tl.arange(0, CHUNK)
        t_ok = t < num_tokens
        sends = tl.zeros([CHUNK, BLOCK_R], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + t.to(tl.int64) * TOP_K + j, mask=t_ok, other=-1).to(tl.int64)
            owner = tl.where(e >= 0, e // experts_per_rank, -1)
            sends = sends | (owner[:, None] == ranks[None, :]).to(tl.int32)
        if HAS_SLOTS:
            live = tl.load(slots_ptr + t, mask=t_ok, other=-1) >= 0
            sends = sends * live[:, None].to(tl.int32)
        keep = t_ok[:, None] & (ranks < RANKS)[None, :]
        sends = tl.where(keep, sends, 0)
        place = tl.cumsum(sends, axis=0) - sends + seen[None, :]
        row = tl.where(sends > 0, ranks[None, :] * capacity + place, RANKS * capacity)
        dst = row_ptr + t[:, None].to(tl.int64) * RANKS + ranks[None, :]
        tl.store(dst, row.to(tl.int64), mask=keep)
        seen += tl.sum(sends, axis=0)
    if PEER:  # the ranks' shared buffers (``ep_peer.py``): what the readers need
        tl.store(counts_ptr + ranks, seen, mask=ranks < RANKS)


@triton.jit
def _write_rows_kernel(
    hidden_ptr,  # [T, HIDDEN_WORDS] int32 view of the hidden states
    ids_ptr,  # [T, TOP_K]
    weights_ptr,  # [T, TOP_K] float32
    row_ptr,  # [T, RANKS] int64
    out_ptr,  # [RANKS * capacity, ROW_WORDS] int32 view of the buffer
    experts_per_rank,
    capacity,
    hidden_stride,  # words between two hidden rows
    HIDDEN_WORDS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RANKS: tl.constexpr,
    WORDS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1)
    row = tl.load(row_ptr + t * RANKS + d)
    if row >= RANKS * capacity:
        return
    dst = out_ptr + row * ROW_WORDS
    for w0 in range(0, HIDDEN_WORDS, WORDS):
        w = w0 + tl.arange(0, WORDS)
        words = tl.load(hidden_ptr + t * hidden_stride + w, mask=w < HIDDEN_WORDS)
        tl.store(dst + w, words, mask=w < HIDDEN_WORDS)
    k = tl.arange(0, BLOCK_K)
    k_ok = k < TOP_K
    e = tl.load(ids_ptr + t * TOP_K + k, mask=k_ok, other=-1).to(tl.int64)
    first = d * experts_per_rank
    here = (e >= first) & (e < first + experts_per_rank)
    weight = tl.load(weights_ptr + t * TOP_K + k, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(dst + HIDDEN_WORDS + k, tl.where(here, e - first, -1).to(tl.int32), mask=k_ok)
    weight = tl.where(here, weight, 0.0)
    tl.store(dst + HIDDEN_WORDS + TOP_K + k, weight.to(tl.int32, bitcast=True), mask=k_ok)


@triton.jit
def _count_choices_kernel(
    counts_ptr,  # [E] int64
    ids_ptr,  # [rows, TOP_K], row stride ids_stride
    num_rows,
    ids_stride,
    TOP_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    k = tl.arange(0, BLOCK_K)
    ok = (r < num_rows)[:, None] & (k < TOP_K)[None, :]
    e = tl.load(ids_ptr + r[:, None].to(tl.int64) * ids_stride + k[None, :], mask=ok, other=-1)
    here = e >= 0
    tl.atomic_add(counts_ptr + tl.where(here, e, 0), tl.full(e.shape, 1, tl.int64), mask=here)


@triton.jit
def _sum_rows_kernel(
    back_ptr,  # [RANKS * capacity, H]
    row_ptr,  # [T, RANKS] int64
    out_ptr,  # [T, H]
    hidden,
    capacity,
    RANKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for d in tl.static_range(RANKS):
        row = tl.load(row_ptr + t * RANKS + d)
        sent = row < RANKS * capacity
        part = tl.load(back_ptr + tl.minimum(row, RANKS * capacity - 1) * hidden + h, mask=h_ok)
        acc += tl.where(sent, part.to(tl.float32), 0.0)
    tl.store(out_ptr + t * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def send_rows(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    experts_per_rank: int,
    ranks: int,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``ep_rows.send_rows``."""
    layout = RowLayout(hidden.shape[-1], topk_ids.shape[-1], hidden.dtype)
    layout.check()
    buffer = torch.full(
        (ranks * capacity, layout.bytes), PAD_BYTE, dtype=torch.uint8, device=hidden.device
    )
    row = write_rows(
        buffer, hidden, topk_ids, topk_weights, slot_mapping, experts_per_rank, ranks, capacity
    )
    return buffer, row


def write_rows(
    buffer: torch.Tensor,  # uint8 [N * C, row bytes]
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    experts_per_rank: int,
    ranks: int,
    capacity: int,
    counts: torch.Tensor | None = None,  # int32 [N]: also write the rows each rank gets
) -> torch.Tensor:
    """Number the rows and write them into ``buffer`` (rows nobody gets untouched);
    ``row [T, N]``. Two launches; with ``counts``, the numbering always runs."""
    num_tokens, top_k = topk_ids.shape
    layout = RowLayout(hidden.shape[-1], top_k, hidden.dtype)
    row = torch.empty(num_tokens, ranks, dtype=torch.long, device=hidden.device)
    if num_tokens == 0 and counts is None:
        return row
    ids = topk_ids.contiguous()
    slots = slot_mapping.contiguous() if slot_mapping is not None else row
    _number_rows_kernel[(1,)](
        ids, slots, row, row if counts is None else counts, num_tokens, experts_per_rank,
        capacity, HAS_SLOTS=slot_mapping is not None, TOP_K=top_k, RANKS=ranks,
        BLOCK_R=triton.next_power_of_2(ranks), CHUNK=CHUNK, PEER=counts is not None,
    )  # fmt: skip
    if num_tokens == 0:
        return row
    words = hidden.to(layout.dtype)
    words = (words if words.stride(-1) == 1 else words.contiguous()).view(torch.int32)
    _write_rows_kernel[(num_tokens, ranks)](
        words, ids, topk_weights.float().contiguous(), row, buffer.view(torch.int32),
        experts_per_rank, capacity, words.stride(0),
        HIDDEN_WORDS=layout.hidden_bytes // 4, ROW_WORDS=layout.bytes // 4, TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k), RANKS=ranks, WORDS=WORDS,
    )  # fmt: skip
    return row


def sum_rows(
    back: torch.Tensor, row: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """As ``ep_rows.sum_rows``."""
    num_tokens, ranks = row.shape
    hidden = back.shape[-1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or back.dtype, device=back.device)
    if num_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (num_tokens, triton.cdiv(hidden, block_h))
    capacity = back.shape[0] // ranks
    _sum_rows_kernel[grid](
        back.contiguous(), row, out, hidden, capacity, RANKS=ranks, BLOCK_H=block_h
    )
    return out


def count_choices(counts: torch.Tensor, ids: torch.Tensor) -> None:
    """As ``ep_rows.count_choices``: one launch."""
    num_rows, top_k = ids.shape
    if num_rows == 0:
        return
    if ids.stride(-1) != 1:
        ids = ids.contiguous()
    block = 64
    _count_choices_kernel[(triton.cdiv(num_rows, block),)](
        counts, ids, num_rows, ids.stride(0), TOP_K=top_k, BLOCK_ROWS=block,
        BLOCK_K=triton.next_power_of_2(top_k),
    )  # fmt: skip
