"""Dispatch and combine: each token to the ranks that hold its experts, and back.

A rank's MoE layer routes its own tokens (``topk_ids`` are global expert ids;
rank ``d`` holds experts ``d * E/N .. (d + 1) * E/N - 1``). Dispatch sends every
token once to each rank that holds one of its choices, as one packed row: the
hidden state, the top-k ids in the receiver's numbering with the choices it does
not hold set to -1, and the top-k weights. The receiver runs its experts on what
it got (``fused_moe`` skips -1) and combine sends each row's weighted sum back,
where the source adds the ranks' parts in float32, rank by rank.

Two modes, one per step (``lockstep.py`` says which; every rank runs the same):

- ``PREFILL``: a variable all-to-all sized from the step's routing. The ranks swap
  how many rows each sends each other (a small all-to-all the host waits for),
  then the rows themselves; nothing is padded. For large steps; eager only.
- ``DECODE``: fixed capacity. Rank ``s`` writes the tokens it sends rank ``d`` into
  rows ``d * C ..`` of a buffer of ``N * C`` rows (``C``, the step's ``capacity``,
  is at least every rank's token count, so nothing can overflow), unused rows hold
  -1 ids, and one equal-split all-to-all moves it. Shapes depend only on ``C``:
  no host sync, and the layer can be captured in a CUDA graph.

Rows whose KV slot is -1 (a graph's padding, an idle rank's dummy token) are not
sent. Both modes go through ``data``: NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SKIP = -1  # a top-k choice the receiving rank does not hold


class DispatchMode(enum.Enum):
    PREFILL = "prefill"  # variable all-to-all after a counts exchange; eager
    DECODE = "decode"  # fixed capacity per rank; no host sync, graph-capturable


@dataclass(frozen=True)
class MoEDispatch:
    """How one step's MoE layers move tokens (the same on every rank)."""

    mode: DispatchMode
    capacity: int = 0  # DECODE: rows each rank may send each rank (>= every rank's tokens)
    # The step's KV slots, one per token: a row with slot -1 is padding and is not sent.
    slot_mapping: torch.Tensor | None = None


@dataclass
class Received:
    """What dispatch brought to this rank, and how combine sends it back."""

    hidden: torch.Tensor  # [rows, hidden]
    topk_ids: torch.Tensor  # [rows, top_k] int32, this rank's expert numbering; -1: not here
    topk_weights: torch.Tensor  # [rows, top_k] float32
    route: Any  # PrefillRoute | DecodeRoute


@dataclass
class PrefillRoute:
    token: torch.Tensor  # [sent rows] the source token of each row sent, grouped by rank
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


@dataclass
class DecodeRoute:
    row: torch.Tensor  # [tokens, ranks]: the row of rank d's part of token t; N*C: none


