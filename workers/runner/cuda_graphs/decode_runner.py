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

The engine's decode steps take ``replay_steps``: the step's requests are packed
on the host into a page-locked slot, and one kernel (``ops.stage_decode_inputs``)
writes every static input from it, the padding and the previous step's
in-flight tokens included, and the block tables and lengths where the backend's
graph reads them (``AttentionKernel.reads_batch_index``). So no copy is launched
between two replays. ``forward`` (a batch already on the device) copies its tensors
in. Each size is captured with the step plan of its own size (``step_plan.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from splitserve.kernels import ops
from splitserve.kernels.decode_inputs import POSITION, SEQ_LEN, SLOT, SOURCE, STAGED_COLUMNS, TOKEN
from splitserve.scheduler.block_manager import NULL_BLOCK
from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.parallel.dispatch import DispatchMode, MoEDispatch
from splitserve.workers.runner.cuda_graphs.owner import CAPTURE_ERROR_MODE, GraphOwner, bucket
from splitserve.workers.runner.forward_batch import ForwardBatch, Phase
from splitserve.workers.runner.input_batch import StepRequest, padded_block_tables
from splitserve.workers.runner.pinned_ring import PinnedRing, PinnedSlot
from splitserve.workers.runner.step_plan import plan_step

PAD_SEQ_LEN = 1  # a padded request attends one zero key of the null page


@dataclass
class DecodeGraph:
    """One captured size."""

    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden]: the captured forward's output
    batch: ForwardBatch  # the static batch it was captured with, its plan included
    # The backend's attention reads the static block tables and lengths as they are
    # (``AttentionKernel.reads_batch_index``): a replay writes them, no prepare_replay.
    reads_batch_index: bool


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
        expert_parallel: bool = False,
    ):
        """``expert_parallel``: the model's MoE layers dispatch across a group; each size
        is captured in DECODE mode with itself as capacity, and every rank replays the
        same size (``replay_steps``' ``size``, ``replay_padding``)."""
        if tokens_per_request != 1:
            raise NotImplementedError("decode graphs for MTP verification are not built yet")
        self.model, self.attn_backend, self.kv_cache = model, attn_backend, kv_cache
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.expert_parallel = expert_parallel
        self._graphs: dict[int, DecodeGraph] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._staging = PinnedRing(torch.int32)  # replay_steps' packed rows
        self._staged_variants: set[bool] = set()  # index written or not: compiled
        # Staged rows are int32: every slot of the cache must fit.
        self._stages_slots = kv_cache.num_blocks * kv_cache.block_size < 2**31

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
        self._buffers = decode_graph_buffers(rows, self.max_blocks_per_seq, self.device)
        self.attn_backend.init_graph_buffers(rows, self.max_blocks_per_seq)

    def _static_batch(self, size: int) -> ForwardBatch:
        return static_decode_batch(self._buffers, size, self.kv_cache, self.attn_backend)

    def capture(self, size: int, owner: GraphOwner) -> None:
        if not self._buffers:
            self._allocate()
        fb = self._static_batch(size)
        self.attn_backend.prepare_capture(size, fb)
        fb.plan = plan_step(fb)
        if self.expert_parallel:
            dispatch = MoEDispatch(DispatchMode.DECODE, size, fb.slot_mapping)
            fb.plan = dataclasses.replace(fb.plan, moe_dispatch=dispatch)
        self.model(fb.input_ids, fb.positions, fb)  # warm-up: JIT kernels, cuBLAS handles
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=owner.pool, stream=owner.stream, capture_error_mode=CAPTURE_ERROR_MODE
        ):
            hidden = self.model(fb.input_ids, fb.positions, fb)
        reads_index = self.attn_backend.kernel(fb).reads_batch_index
        self._graphs[size] = DecodeGraph(graph, hidden, fb, reads_index)
        self._compile_staging(size, reads_index)

    def _compile_staging(self, size: int, index: bool) -> None:
        """Launch the staging kernel in each variant this size's replays meet (the tokens
        of a step in flight or none; the attention index written, or left to the
        backend's ``prepare_replay``), so none compiles while serving. Where the decode
        attention changes kernel with the batch (the Triton split-KV up to
        ``kernels.split_kv_max_batch``, FlashInfer above), a served decode worker met the
        second variant only at its 65th request: a 390 ms compile in its engine loop.
        It writes padding rows, which every replay writes anyway."""
        if not self._stages_slots or index in self._staged_variants:
            return
        self._staged_variants.add(index)
        b = self._buffers
        row = torch.zeros(1, STAGED_COLUMNS + 1, dtype=torch.int32, device=self.device)
        row[0, [SOURCE, SLOT, SEQ_LEN, STAGED_COLUMNS]] = torch.tensor(
            [-1, -1, PAD_SEQ_LEN, NULL_BLOCK], dtype=torch.int32, device=self.device
        )  # a padding row: token 0 at position 0, no slot, the null page
        for previous in (None, torch.zeros(1, dtype=torch.long, device=self.device)):
            ops.stage_decode_inputs(
                row, previous, b["input_ids"][:size], b["positions"][:size],
                b["slot_mapping"][:size], b["seq_lens"][:size] if index else None,
                b["block_tables"][:size] if index else None, pad_seq_len=PAD_SEQ_LEN,
            )  # fmt: skip

    def can_run_steps(self, steps: list[StepRequest]) -> bool:
        """Whether ``replay_steps`` runs these requests: each decodes one token and
        samples it, and they fit the largest size."""
        return (
            self._stages_slots
            and 0 < len(steps) <= self.sizes[-1]
            and all(len(s.new_token_ids) == 1 and s.num_computed > 0 and s.sample for s in steps)
        )

    # -- replay ----------------------------------------------------------------

    def replay_steps(
        self,
        steps: list[StepRequest],
        sources: list[int],
        previous: torch.Tensor | None,
        size: int | None = None,
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """Replay for ``can_run_steps``' requests; their hidden states and batch.

        ``sources[i] >= 0``: request ``i``'s token is row ``sources[i]`` of
        ``previous``, the tokens of the step still in flight. ``size``: the captured
        size to replay (expert parallelism: the group's); None: the smallest that holds
        the requests."""
        n, b = len(steps), self._buffers
        size = size or bucket(self.sizes, n)
        captured = self._graphs[size]
        seq_lens = [s.num_computed + 1 for s in steps]
        block_ids = [s.block_ids for s in steps]
        index = captured.reads_batch_index
        slot = self._stage(steps, block_ids, sources)
        ops.stage_decode_inputs(
            slot.tensor.view(n, -1), previous if any(i >= 0 for i in sources) else None,
            b["input_ids"][:size], b["positions"][:size], b["slot_mapping"][:size],
            b["seq_lens"][:size] if index else None, b["block_tables"][:size] if index else None,
            pad_seq_len=PAD_SEQ_LEN,
        )  # fmt: skip
        slot.queued()
        if not index:
            self.attn_backend.prepare_replay(size, _padded(captured.batch, seq_lens, block_ids))
        captured.graph.replay()
        fb = dataclasses.replace(
            captured.batch,
            input_ids=b["input_ids"][:n],
            positions=b["positions"][:n],
            query_lens=[1] * n,
            seq_lens=seq_lens,
            query_start_loc=b["query_start_loc"][: n + 1],
            seq_lens_tensor=b["seq_lens"][:n],
            block_tables=b["block_tables"][:n],
            block_ids=block_ids,
            slot_mapping=b["slot_mapping"][:n],
            logits_indices=b["logits_indices"][:n],
            logits_rows=slice(0, n),
        )
        return captured.hidden[:n], fb

    def replay_padding(self, size: int) -> None:
        """Replay ``size`` with every row padding: an idle expert-parallel rank's part in
        a step the group replays (its MoE layers send nothing and receive their share)."""
        b, captured = self._buffers, self._graphs[size]
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1)):
            b[name][:size].fill_(pad)
        b["seq_lens"][:size].fill_(PAD_SEQ_LEN)
        b["block_tables"][:size].fill_(NULL_BLOCK)
        if not captured.reads_batch_index:
            self.attn_backend.prepare_replay(size, _padded(captured.batch, [], []))
        captured.graph.replay()

    def _stage(
        self, steps: list[StepRequest], block_ids: list[list[int]], sources: list[int]
    ) -> PinnedSlot:
        """The steps' rows (``kernels/decode_inputs.py``) in a page-locked slot."""
        block_size = self.kv_cache.block_size
        tables = padded_block_tables(block_ids, dtype=np.int32)
        n, width = tables.shape
        slot = self._staging.take(n * (STAGED_COLUMNS + width))
        rows = slot.tensor.numpy().reshape(n, STAGED_COLUMNS + width)
        rows[:, STAGED_COLUMNS:] = tables
        positions = np.fromiter((s.num_computed for s in steps), dtype=np.int64, count=n)
        blocks = tables[np.arange(n), positions // block_size].astype(np.int64)
        rows[:, TOKEN] = [max(s.new_token_ids[0], 0) for s in steps]  # a pending one: 0
        rows[:, SOURCE] = sources
        rows[:, POSITION] = positions
        rows[:, SLOT] = blocks * block_size + positions % block_size
        rows[:, SEQ_LEN] = positions + 1
        return slot

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        fb = forward_batch
        n = fb.num_tokens
        size = bucket(self.sizes, n)
        captured = self._graphs[size]
        self._fill(fb, size)
        self.attn_backend.prepare_replay(size, _padded(captured.batch, fb.seq_lens, fb.block_ids))
        captured.graph.replay()
        return captured.hidden[:n]

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
        self._staged_variants = set()


def _padded(static: ForwardBatch, seq_lens: list[int], block_ids: list[list[int]]) -> ForwardBatch:
    """The graph's static batch with the step's host lists, padded to its size: a padded
    request attends ``PAD_SEQ_LEN`` tokens of the null page."""
    pad = static.num_tokens - len(seq_lens)
    return dataclasses.replace(
        static,
        seq_lens=seq_lens + [PAD_SEQ_LEN] * pad,
        block_ids=block_ids + [[NULL_BLOCK]] * pad,
    )


def decode_graph_buffers(
    rows: int, max_blocks_per_seq: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """A decode graph's static inputs for up to ``rows`` requests, every row at the null
    page (the decode and draft graph runners capture with these)."""
    long = {"dtype": torch.long, "device": device}
    int32 = {"dtype": torch.int32, "device": device}
    return {
        "input_ids": torch.zeros(rows, **long),
        "positions": torch.zeros(rows, **long),
        "slot_mapping": torch.full((rows,), -1, **long),
        "seq_lens": torch.full((rows,), PAD_SEQ_LEN, **int32),
        "query_start_loc": torch.arange(rows + 1, **int32),
        "block_tables": torch.zeros(rows, max_blocks_per_seq, **int32),
        "logits_indices": torch.arange(rows, **long),
    }


def static_decode_batch(buffers: dict, size: int, kv_cache, attn_backend) -> ForwardBatch:
    """The first ``size`` rows of a graph's static buffers as a decode batch, every row
    at the null page (the decode and draft graph runners capture and replay these)."""
    b = buffers
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
        kv_cache=kv_cache,
        attn_backend=attn_backend,
    )
