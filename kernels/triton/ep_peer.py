"""DECODE-mode dispatch and combine through memory the ranks of one host share
(``workers/parallel/peer_memory.py``); references: ``splitserve.kernels.ep_rows``
(``send_rows``, ``pull_rows``, ``sum_peer_parts``).

Every rank has one buffer the others opened through CUDA IPC; ``bases`` (int64, on
the device) holds each rank's buffer address, and the kernels turn an address plus a
byte offset into a pointer. A buffer holds the rank's barrier flags, how many rows it
sends each rank, its send rows (rank ``d``'s at ``d * C ..``) and its experts' partial
sums (in the order of the rows it received). The ranks never write into each other's
rows; they read them, after a barrier. A layer is seven launches besides the experts
(the two of ``send_rows``, two barriers, the read, the copy of the experts' sums into
the rank's buffer, the sum):

- ``send_rows``: the row numbering (one program) also writes how many rows go to
  each rank; then a program per (token, rank) writes the row. Rows past a rank's
  count are not touched (no padding fill).
- ``barrier`` (one program; twice a layer): it counts its own calls (``counter``: the
  epoch), writes the epoch into its flag in every rank's buffer (release, system
  scope) and spins until every rank's flag in its own buffer reached it (acquire).
  (Every program of the read meeting the others instead was slower from 128 tokens
  a rank: 45.9 against 43.6 us.)
- ``pull_rows``: a program per received row reads rank ``s``'s row ``r * C + p`` into
  row ``s * C + p``; a place past ``s``'s count for this rank is padding: ids -1,
  every other byte 0xFF, as the reference's buffer.
- ``sum_peer_parts``: a program per token and column block adds, in float32, rank by
  rank, rank ``d``'s partial sum of the token, read from ``d``'s buffer at row
  ``r * C + p`` (``p``: the token's place among the rows it sent ``d``).

Every rank runs the same layers in the same order (the group steps in lockstep), so
the epochs meet; a CUDA graph replays the launches like any others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.ep_rows import PeerOffsets, RowLayout
from splitserve.kernels.triton import ep_rows as rows

WORDS = 512  # int32 words a program copies per step


@triton.jit
def _address(bases_ptr, rank, offset):
    """Rank ``rank``'s buffer address plus ``offset`` bytes, as an int64."""
    return tl.load(bases_ptr + rank) + offset


@triton.jit
def _barrier_kernel(
    bases_ptr,  # [RANKS] int64 buffer addresses
    counter_ptr,  # [1] int64: this rank's barriers so far
    rank,
    flags_offset,  # bytes from a buffer's start to its RANKS int64 flags
    RANKS: tl.constexpr,
):
    epoch = tl.load(counter_ptr) + 1
    tl.store(counter_ptr, epoch)
    for d in tl.static_range(RANKS):
        theirs = _address(bases_ptr, d, flags_offset).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(theirs + rank, epoch, sem="release", scope="sys")
    mine = _address(bases_ptr, rank, flags_offset).to(tl.pointer_type(tl.int64))
    for d in tl.static_range(RANKS):
        seen = tl.atomic_add(mine + d, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(mine + d, 0, sem="acquire", scope="sys")


@triton.jit
def _pull_rows_kernel(
    bases_ptr,  # [RANKS] int64 buffer addresses
    out_ptr,  # [RANKS * capacity, ROW_WORDS] int32 view of the received rows
    rank,
    capacity,
    counts_offset,  # bytes from a buffer's start to its RANKS int32 counts of rows sent
    send_offset,  # ... to its send rows
    HIDDEN_WORDS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # the received row: source s, place p
    s = i // capacity
    p = i % capacity
    count = tl.load(_address(bases_ptr, s, counts_offset).to(tl.pointer_type(tl.int32)) + rank)
    read = tl.where(p < count, ROW_WORDS, 0)  # words worth reading: a padding row's none
    row_offset = send_offset + (rank * capacity + p) * (ROW_WORDS * 4)
    src = _address(bases_ptr, s, row_offset).to(tl.pointer_type(tl.int32))
    dst = out_ptr + i * ROW_WORDS
    for w0 in range(0, HIDDEN_WORDS, WORDS):
        w = w0 + tl.arange(0, WORDS)
        words = tl.load(src + w, mask=w < read, other=-1)
        tl.store(dst + w, words, mask=w < HIDDEN_WORDS)
    k = HIDDEN_WORDS + tl.arange(0, BLOCK_TAIL)  # ids, then weights
    tail = tl.load(src + k, mask=k < read, other=-1)
    tl.store(dst + k, tail, mask=k < ROW_WORDS)


@triton.jit
def _sum_peer_parts_kernel(
    bases_ptr,  # [RANKS] int64 buffer addresses
    row_ptr,  # [T, RANKS] int64: the row of rank d's part in this rank's send rows
    out_ptr,  # [T, hidden]
    rank,
    capacity,
    parts_offset,  # bytes from a buffer's start to its float32 partial sums
    hidden,
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
        theirs = rank * capacity + (row - d * capacity)  # where d keeps the token's part
        offset = parts_offset + tl.where(sent, theirs, 0) * hidden * 4
        parts = _address(bases_ptr, d, offset).to(tl.pointer_type(tl.float32))
        acc += tl.load(parts + h, mask=h < tl.where(sent, hidden, 0), other=0.0)
    tl.store(out_ptr + t * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def send_rows(
    send: torch.Tensor,  # uint8 [N * C, row bytes]: this rank's send rows
    counts: torch.Tensor,  # int32 [N]: the rows it sends each rank
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    experts_per_rank: int,
    capacity: int,
) -> torch.Tensor:
    """Write this rank's send rows (as ``ep_rows.send_rows``, rows past each rank's count
    untouched) and their counts; returns ``row [T, N]``."""
    args = (hidden, topk_ids, topk_weights, slot_mapping, experts_per_rank, counts.numel())
    return rows.write_rows(send, *args, capacity, counts=counts)


def barrier(bases: torch.Tensor, counter: torch.Tensor, rank: int, offsets: PeerOffsets) -> None:
    """Wait on the device until every rank reached its barrier of the same count."""
    _barrier_kernel[(1,)](bases, counter, rank, offsets.flags, RANKS=bases.numel(), num_warps=1)


def pull_rows(
    bases: torch.Tensor, rank: int, capacity: int, offsets: PeerOffsets, layout: RowLayout
) -> torch.Tensor:
    """``uint8 [N * C, row bytes]``: the rows every rank's send rows hold for ``rank``."""
    ranks = bases.numel()
    out = torch.empty(ranks * capacity, layout.bytes, dtype=torch.uint8, device=bases.device)
    _pull_rows_kernel[(ranks * capacity,)](
        bases, out.view(torch.int32), rank, capacity, offsets.counts, offsets.send,
        HIDDEN_WORDS=layout.hidden_bytes // 4, ROW_WORDS=layout.bytes // 4, WORDS=WORDS,
        BLOCK_TAIL=triton.next_power_of_2(2 * layout.top_k),
    )  # fmt: skip
    return out


def sum_peer_parts(
    bases: torch.Tensor,
    row: torch.Tensor,  # [T, N] from ``send_rows``
    rank: int,
    capacity: int,
    offsets: PeerOffsets,
    hidden: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[T, hidden]``: each token's parts from every rank summed in float32, rank by
    rank."""
    num_tokens, ranks = row.shape
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=row.device)
    if num_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_peer_parts_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        bases, row, out, rank, capacity, offsets.parts, hidden, RANKS=ranks, BLOCK_H=block_h,
    )  # fmt: skip
    return out
