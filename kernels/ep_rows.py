"""Expert-parallel rows: one description of a dispatched row, and DECODE mode's
fixed-capacity send buffer and the sum of what comes back (references).

A row (``RowLayout``) is bytes: the token's hidden state, then ``top_k`` int32 expert
ids in the receiving rank's numbering (-1: a choice that rank does not hold), then
``top_k`` float32 routing weights (0 where the id is -1). Its byte count is a multiple
of 4, so the three parts are views of the row.

The fixed-capacity buffer has ``N * C`` rows; rank ``d``'s are ``d * C ..``. Token
``t`` goes to rank ``d`` when one of its choices is there (``experts_per_rank``
consecutive experts a rank) and its KV slot is not -1; it is row ``d * C + p``, ``p``
the number of earlier tokens that go to ``d``. ``row [T, N]`` says where (``N * C``:
nowhere). Every other row is 0xFF bytes: ids -1, a hidden state nobody reads.
``sum_rows`` adds, in float32, rank by rank, the rows ``row`` points at.

Between the GPUs of one host the ranks read each other's buffers instead of swapping
them (``triton/ep_peer.py``): ``pull_rows`` is what rank ``r`` reads from every rank's
send buffer, ``sum_peer_parts`` the sum of the partial sums it reads back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_BYTE = 0xFF  # an unused row: every id -1


@dataclass(frozen=True)
class RowLayout:
    hidden: int
    top_k: int
    dtype: torch.dtype

    @property
    def hidden_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    @property
    def bytes(self) -> int:
        return self.hidden_bytes + 8 * self.top_k

    def check(self) -> None:
        if self.hidden_bytes % 4:
            raise ValueError(f"hidden size {self.hidden} packs into no whole int32 words")

    def pack(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        parts = (hidden.to(self.dtype), ids.to(torch.int32), weights.to(torch.float32))
        return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=-1)

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views into ``rows`` (no copy)."""
        h, k = self.hidden_bytes, 4 * self.top_k
        return (
            rows[:, :h].view(self.dtype),
            rows[:, h : h + k].view(torch.int32),
            rows[:, h + k :].view(torch.float32),
        )


@dataclass(frozen=True)
class PeerOffsets:
    """Bytes from the start of a rank's shared buffer to each of its parts
    (``workers/parallel/peer_memory.py``; the same on every rank)."""

    flags: int  # N int64 barrier flags, one a rank
    counts: int  # N int32: the rows this rank sends each rank
    send: int  # its send rows
    parts: int  # its experts' float32 partial sums


def choices_for(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, dest: torch.Tensor, experts_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The choices as rank ``dest`` (broadcast over the ids' last axis) sees them: its
    numbering, -1 (weight 0) where another rank holds the expert."""
    first = dest[..., None] * experts_per_rank
    here = (topk_ids >= first) & (topk_ids < first + experts_per_rank)
    return torch.where(here, topk_ids - first, -1), torch.where(here, topk_weights.float(), 0.0)


def destinations(
    topk_ids: torch.Tensor, slot_mapping: torch.Tensor | None, experts_per_rank: int, ranks: int
) -> torch.Tensor:
    """``[T, N]`` bool: token t goes to rank d."""
    owner = topk_ids // experts_per_rank
    sends = (owner[:, :, None] == torch.arange(ranks, device=topk_ids.device)).any(dim=1)
    if slot_mapping is not None:
        sends &= (slot_mapping >= 0)[:, None]
    return sends


def send_rows(
    hidden: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, top_k] global expert ids
    topk_weights: torch.Tensor,  # [T, top_k]
    slot_mapping: torch.Tensor | None,  # [T]; -1: padding, not sent
    experts_per_rank: int,
    ranks: int,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer uint8 [N * C, row bytes], row int64 [T, N])``."""
    num_tokens, top_k = topk_ids.shape
    layout = RowLayout(hidden.shape[-1], top_k, hidden.dtype)
    sends = destinations(topk_ids, slot_mapping, experts_per_rank, ranks)
    everyone = torch.arange(ranks, device=hidden.device)
    place = sends.long().cumsum(dim=0) - 1
    row = torch.where(sends, everyone * capacity + place, ranks * capacity)
    ids, weights = choices_for(
        topk_ids[:, None, :], topk_weights[:, None, :], everyone.expand(num_tokens, ranks),
        experts_per_rank,
    )  # fmt: skip
    rows = layout.pack(hidden[:, None, :].expand(-1, ranks, -1), ids, weights)
    buffer = torch.full(
        (ranks * capacity + 1, layout.bytes), PAD_BYTE, dtype=torch.uint8, device=hidden.device
    )
    buffer.index_copy_(0, row.flatten(), rows.view(num_tokens * ranks, layout.bytes))
    return buffer[:-1], row


def sum_rows(
    back: torch.Tensor, row: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``[T, H]``: per token the rows ``row`` points at (``N * C``: none) summed in float32,
    rank by rank, in ``out_dtype`` (None: ``back``'s)."""
    padded = torch.cat([back, back.new_zeros(1, back.shape[-1])])
    return padded[row].float().sum(dim=1).to(out_dtype or back.dtype)


def pull_rows(sends: list[torch.Tensor], rank: int, capacity: int) -> torch.Tensor:
    """``[N * C, row bytes]``: each rank ``s``'s send rows (``send_rows``'s buffer) for
    ``rank``, at ``s * C ..``; the padding comes along as it is (0xFF bytes)."""
    return torch.cat([send[rank * capacity : (rank + 1) * capacity] for send in sends])


def sum_peer_parts(
    parts: list[torch.Tensor], row: torch.Tensor, rank: int, capacity: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """``sum_rows`` of what rank ``rank`` reads back: rank ``d`` keeps the part of this
    rank's row ``d * C + p`` at its row ``rank * C + p``."""
    back = torch.cat([part[rank * capacity : (rank + 1) * capacity] for part in parts])
    return sum_rows(back, row, out_dtype)


def count_choices(counts: torch.Tensor, ids: torch.Tensor) -> None:
    """Add to ``counts [E]`` the choices of each expert in ``ids [rows, top_k]`` (a
    rank's numbering; -1: another rank's expert, not counted)."""
    flat = ids.flatten().long()
    counts.scatter_add_(0, flat.clamp(min=0), (flat >= 0).long())