@dataclass(frozen=True)
class RowLayout:
    """One packed row: hidden state, then int32 ids, then float32 weights, as bytes."""

    hidden: int
    top_k: int
    dtype: torch.dtype

    @property
    def hidden_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    @property
    def bytes(self) -> int:
        return self.hidden_bytes + 8 * self.top_k

    def pack(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        parts = (hidden.to(self.dtype), ids.to(torch.int32), weights.to(torch.float32))
        return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=-1)

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views into ``rows`` (no copy: a row's bytes are a multiple of 4)."""
        h, k = self.hidden_bytes, 4 * self.top_k
        return (
            rows[:, :h].view(self.dtype),
            rows[:, h : h + k].view(torch.int32),
            rows[:, h + k :].view(torch.float32),
        )

    def padding(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """Rows that hold nothing: zero hidden state, every id -1."""
        rows = torch.zeros(num_rows, self.bytes, dtype=torch.uint8, device=device)
        rows[:, self.hidden_bytes : self.hidden_bytes + 4 * self.top_k] = 0xFF  # int32 -1
        return rows


class Dispatcher:
    """One rank's dispatch and combine over the group's ``data`` process group."""

    def __init__(self, data_group: Any, rank: int, size: int, experts_per_rank: int):
        self.group, self.rank, self.size = data_group, rank, size
        self.experts_per_rank = experts_per_rank

    def dispatch(
        self,
        hidden: torch.Tensor,  # [tokens, hidden]
        topk_weights: torch.Tensor,  # [tokens, top_k]
        topk_ids: torch.Tensor,  # [tokens, top_k] global expert ids
        step: MoEDispatch,
    ) -> Received:
        if step is None:
            raise RuntimeError("an expert-parallel MoE layer ran without the step's dispatch")
        if hidden.shape[-1] * hidden.dtype.itemsize % 4:
            raise ValueError(f"hidden size {hidden.shape[-1]} packs into no whole int32 rows")
        sends = self._sends(topk_ids, step.slot_mapping)
        layout = RowLayout(hidden.shape[-1], topk_ids.shape[-1], hidden.dtype)
        if step.mode == DispatchMode.DECODE:
            return self._dispatch_fixed(hidden, topk_weights, topk_ids, sends, layout, step)
        return self._dispatch_variable(hidden, topk_weights, topk_ids, sends, layout)

    def combine(self, out: torch.Tensor, received: Received) -> torch.Tensor:
        """Each source token's sum over the ranks' parts, in the source's row order."""
        if isinstance(received.route, DecodeRoute):
            return self._combine_fixed(out, received.route)
        return self._combine_variable(out, received.route)

    # -- what goes where ---------------------------------------------------------

    def _sends(self, topk_ids: torch.Tensor, slot_mapping: torch.Tensor | None) -> torch.Tensor:
        """``[tokens, ranks]`` bool: token t goes to rank d (one of its choices is there)."""
        owner = topk_ids // self.experts_per_rank
        ranks = torch.arange(self.size, device=topk_ids.device)
        sends = (owner[:, :, None] == ranks).any(dim=1)
        if slot_mapping is not None:
            sends &= (slot_mapping >= 0)[:, None]
        return sends

    def _choices(
        self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, dest: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The choices as rank ``dest`` (per row) sees them: its numbering, -1 elsewhere."""
        first = dest[..., None] * self.experts_per_rank
        here = (topk_ids >= first) & (topk_ids < first + self.experts_per_rank)
        ids = torch.where(here, topk_ids - first, SKIP)
        return ids, torch.where(here, topk_weights.float(), 0.0)

    def _all_to_all(self, out, inp, out_splits=None, in_splits=None) -> None:
        out_splits = [] if out_splits is None else out_splits
        in_splits = [] if in_splits is None else in_splits
        self.group.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()).wait()

    # -- prefill mode: variable sizes ---------------------------------------------

    def _dispatch_variable(self, hidden, topk_weights, topk_ids, sends, layout) -> Received:
        dest, token = sends.t().nonzero(as_tuple=True)  # grouped by rank, tokens in order
        counts = torch.bincount(dest, minlength=self.size)
        recv_counts = torch.empty_like(counts)
        self._all_to_all(recv_counts, counts)
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()  # the host waits
        ids, weights = self._choices(topk_ids[token], topk_weights[token], dest)
        rows = layout.pack(hidden[token], ids, weights)
        got = rows.new_empty(sum(recv_splits), layout.bytes)
        self._all_to_all(got, rows, recv_splits, send_splits)
        route = PrefillRoute(token, send_splits, recv_splits, hidden.shape[0])
        return Received(*layout.unpack(got), route)

    def _combine_variable(self, out: torch.Tensor, route: PrefillRoute) -> torch.Tensor:
        back = out.new_empty(sum(route.send_splits), out.shape[-1])
        self._all_to_all(back, out.contiguous(), route.send_splits, route.recv_splits)
        total = torch.zeros(route.num_tokens, out.shape[-1], dtype=torch.float32, device=out.device)
        return total.index_add_(0, route.token, back.float()).to(out.dtype)

    # -- decode mode: fixed capacity ------------------------------------------------

    def _dispatch_fixed(self, hidden, topk_weights, topk_ids, sends, layout, step) -> Received:
        num_tokens, capacity, n = hidden.shape[0], step.capacity, self.size
        if num_tokens > capacity:
            raise ValueError(f"{num_tokens} tokens exceed the decode dispatch capacity {capacity}")
        ranks = torch.arange(n, device=hidden.device)
        place = sends.long().cumsum(dim=0) - 1  # [tokens, ranks]: the token's place in d's rows
        row = torch.where(sends, ranks * capacity + place, n * capacity)  # n*C: discarded
        dest = ranks.expand(num_tokens, n)
        ids, weights = self._choices(
            topk_ids[:, None, :].expand(-1, n, -1), topk_weights[:, None, :].expand(-1, n, -1), dest
        )
        rows = layout.pack(hidden[:, None, :].expand(-1, n, -1), ids, weights)
        buffer = layout.padding(n * capacity + 1, hidden.device)
        buffer.index_copy_(0, row.flatten(), rows.view(num_tokens * n, layout.bytes))
        got = torch.empty_like(buffer[:-1])
        self._all_to_all(got, buffer[:-1])
        return Received(*layout.unpack(got), DecodeRoute(row))

    def _combine_fixed(self, out: torch.Tensor, route: DecodeRoute) -> torch.Tensor:
        back = out.new_empty(out.shape[0] + 1, out.shape[-1])
        back[-1].zero_()  # the discarded row: a rank the token did not go to adds zero
        self._all_to_all(back[:-1], out.contiguous())
        return back[route.row].float().sum(dim=1).to(out.dtype)
