"""Triton greedy tokens: the argmax of each row of logits; reference:
``splitserve.kernels.argmax``.

A decode step ends in the argmax of its logits, and its tokens go to the host.
With torch that is a reduction (one row reduced by few programs), a copy to the
host and the copy engine's switches around it: tens of microseconds of the GPU's
time a step at one request (``docs/perf/TUNING.md``).

Here one launch does both. Each program takes ``BLOCK`` words of one row and
turns each into an ordered int64 key: the float32 bits of the value (of the
logits' own dtype), made to sort as signed integers, above the index counted
down, so that the largest key is the largest value's first index. ``-0.0``
counts as ``0.0`` and every NaN as larger than any number, as in
``torch.argmax``. The program's largest key goes into its row's slot by an
atomic max; the row's program to count itself in last turns the slot into the
row's token, stores it on the device and, where given, into page-locked host
memory that the GPU maps (a store over the bus: no copy launch), and resets the
row's slot and count for the next launch. So the scratch (``_Scratch``, per
device and stream) needs no clearing between launches, and nothing waits for
the host: a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton.pdl import launch_options, wait_previous_kernel

BLOCK = 2048  # words of a row per program
EMPTY = -1  # a row slot before any program's key (every key is >= 0)


@triton.jit
def _argmax_kernel(
    logits_ptr,  # [rows, vocab], unit stride along vocab
    stride_row,
    vocab,
    keys_ptr,  # [>= rows] int64 scratch, EMPTY between launches
    counts_ptr,  # [>= rows] int32 scratch, 0 between launches
    tokens_ptr,  # [rows] int64
    host_ptr,  # [rows] int64, page-locked host memory (HAS_HOST)
    HAS_HOST: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous_kernel(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab, other=float("-inf")
    ).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, 0x7FC00000, tl.where(x == 0.0, 0, bits))  # NaN largest; -0 is 0
    half = tl.full([], 2147483648, tl.int64)  # 2^31
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + half  # in [0, 2^32)
    keys = order * half + (2147483647 - offs)  # the index counted down: first wins ties
    tl.atomic_max(keys_ptr + row, tl.max(keys, axis=0))
    # acq_rel: the row's last program to count in sees every program's max
    if tl.atomic_add(counts_ptr + row, 1) == tl.num_programs(1) - 1:
        best = tl.atomic_xchg(keys_ptr + row, -1)  # EMPTY again
        token = 2147483647 - (best & 2147483647)
        tl.store(tokens_ptr + row, token)
        if HAS_HOST:
            tl.store(host_ptr + row, token)
        tl.atomic_xchg(counts_ptr + row, 0)


class _Scratch:
    """The row slots and counts of one device and stream, grown as rows demand."""

    _by_stream: dict[tuple[torch.device, int], _Scratch] = {}

    def __init__(self, device: torch.device, rows: int):
        self.keys = torch.full((rows,), EMPTY, dtype=torch.int64, device=device)
        self.counts = torch.zeros(rows, dtype=torch.int32, device=device)

    @classmethod
    def of(cls, device: torch.device, rows: int) -> _Scratch:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device, stream)
        scratch = cls._by_stream.get(key)
        if scratch is None or scratch.keys.numel() < rows:
            scratch = cls._by_stream[key] = cls(device, max(rows, 64))
        return scratch


def argmax(logits: torch.Tensor, host_out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's first largest index, ``[rows]`` int64; also into ``host_out``
    (``[rows]`` int64, page-locked) where given."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab]; got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if host_out is not None and (host_out.shape != (rows,) or host_out.dtype != torch.int64):
        raise ValueError(
            f"host_out must be [{rows}] int64; got {tuple(host_out.shape)} {host_out.dtype}"
        )
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    if vocab == 0 or vocab >= 2**31:
        raise ValueError(f"vocab must be in [1, 2^31); got {vocab}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    scratch = _Scratch.of(logits.device, rows)
    _argmax_kernel[(rows, triton.cdiv(vocab, BLOCK))](
        logits, logits.stride(0), vocab, scratch.keys, scratch.counts, tokens,
        tokens if host_out is None else host_out, HAS_HOST=host_out is not None,
        BLOCK=BLOCK, num_warps=4,
        **launch_options(logits.device, starts_early=True, lets_next_start=True),
    )  # fmt: skip
    return tokens
