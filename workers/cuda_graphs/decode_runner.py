"""Whole decode steps replayed from CUDA graphs, one graph per token count.

Sizes are in tokens, ``num_tokens = batch * tokens_per_request`` (1 for plain
decode, ``1 + draft tokens`` for MTP verification), so one set of graphs
serves both. A step runs here only when every request in it is decoding and
it fits the largest size; it replays the smallest size that holds it.

Before every replay all static inputs are written, the padding rows too:
padded tokens get input id 0, position 0 and slot -1 (the KV store skips
them); padded requests get sequence length 1 over block 0, the null page,
which stays zero, so they never read or write a live request's KV. The
attention backend re-plans its index buffers for the padded batch, and the
output is trimmed to the real tokens.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.cuda_graphs.owner import CAPTURE_ERROR_MODE, GraphOwner, bucket
from splitserve.workers.forward_batch import ForwardBatch, Phase
from splitserve.workers.kv_cache import NULL_BLOCK, KVCache

PAD_SEQ_LEN = 1  # a padded request attends one zero key of the null page


class DecodeGraphRunner:
    name = "decode"

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        kv_cache: KVCache,
        sizes: list[int],
        max_blocks_per_seq: int,
        device: torch.device,
        tokens_per_request: int = 1,
    ):
        if tokens_per_request != 1:
            raise NotImplementedError("decode graphs for MTP verification are not built yet")
        self.model, self.attn_backend, self.kv_cache = model, attn_backend, kv_cache
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch]] = {}
        self._buffers: dict[str, torch.Tensor] = {}

    def capture_sizes(self) -> list[int]:
        return self.sizes[::-1]

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        fb = forward_batch
        return (
            fb.phase == Phase.DECODE
            and fb.num_tokens <= self.sizes[-1]
            and fb.on_layer_stored is None
        )

    # -- capture ---------------------------------------------------------------

    def _allocate(self) -> None:
        rows = self.sizes[-1]
        long = {"dtype": torch.long, "device": self.device}
        self._buffers = {
            "input_ids": torch.zeros(rows, **long),
            "positions": torch.zeros(rows, **long),
            "slot_mapping": torch.full((rows,), -1, **long),
            "seq_lens": torch.full((rows,), PAD_SEQ_LEN, dtype=torch.int32, device=self.device),
            "query_start_loc": torch.arange(rows + 1, dtype=torch.int32, device=self.device),
            "block_tables": torch.zeros(
                rows, self.max_blocks_per_seq, dtype=torch.int32, device=self.device
            ),
            "logits_indices": torch.arange(rows, **long),
        }
        self.attn_backend.init_graph_buffers(rows, self.max_blocks_per_seq)

    def _static_batch(self, size: int) -> ForwardBatch:
        b = self._buffers
        return ForwardBatch(
            phase=Phase.DECODE,
            input_ids=b["input_ids"][:size],
            positions=b["positions"][:size],
            query_lens=[1] * size,
            seq_lens=[PAD_SEQ_LEN] * size,
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens_tensor=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size],
            block_ids=[[NULL_BLOCK]] * size,
            slot_mapping=b["slot_mapping"][:size],
            logits_indices=b["logits_indices"][:size],
            kv_cache=self.kv_cache,
            attn_backend=self.attn_backend,
        )

    def capture(self, size: int, owner: GraphOwner) -> None:
        if not self._buffers:
            self._allocate()
        fb = self._static_batch(size)
        self.attn_backend.prepare_capture(size, fb)
        self.model(fb.input_ids, fb.positions, fb)  # warm-up: JIT kernels, cuBLAS handles
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=owner.pool, stream=owner.stream, capture_error_mode=CAPTURE_ERROR_MODE
        ):
            hidden = self.model(fb.input_ids, fb.positions, fb)
        self._graphs[size] = (graph, hidden, fb)

    # -- replay ----------------------------------------------------------------

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        fb = forward_batch
        n = fb.num_tokens
        size = bucket(self.sizes, n)
        graph, hidden, static = self._graphs[size]
        self._fill(fb, size)
        padded = dataclasses.replace(
            static,
            seq_lens=fb.seq_lens + [PAD_SEQ_LEN] * (size - n),
            block_ids=fb.block_ids + [[NULL_BLOCK]] * (size - n),
        )
        self.attn_backend.prepare_replay(size, padded)
        graph.replay()
        return hidden[:n]

    def _fill(self, fb: ForwardBatch, size: int) -> None:
        """Write the step's token inputs into rows ``[:n]`` and re-fill every padded row.

        The attention index (lengths, block tables) is the backend's to write, in
        ``prepare_replay``, from the padded batch's host lists."""
        b, n = self._buffers, fb.num_tokens
        for name, real, pad in (
            ("input_ids", fb.input_ids, 0),
            ("positions", fb.positions, 0),
            ("slot_mapping", fb.slot_mapping, -1),
        ):
            b[name][:n].copy_(real, non_blocking=True)
            if n < size:
                b[name][n:size].fill_(pad)

    def clear(self) -> None:
        self._graphs = {}
        self._buffers = {}
