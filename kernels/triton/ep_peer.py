"""DECODE-mode dispatch and combine through memory the ranks of one host share
(``workers/parallel/peer_memory.py``); references: ``splitserve.kernels.ep_rows``
(``pull_rows``, ``sum_peer_parts``).

Every rank has one buffer the others opened through CUDA IPC; ``bases`` (int64, on
the device) holds each rank's buffer address, and the kernels turn an address plus a
byte offset into a pointer. A buffer holds the rank's barrier flags, its send rows
(``send_rows`` writes them: rank ``d``'s at ``d * C ..``) and its experts' partial
sums (in the order of the rows it received). The ranks never write into each other's
rows; they read them, after a barrier:

- ``barrier``: one program; it counts its own calls (``counter``: the epoch), writes
  the epoch into its flag in every rank's buffer (release, system scope) and spins
  until every rank's flag in its own buffer reached the epoch (acquire). Every rank
  calls it the same number of times (the group steps in lockstep), so the epochs
  meet. A CUDA graph replays it like any kernel.
- ``pull_rows``: a program per received row reads rank ``s``'s row ``r * C + p`` into
  row ``s * C + p``; a row that goes to no expert here (every id -1) brings its ids and
  weights only, and its hidden state is 0xFF bytes, as the send buffer's padding.
- ``sum_peer_parts``: a program per token and column block adds, in float32, rank by
  rank, rank ``d``'s partial sum of the token, read from ``d``'s buffer at row
  ``r * C + p`` (``p``: the token's place among the rows it sent ``d``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.ep_rows import RowLayout

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
    send_offset,  # bytes from a buffer's start to its send rows
    HIDDEN_WORDS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    WORDS: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # the received row: source s, place p
    s = i // capacity
    p = i % capacity
    row_offset = send_offset + (rank * capacity + p) * (ROW_WORDS * 4)
    src = _address(bases_ptr, s, row_offset).to(tl.pointer_type(tl.int32))
    dst = out_ptr + i * ROW_WORDS
    k = tl.arange(0, BLOCK_TAIL)
    k_ok = k < 2 * TOP_K
    tail = tl.load(src + HIDDEN_WORDS + k, mask=k_ok)  # ids, then weights
    tl.store(dst + HIDDEN_WORDS + k, tail, mask=k_ok)
    used = tl.max(tl.where(k < TOP_K, tail, -1), axis=0) >= 0
    read = tl.where(used, HIDDEN_WORDS, 0)  # words worth reading: a padding row's none
    for w0 in range(0, HIDDEN_WORDS, WORDS):
        w = w0 + tl.arange(0, WORDS)
        words = tl.load(src + w, mask=w < read, other=-1)
        tl.store(dst + w, words, mask=w < HIDDEN_WORDS)


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


def barrier(bases: torch.Tensor, counter: torch.Tensor, rank: int, flags_offset: int) -> None:
    """Wait on the device until every rank reached its barrier of the same count."""
    _barrier_kernel[(1,)](bases, counter, rank, flags_offset, RANKS=bases.numel(), num_warps=1)


def pull_rows(
    bases: torch.Tensor, rank: int, capacity: int, send_offset: int, layout: RowLayout
) -> torch.Tensor:
    """``uint8 [N * C, row bytes]``: the rows every rank's send buffer holds for ``rank``."""
    ranks = bases.numel()
    out = torch.empty(ranks * capacity, layout.bytes, dtype=torch.uint8, device=bases.device)
    if capacity == 0:
        return out
    _pull_rows_kernel[(ranks * capacity,)](
        bases, out.view(torch.int32), rank, capacity, send_offset,
        HIDDEN_WORDS=layout.hidden_bytes // 4, ROW_WORDS=layout.bytes // 4, TOP_K=layout.top_k,
        BLOCK_TAIL=triton.next_power_of_2(2 * layout.top_k), WORDS=WORDS,
    )  # fmt: skip
    return out


def sum_peer_parts(
    bases: torch.Tensor,
    row: torch.Tensor,  # [T, N] from ``send_rows``
    rank: int,
    capacity: int,
    parts_offset: int,
    hidden: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[T, hidden]``: each token's parts from every rank summed in float32, rank by rank."""
    num_tokens, ranks = row.shape
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=row.device)
    if num_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_peer_parts_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        bases, row, out, rank, capacity, parts_offset, hidden, RANKS=ranks, BLOCK_H=block_h
    )
    return out
