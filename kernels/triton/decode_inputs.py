"""Triton decode-graph inputs: a step's packed host rows into the graph's static
buffers in one launch; reference: ``splitserve.kernels.decode_inputs``.

Filled with copies, a decode step's inputs took two host-to-device copies and
six device-to-device ones (ids, positions, slots, the in-flight tokens, the
lengths, the block tables), about 20 us of the GPU's time at one request with
the copy engine's switches between them (``docs/PERFORMANCE.md``). Here one
program a row reads its packed row straight from page-locked host memory, which
the GPU maps, takes an in-flight token from the previous step's tokens, and
writes every static buffer's row; the padded rows are written from constants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.decode_inputs import POSITION, SEQ_LEN, SLOT, SOURCE, STAGED_COLUMNS, TOKEN
from splitserve.kernels.triton.pdl import launch_options, wait_previous_kernel

BLOCK_W = 256  # block-table entries a program copies at a time
# the staged row's columns, as the reference names them
_TOKEN, _SOURCE, _POSITION = tl.constexpr(TOKEN), tl.constexpr(SOURCE), tl.constexpr(POSITION)
_SLOT, _SEQ_LEN = tl.constexpr(SLOT), tl.constexpr(SEQ_LEN)


# The row count, the block tables' width and the staged slot's address change from
# step to step: one compiled kernel for all of them, not a variant per divisibility
# class met for the first time in the middle of serving.
@triton.jit(do_not_specialize=["staged_ptr", "n", "width", "stride_table", "pad_seq_len"])
def _stage_kernel(
    staged_ptr,  # [n, STAGED_COLUMNS + width] int32, page-locked host memory (or device)
    previous_ptr,  # [>= n] int64 (HAS_PREVIOUS)
    ids_ptr,
    positions_ptr,
    slots_ptr,  # [size] int64 each
    seq_lens_ptr,  # [size] int32 (WRITE_INDEX)
    tables_ptr,  # [size, stride_table] int32 (WRITE_INDEX)
    n,
    width,
    stride_table,
    pad_seq_len,
    HAS_PREVIOUS: tl.constexpr,
    WRITE_INDEX: tl.constexpr,
    COLUMNS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    # The host wrote the staged rows before the launch: read them before the wait, so
    # the bus's latency passes while the previous kernel still runs.
    row = tl.program_id(0)
    real = row < n
    src = staged_ptr + row.to(tl.int64) * (COLUMNS + width)
    if real:
        token = tl.load(src + _TOKEN).to(tl.int64)
        source = tl.load(src + _SOURCE)
        position = tl.load(src + _POSITION).to(tl.int64)
        slot = tl.load(src + _SLOT).to(tl.int64)
        seq_len = tl.load(src + _SEQ_LEN)
    else:
        token = tl.full([], 0, tl.int64)
        source = tl.full([], -1, tl.int32)
        position = tl.full([], 0, tl.int64)
        slot = tl.full([], -1, tl.int64)
        seq_len = pad_seq_len
    cols = tl.arange(0, BLOCK_W)
    known = tl.where(real, width, 0)  # a padded row reads nothing: the null page
    if WRITE_INDEX:
        first = tl.load(src + COLUMNS + cols, mask=cols < known, other=0)
    wait_previous_kernel(PDL)  # the previous step's tokens, and the graph's buffers
    if HAS_PREVIOUS:  # noqa: SIM102 (a constexpr, then a value: two ifs for Triton)
        if source >= 0:
            token = tl.load(previous_ptr + source)
    tl.store(ids_ptr + row, token)
    tl.store(positions_ptr + row, position)
    tl.store(slots_ptr + row, slot)
    if WRITE_INDEX:
        tl.store(seq_lens_ptr + row, seq_len)
        dst = tables_ptr + row.to(tl.int64) * stride_table
        tl.store(dst + cols, first, mask=cols < width)
        for start in range(BLOCK_W, width, BLOCK_W):
            blocks = tl.load(src + COLUMNS + start + cols, mask=start + cols < known, other=0)
            tl.store(dst + start + cols, blocks, mask=start + cols < width)


def stage_decode_inputs(
    staged: torch.Tensor,  # [n, STAGED_COLUMNS + width] int32, page-locked or on the device
    previous: torch.Tensor | None,  # [rows] int64 on the device
    input_ids: torch.Tensor,  # [size] int64
    positions: torch.Tensor,  # [size] int64
    slot_mapping: torch.Tensor,  # [size] int64
    seq_lens: torch.Tensor | None = None,  # [size] int32
    block_tables: torch.Tensor | None = None,  # [size, >= width] int32
    pad_seq_len: int = 1,
) -> None:
    """The reference's writes, one launch (``size`` programs)."""
    size, (n, columns) = input_ids.shape[0], staged.shape
    width = columns - STAGED_COLUMNS
    if staged.dtype != torch.int32 or not staged.is_contiguous() or width < 0 or n > size:
        raise ValueError(
            f"staged must be contiguous int32 [n <= {size}, >= {STAGED_COLUMNS}]; got "
            f"{staged.dtype} {tuple(staged.shape)}"
        )
    for t in (input_ids, positions, slot_mapping):
        if t.dtype != torch.int64 or t.shape != (size,) or t.stride(0) != 1:
            raise ValueError(f"ids, positions and slots must be [{size}] int64, unit stride")
    index = seq_lens is not None
    if index and (
        seq_lens.dtype != torch.int32
        or block_tables.dtype != torch.int32
        or block_tables.shape[0] < size
        or block_tables.shape[1] < width
        or block_tables.stride(1) != 1
    ):
        raise ValueError("seq_lens and block_tables must be int32, the tables [size, >= width]")
    _stage_kernel[(size,)](
        staged, input_ids if previous is None else previous, input_ids, positions,
        slot_mapping, seq_lens if index else input_ids, block_tables if index else input_ids,
        n, width, block_tables.stride(0) if index else 0, pad_seq_len,
        HAS_PREVIOUS=previous is not None, WRITE_INDEX=index, COLUMNS=STAGED_COLUMNS,
        BLOCK_W=BLOCK_W, num_warps=1,
        **launch_options(input_ids.device, starts_early=True, lets_next_start=True),
    )  # fmt: skip
