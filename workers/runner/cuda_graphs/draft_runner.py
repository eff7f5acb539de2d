"""The MTP drafter's chained steps replayed from CUDA graphs, one graph per batch size.

A draft step is decode-shaped: one row a token, each attending its own prefix,
the MTP layer fed a token and a previous hidden state, then the MTP head's argmax.
Each bucket of rows captures that step. The drafter replays it once over the rows
of a decode or verify step the target replayed (its first pass: the target's hidden
states, ``1 + k`` rows a verifying request), then ``K - 1`` times over one row a
request (its chained steps: the previous draft and its own hidden state), when the
runner's decision for the step allows graphs (``MTPProposer.propose``'s
``graphs``). It registers with the one ``GraphOwner``, so ``clear()`` (before
weights are freed or reloaded) drops these graphs, their static buffers and the
attention backend's graph state with the target's.

The draft graphs have an attention backend of their own (``attn_backend``): its
graph buffers and per-size plans are theirs, so capturing or re-planning a draft
size never touches what a target decode graph of the same size captured.

Before every replay every static input is written, the padding rows too: padded
rows get input id 0, position 0, slot -1 (the KV store skips them), a zero
previous hidden state, and attend ``PAD_SEQ_LEN`` keys of block 0, the null page.
The outputs are trimmed to the real rows.

Under expert parallelism (``expert_parallel``) the MTP layer's MoE dispatches across
the group: each size is captured in DECODE mode with itself as capacity, every rank
replays the size the group agreed on (``draft``'s ``size``), and a rank without rows
replays padding (``replay_padding``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from splitserve.scheduler.block_manager import NULL_BLOCK
from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.parallel.dispatch import DispatchMode, MoEDispatch
from splitserve.workers.runner.cuda_graphs.decode_runner import (
    PAD_SEQ_LEN,
    decode_graph_buffers,
    static_decode_batch,
)
from splitserve.workers.runner.cuda_graphs.owner import CAPTURE_ERROR_MODE, GraphOwner, bucket
from splitserve.workers.runner.forward_batch import ForwardBatch
from splitserve.workers.runner.input_batch import padded_block_tables
from splitserve.workers.runner.step_plan import plan_step


@dataclass
class DraftGraph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # the static batch it was captured with
    hidden: torch.Tensor  # [size, hidden]: the MTP layer's output
    draft: torch.Tensor  # [size]: the MTP head's argmax
    # Its attention reads the lengths and block tables from the static buffers, which
    # ``fill`` writes (``AttentionKernel.reads_batch_index``): no ``prepare_replay``.
    reads_batch_index: bool = False


class DraftGraphRunner:
    name = "mtp_draft"

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        kv_cache: KVCache,
        sizes: list[int],
        max_blocks_per_seq: int,
        device: torch.device,
        expert_parallel: bool = False,
    ):
        self.model, self.attn_backend, self.kv_cache = model, attn_backend, kv_cache
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.expert_parallel = expert_parallel
        self._graphs: dict[int, DraftGraph] = {}
        self._buffers: dict[str, torch.Tensor] = {}

    # -- the owner's interface ---------------------------------------------------

    def capture_sizes(self) -> list[int]:
        return self.sizes[::-1]

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Never a target step: only the drafter replays these graphs."""
        return False

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        raise RuntimeError("draft graphs run only through DraftGraphRunner.draft")

    def can_draft(self, batch_size: int) -> bool:
        return bool(self._graphs) and 0 < batch_size <= self.sizes[-1]

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph, every static buffer and the backend's graph state."""
        self._graphs = {}
        self._buffers = {}
        self.attn_backend.clear_graphs()

    # -- capture -------------------------------------------------------------------

    def allocate(self, hidden_size: int, dtype: torch.dtype) -> None:
        rows = self.sizes[-1]
        self._buffers = decode_graph_buffers(rows, self.max_blocks_per_seq, self.device)
        self._buffers["previous_hidden"] = torch.zeros(
            rows, hidden_size, dtype=dtype, device=self.device
        )
        self.attn_backend.init_graph_buffers(rows, self.max_blocks_per_seq)

    def _static_batch(self, size: int) -> ForwardBatch:
        return static_decode_batch(self._buffers, size, self.kv_cache, self.attn_backend)

    def capture(self, size: int, owner: GraphOwner) -> None:
        if not self._buffers:
            embed = self.model.mtp.embed_tokens.weight
            self.allocate(embed.shape[1], embed.dtype)
        fb = self._static_batch(size)
        self.attn_backend.prepare_capture(size, fb)
        fb.plan = plan_step(fb)
        if self.expert_parallel:
            dispatch = MoEDispatch(DispatchMode.DECODE, size, fb.slot_mapping)
            fb.plan = dataclasses.replace(fb.plan, moe_dispatch=dispatch)
        self._draft_step(fb)  # warm-up: JIT kernels, cuBLAS handles
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=owner.pool, stream=owner.stream, capture_error_mode=CAPTURE_ERROR_MODE
        ):
            hidden, draft = self._draft_step(fb)
        reads_index = self.attn_backend.kernel(fb).reads_batch_index
        self._graphs[size] = DraftGraph(graph, fb, hidden, draft, reads_index)

    def _draft_step(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        previous = self._buffers["previous_hidden"][: fb.num_tokens]
        hidden = self.model.mtp_forward(fb.input_ids, fb.positions, previous, fb)
        return hidden, self.model.mtp_compute_logits(hidden).argmax(dim=-1)

    # -- replay ----------------------------------------------------------------------

    def draft(
        self,
        input_ids: torch.Tensor,
        previous_hidden: torch.Tensor,
        positions: list[int],
        slots: list[int],
        block_ids: list[list[int]],
        size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for ``len(positions)`` rows: (MTP hidden, drafts). ``size``: the
        captured size to replay (expert parallelism: the group's); None: the smallest that
        holds the rows."""
        n = len(positions)
        size = size or bucket(self.sizes, n)
        captured = self._graphs[size]
        seq_lens = [p + 1 for p in positions]
        self.fill(size, input_ids, previous_hidden, positions, slots, seq_lens, block_ids)
        if not captured.reads_batch_index:
            self.attn_backend.prepare_replay(
                size, self.padded_batch(captured.batch, seq_lens, block_ids)
            )
        captured.graph.replay()
        return captured.hidden[:n], captured.draft[:n]

    def replay_padding(self, size: int) -> None:
        """Replay ``size`` with every row padding: a rank without rows in a drafter pass
        the group replays (its MoE layer sends nothing and receives its share)."""
        self.fill(size, None, None, [], [], [], [])
        captured = self._graphs[size]
        if not captured.reads_batch_index:
            self.attn_backend.prepare_replay(size, self.padded_batch(captured.batch, [], []))
        captured.graph.replay()

    def fill(
        self,
        size: int,
        input_ids: torch.Tensor | None,
        previous_hidden: torch.Tensor | None,
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        block_ids: list[list[int]],
    ) -> None:
        """Write rows ``[:n]`` and re-fill every padded row ``[n:size]`` (all of them, each
        replay: a stale row would read or write another request's KV)."""
        b, n = self._buffers, len(positions)
        if n:
            self._fill_rows(input_ids, previous_hidden, positions, slots, seq_lens, block_ids)
        for name, pad in (
            ("input_ids", 0),
            ("positions", 0),
            ("slot_mapping", -1),
            ("seq_lens", PAD_SEQ_LEN),
            ("block_tables", NULL_BLOCK),
            ("previous_hidden", 0),
        ):
            b[name][n:size].fill_(pad)

    def _fill_rows(
        self,
        input_ids: torch.Tensor,
        previous_hidden: torch.Tensor,
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        block_ids: list[list[int]],
    ) -> None:
        b, n, device = self._buffers, len(positions), self.device
        b["input_ids"][:n].copy_(input_ids, non_blocking=True)
        b["previous_hidden"][:n].copy_(previous_hidden, non_blocking=True)
        host = torch.tensor([positions, slots, seq_lens], dtype=torch.long)
        host = host.to(device, non_blocking=True)
        b["positions"][:n].copy_(host[0])
        b["slot_mapping"][:n].copy_(host[1])
        b["seq_lens"][:n].copy_(host[2])
        tables = torch.from_numpy(padded_block_tables(block_ids, dtype=np.int32))
        b["block_tables"][:n].zero_()
        b["block_tables"][:n, : tables.shape[1]].copy_(tables.to(device, non_blocking=True))

    @staticmethod
    def padded_batch(
        static: ForwardBatch, seq_lens: list[int], block_ids: list[list[int]]
    ) -> ForwardBatch:
        """The static batch with the step's host lists, padded to its size (null page)."""
        pad = static.num_tokens - len(seq_lens)
        return dataclasses.replace(
            static,
            seq_lens=seq_lens + [PAD_SEQ_LEN] * pad,
            block_ids=block_ids + [[NULL_BLOCK]] * pad,
        )
