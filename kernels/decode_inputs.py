"""Decode-graph inputs reference: a step's packed host rows into the graph's static
buffers.

A decode CUDA graph reads its inputs from static buffers of ``size`` rows;
a step of ``n <= size`` requests fills rows ``[:n]`` and every padded row
(``workers/runner/cuda_graphs/decode_runner.py``). ``staged`` packs the step as
``[n, STAGED_COLUMNS + width]`` int32 rows:

    token id, source row, position, slot, sequence length, block table (width)

A request whose token is still on the device (sampled by the step in flight)
has its source row in ``previous`` (``>= 0``) instead of a token id. Padded
rows get token 0, position 0, slot -1 (the KV store skips it), sequence length
``pad_seq_len`` and the null page (block 0) across the table's width.
``seq_lens`` and ``block_tables`` are written only where given (a backend
whose graph reads them; others plan their own index).
"""

from __future__ import annotations

import torch

STAGED_COLUMNS = 5  # token id, source row, position, slot, sequence length; then the table
TOKEN, SOURCE, POSITION, SLOT, SEQ_LEN = range(STAGED_COLUMNS)


def stage_decode_inputs(
    staged: torch.Tensor,  # [n, STAGED_COLUMNS + width] int32
    previous: torch.Tensor | None,  # [rows] int64: the tokens of the step in flight
    input_ids: torch.Tensor,  # [size] int64
    positions: torch.Tensor,  # [size] int64
    slot_mapping: torch.Tensor,  # [size] int64
    seq_lens: torch.Tensor | None = None,  # [size] int32
    block_tables: torch.Tensor | None = None,  # [size, >= width] int32
    pad_seq_len: int = 1,
) -> None:
    """Fill the static buffers' ``size`` rows from the ``n`` staged ones and padding."""
    n, width = staged.shape[0], staged.shape[1] - STAGED_COLUMNS
    rows = staged.to(input_ids.device, torch.int64)
    tokens = rows[:, TOKEN]
    if previous is not None:
        source = rows[:, SOURCE]
        tokens = torch.where(source >= 0, previous[source.clamp(min=0)], tokens)
    for buffer, real, pad in (
        (input_ids, tokens, 0),
        (positions, rows[:, POSITION], 0),
        (slot_mapping, rows[:, SLOT], -1),
    ):
        buffer[:n] = real
        buffer[n:] = pad
    if seq_lens is not None:
        seq_lens[:n] = rows[:, SEQ_LEN].to(seq_lens.dtype)
        seq_lens[n:] = pad_seq_len
        block_tables[:n, :width] = rows[:, STAGED_COLUMNS:].to(block_tables.dtype)
        block_tables[n:, :width] = 0
