"""Prefill and mixed steps replayed from piecewise CUDA graphs.

The model's forward is cut at its attention calls: each piece between two
attention calls (embedding and the first qkv, o_proj + MLP + the next qkv,
..., the last MLP and the final norm) is captured per token count, and
attention runs eagerly between the replays, over the real tokens only, with
the step's own plan. So one set of graphs serves any mix of prompt chunks and
decodes, with cached prefixes, as long as the step fits the largest size;
bigger steps run eagerly.

The cut needs no help from the model: while capturing, a stand-in attention
backend ends the current graph at each attention call, records the q/k/v
tensors the graph produced (their addresses are fixed at replay) and begins
the next graph, whose input is one static attention-output buffer. Padded
rows compute on input id 0 and position 0; they never reach attention, and
every op in a piece works row by row, so they cannot touch the real rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitserve.workers.attention.base import AttentionBackend, AttentionSpec, QKNormRope
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.runner.cuda_graphs.owner import CAPTURE_ERROR_MODE, GraphOwner, bucket
from splitserve.workers.runner.forward_batch import ForwardBatch, Phase
from splitserve.workers.runner.step_plan import plan_step


@dataclass
class AttentionCut:
    q: torch.Tensor  # [size, num_heads, head_dim], written by the piece before the cut
    k: torch.Tensor
    v: torch.Tensor
    layer: AttentionSpec


@dataclass
class PiecewiseGraphs:
    pieces: list[torch.cuda.CUDAGraph]  # len(cuts) + 1
    cuts: list[AttentionCut]
    hidden: torch.Tensor  # [size, hidden], the last piece's output


class PiecewiseGraphRunner:
    name = "piecewise"

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        kv_cache: KVCache,
        sizes: list[int],
        device: torch.device,
    ):
        self.model, self.attn_backend, self.kv_cache = model, attn_backend, kv_cache
        self.sizes = sorted(sizes)
        self.device = device
        self._graphs: dict[int, PiecewiseGraphs] = {}
        self._input_ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._attn_out: torch.Tensor | None = None  # [max size, heads, head_dim], all layers

    def capture_sizes(self) -> list[int]:
        return self.sizes[::-1]

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.num_tokens <= self.sizes[-1]

    # -- capture ---------------------------------------------------------------

    def capture(self, size: int, owner: GraphOwner) -> None:
        if self._input_ids is None:
            self._input_ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=self.device)
            self._positions = torch.zeros_like(self._input_ids)
        cutter = _CutAtAttention(self, owner, size)
        fb = self._capture_batch(size, cutter)
        fb.plan = plan_step(fb)  # of this size; attention (eager at replay) fuses nothing
        self.model(fb.input_ids, fb.positions, fb)  # warm-up, nothing captured
        torch.cuda.synchronize(self.device)
        cutter.capturing = True
        owner.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(owner.stream):
            cutter.begin_piece()
            hidden = self.model(fb.input_ids, fb.positions, fb)
            cutter.pieces[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(owner.stream)
        self._graphs[size] = PiecewiseGraphs(cutter.pieces, cutter.cuts, hidden)

    def _capture_batch(self, size: int, cutter: AttentionBackend) -> ForwardBatch:
        ids, pos = self._input_ids[:size], self._positions[:size]
        unused = torch.zeros(0, dtype=torch.long, device=self.device)
        return ForwardBatch(
            phase=Phase.PREFILL,
            input_ids=ids,
            positions=pos,
            query_lens=[size],
            seq_lens=[size],
            query_start_loc=unused,
            seq_lens_tensor=unused,
            block_tables=unused,
            block_ids=[],
            slot_mapping=unused,
            logits_indices=unused,
            kv_cache=self.kv_cache,
            attn_backend=cutter,
        )

    def attention_output(self, q: torch.Tensor) -> torch.Tensor:
        """The static buffer every layer's attention writes to (allocated once)."""
        if self._attn_out is None:
            shape = (self.sizes[-1], *q.shape[1:])
            self._attn_out = torch.zeros(shape, dtype=q.dtype, device=self.device)
        return self._attn_out[: q.shape[0]]

    # -- replay ----------------------------------------------------------------

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        fb = forward_batch
        n = fb.num_tokens
        size = bucket(self.sizes, n)
        graphs = self._graphs[size]
        self._input_ids[:n].copy_(fb.input_ids, non_blocking=True)
        self._input_ids[n:size].zero_()
        self._positions[:n].copy_(fb.positions, non_blocking=True)
        self._positions[n:size].zero_()
        self.attn_backend.plan(fb)
        graphs.pieces[0].replay()
        for cut, piece in zip(graphs.cuts, graphs.pieces[1:]):
            out = self.attn_backend.forward(cut.q[:n], cut.k[:n], cut.v[:n], cut.layer, fb)
            self._attn_out[:n].copy_(out)
            if fb.on_layer_stored is not None:
                fb.on_layer_stored(cut.layer.layer_id)
            piece.replay()
        return graphs.hidden[:n]

    def clear(self) -> None:
        self._graphs = {}
        self._input_ids = self._positions = self._attn_out = None


class _CutAtAttention(AttentionBackend):
    """Stands in for the attention backend while pieces are captured (see module doc)."""

    name = "piecewise-cut"

    def __init__(self, runner: PiecewiseGraphRunner, owner: GraphOwner, size: int):
        self.runner, self.owner, self.size = runner, owner, size
        self.capturing = False
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[AttentionCut] = []

    def begin_piece(self) -> None:
        piece = torch.cuda.CUDAGraph()
        piece.capture_begin(pool=self.owner.pool, capture_error_mode=CAPTURE_ERROR_MODE)
        self.pieces.append(piece)

    def plan(self, forward_batch: ForwardBatch) -> None:
        pass

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionSpec,
        forward_batch: ForwardBatch,
        norm_rope: QKNormRope | None = None,  # never given: kernel() norms no q/k
    ) -> torch.Tensor:
        if not self.capturing:
            return self.runner.attention_output(q)
        self.pieces[-1].capture_end()
        self.cuts.append(AttentionCut(q, k, v, layer))
        out = self.runner.attention_output(q)
        self.begin_piece()
        return out
