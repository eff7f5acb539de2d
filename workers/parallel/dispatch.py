"""Dispatch and combine: each token to the ranks that hold its experts, and back.

A rank's MoE layer routes its own tokens (``topk_ids`` are global expert ids;
rank ``d`` holds experts ``d * E/N .. (d + 1) * E/N - 1``). Dispatch sends every
token once to each rank that holds one of its choices, as one packed row: the
hidden state, the top-k ids in the receiver's numbering with the choices it does
not hold set to -1, and the top-k weights. The receiver runs its experts on what
it got (``fused_moe`` skips -1) and combine sends each row's weighted sum back in
``PART_DTYPE``, where the source adds the ranks' parts in float32, rank by rank, and
rounds once to the hidden dtype.

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
sent. Both modes go through ``data``: NCCL on GPUs, gloo on CPU; except that on GPUs
of one host that can read each other's memory, DECODE mode reads the same rows
straight out of the other ranks' buffers (``peer_memory.py``: two device-side
barriers a layer instead of two NCCL all-to-alls), where the step's capacity fits
them. The row layout and DECODE mode's buffer and sum are kernels
(``kernels/ep_rows.py``; on a GPU three launches to fill the buffer and one to sum
what comes back).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve.kernels import ops
from splitserve.kernels.ep_rows import RowLayout, choices_for, destinations
from splitserve.workers.parallel.peer_memory import PeerMemory

# The dtype a rank's partial sums travel back in. float32: the source adds the ranks'
# parts and rounds once, so the layer's output is one GPU's up to float32 rounding (in
# bf16 a second rounding would flip a router's near-ties downstream); bfloat16 would
# halve combine's bytes.
PART_DTYPE = torch.float32


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
    capacity: int = 0
    peers: bool = False  # the rows were read from the ranks' shared buffers


class Dispatcher:
    """One rank's dispatch and combine over the group's ``data`` process group."""

    def __init__(
        self,
        data_group: Any,
        rank: int,
        size: int,
        experts_per_rank: int,
        peers: PeerMemory | None = None,  # GPUs of one host: DECODE mode reads from these
    ):
        self.group, self.rank, self.size = data_group, rank, size
        self.experts_per_rank = experts_per_rank
        self.peers = peers
        self.part_dtype = PART_DTYPE  # what the local experts' sums are handed to combine in

    def dispatch(
        self,
        hidden: torch.Tensor,  # [tokens, hidden]
        topk_weights: torch.Tensor,  # [tokens, top_k]
        topk_ids: torch.Tensor,  # [tokens, top_k] global expert ids
        step: MoEDispatch,
    ) -> Received:
        if step is None:
            raise RuntimeError("an expert-parallel MoE layer ran without the step's dispatch")
        layout = RowLayout(hidden.shape[-1], topk_ids.shape[-1], hidden.dtype)
        layout.check()
        if step.mode == DispatchMode.DECODE:
            return self._dispatch_fixed(hidden, topk_weights, topk_ids, layout, step)
        return self._dispatch_variable(hidden, topk_weights, topk_ids, layout, step)

    def combine(self, out: torch.Tensor, received: Received) -> torch.Tensor:
        """Each source token's sum over the ranks' parts (``out``: this rank's experts on
        what it received), in the source's row order and hidden dtype."""
        dtype = received.hidden.dtype
        if isinstance(received.route, DecodeRoute):
            return self._combine_fixed(out, received.route, dtype)
        return self._combine_variable(out, received.route, dtype)

    def _all_to_all(self, out, inp, out_splits=None, in_splits=None) -> None:
        out_splits = [] if out_splits is None else out_splits
        in_splits = [] if in_splits is None else in_splits
        self.group.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()).wait()

    # -- prefill mode: variable sizes ---------------------------------------------

    def _dispatch_variable(self, hidden, topk_weights, topk_ids, layout, step) -> Received:
        sends = destinations(topk_ids, step.slot_mapping, self.experts_per_rank, self.size)
        dest, token = sends.t().nonzero(as_tuple=True)  # grouped by rank, tokens in order
        counts = torch.bincount(dest, minlength=self.size)
        recv_counts = torch.empty_like(counts)
        self._all_to_all(recv_counts, counts)
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()  # the host waits
        ids, weights = choices_for(
            topk_ids[token], topk_weights[token], dest, self.experts_per_rank
        )
        rows = layout.pack(hidden[token], ids, weights)
        got = rows.new_empty(sum(recv_splits), layout.bytes)
        self._all_to_all(got, rows, recv_splits, send_splits)
        route = PrefillRoute(token, send_splits, recv_splits, hidden.shape[0])
        return Received(*layout.unpack(got), route)

    def _combine_variable(self, out: torch.Tensor, route: PrefillRoute, dtype) -> torch.Tensor:
        back = out.new_empty(sum(route.send_splits), out.shape[-1])
        self._all_to_all(back, out.contiguous(), route.send_splits, route.recv_splits)
        total = torch.zeros(route.num_tokens, out.shape[-1], dtype=torch.float32, device=out.device)
        return total.index_add_(0, route.token, back.float()).to(dtype)

    # -- decode mode: fixed capacity ------------------------------------------------

    def _dispatch_fixed(self, hidden, topk_weights, topk_ids, layout, step) -> Received:
        if hidden.shape[0] > step.capacity:
            raise ValueError(
                f"{hidden.shape[0]} tokens exceed the decode dispatch capacity {step.capacity}"
            )
        args = (hidden, topk_ids, topk_weights, step.slot_mapping, self.experts_per_rank)
        if self.peers is not None and self.peers.layout.holds(step.capacity, layout):
            row = self.peers.send(*args, step.capacity)
            got = self.peers.pull_rows(step.capacity, layout)  # once every rank sent
            return Received(*layout.unpack(got), DecodeRoute(row, step.capacity, peers=True))
        buffer, row = ops.ep_send_rows(*args, self.size, step.capacity)
        got = torch.empty_like(buffer)
        self._all_to_all(got, buffer)
        return Received(*layout.unpack(got), DecodeRoute(row, step.capacity))

    def _combine_fixed(self, out: torch.Tensor, route: DecodeRoute, dtype) -> torch.Tensor:
        if route.peers:
            self.peers.put_parts(out.to(torch.float32))
            return self.peers.sum_parts(route.row, route.capacity, out.shape[-1], dtype)
        back = torch.empty_like(out)
        self._all_to_all(back, out.contiguous())
        return ops.ep_sum_rows(back, route.row, dtype)
