"""The MTP drafter: the checkpoint's MTP layer, run ``K`` times in a chain.

The MTP layer at position ``i`` reads the next token ``x[i + 1]`` and the target's
hidden state ``h[i]``, and predicts ``x[i + 2]``. Its attention has KV layer
``num_hidden_layers`` in the paged cache, under the request's block table and
slots, so it is freed with the request's blocks. After each target step:

1. **first pass**: the MTP layer runs over every row of the step (same positions,
   slots and attention plan as the target), fed the token after each row: the
   next prompt token, or what the step emitted there (an accepted draft, then the
   sampled or bonus token). This writes the MTP KV of every position the target
   computed, and the row of a request's last emitted token gives draft 1;
2. **chain**: draft ``k`` (``k = 2 .. K``) is the same layer at the next
   position, fed draft ``k - 1`` and the MTP layer's own hidden state.

The chain writes MTP KV past the last computed position (the scheduler's
lookahead slots); the next step's first pass overwrites it with KV from the
target's hidden states. A chained position past the request's block table (only
near the context length, where the scheduler trims the drafts anyway) stores
nothing. Drafts are greedy (the MTP head's argmax).

Under expert parallelism the MTP layer's MoE is a group collective: every rank runs
the passes the group agreed on (``lockstep.DraftSteps``), in its mode and capacity,
replaying a draft graph exactly where the group does; a rank without rows in a pass
(no work at all: ``idle``; no request to draft for: the chained passes) runs a dummy
one.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.parallel.lockstep import DraftSteps, GroupStep, dummy_step
from splitserve.workers.runner.cuda_graphs.draft_runner import DraftGraphRunner
from splitserve.workers.runner.forward_batch import ForwardBatch
from splitserve.workers.runner.forward_counts import ForwardCounts
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch, to_device
from splitserve.workers.runner.step_plan import plan_forward


@dataclass
class FirstPass:
    """The drafter's first pass over a step's rows, launched: the MTP layer's hidden state
    a row and, where a draft graph ran it, each row's greedy draft; where the rows are:
    each one's position and block table (decode rows), or the eager batch's."""

    mtp_hidden: torch.Tensor
    drafts: torch.Tensor | None
    positions: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    step: ForwardBatch | None = None


class MTPProposer:
    def __init__(
        self,
        model: nn.Module,
        num_speculative_tokens: int,
        kv_cache: KVCache,
        attn_backend: AttentionBackend,
        graph_attn_backend: AttentionBackend | None = None,
    ):
        """``graph_attn_backend``: a backend of the drafter's CUDA graphs' own (None: no
        draft graphs)."""
        if getattr(model, "mtp", None) is None:
            raise ValueError(
                "speculative_config method 'mtp' needs the checkpoint's MTP layer, and this "
                f"model ({type(model).__name__}) has none: a GLM-4.5 checkpoint with "
                "num_nextn_predict_layers >= 1 and its weights at model.layers.{N}; "
                "or leave speculative_config out"
            )
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.kv_cache = kv_cache
        self.attn_backend = attn_backend
        self.graph_attn_backend = graph_attn_backend
        self.forward_counts = ForwardCounts()  # its passes (``ModelRunner.forward_rows``)

    @torch.inference_mode()
    def propose(
        self,
        step: ForwardBatch | list[StepRequest],
        hidden: torch.Tensor,
        next_token_ids: torch.Tensor | list[int],
        draft_rows: list[int],
        graphs: DraftGraphRunner | None = None,
        group: DraftSteps | None = None,
    ) -> torch.Tensor:
        """Drafts for the requests whose last emitted token sits at ``draft_rows`` of the
        target's step (hidden states ``hidden``); ``next_token_ids``: the token after each
        row. ``step``: the eager batch the target ran, or its decode rows (one a token)
        when the target replayed a decode graph; ``graphs``: the step may replay the
        drafter's graphs (the runner's decision for the step): the first pass over decode
        rows and the chained steps; ``group``: the expert-parallel group's passes, which
        decide instead. Returns the drafts ``[rows, K]`` on the device, launched, not read
        back. (``first_pass`` then ``chain``.)"""
        first = self.first_pass(step, hidden, next_token_ids, graphs, group)
        return self.chain(first, draft_rows, graphs, group)

    @torch.inference_mode()
    def first_pass(
        self,
        step: ForwardBatch | list[StepRequest],
        hidden: torch.Tensor,
        next_token_ids: torch.Tensor | list[int],
        graphs: DraftGraphRunner | None = None,
        group: DraftSteps | None = None,
    ) -> FirstPass:
        """The MTP layer over every row of the target's step, launched: it needs the tokens
        after the rows (on the device), not which rows draft (``chain``)."""
        device = hidden.device
        ids = next_token_ids
        if not isinstance(ids, torch.Tensor):
            ids = to_device(ids, device)
        first_step = group.first if group is not None else None
        if isinstance(step, list):
            positions = [r.num_computed for r in step]
            blocks = [r.block_ids for r in step]
            mtp_hidden, drafts = self._first_pass_rows(
                ids, hidden, positions, blocks, graphs, first_step
            )
            return FirstPass(mtp_hidden, drafts, positions, blocks)
        return FirstPass(self._first_pass(ids, hidden, step), None, step=step)

    @torch.inference_mode()
    def chain(
        self,
        first: FirstPass,
        draft_rows: list[int],
        graphs: DraftGraphRunner | None = None,
        group: DraftSteps | None = None,
    ) -> torch.Tensor:
        """Drafts 1 .. K of the requests whose last emitted token sits at ``draft_rows``:
        the first pass's head at those rows, then ``K - 1`` chained passes."""
        device = first.mtp_hidden.device
        chain_step = group.chain if group is not None else None
        if not draft_rows:
            self._dummy_chain(chain_step, graphs)
            return torch.empty(0, self.num_speculative_tokens, dtype=torch.long, device=device)
        if group is not None and chain_step is None:
            raise RuntimeError("a rank drafts in a group step whose drafter runs no chain")
        rows = to_device(draft_rows, device)
        mtp_hidden = first.mtp_hidden[rows]
        # An eager first pass leaves the head to the draft rows: over a prompt's every row
        # it would compute (and compile) the LM head at thousands of rows for a few drafts.
        drafts = [self._greedy(mtp_hidden) if first.drafts is None else first.drafts[rows]]
        if first.step is not None:
            positions, blocks = _rows_at(first.step, draft_rows)
        else:
            positions = [first.positions[r] for r in draft_rows]
            blocks = [first.blocks[r] for r in draft_rows]
        use_graphs = graphs is not None and graphs.can_draft(len(draft_rows))
        size = None
        if chain_step is not None:  # the group decides, one size for every rank
            use_graphs, size = chain_step.graph_size is not None, chain_step.graph_size
        for _ in range(1, self.num_speculative_tokens):
            positions = [p + 1 for p in positions]
            covered, slots = self._chain_slots(positions, blocks)
            if use_graphs:
                mtp_hidden, draft = graphs.draft(
                    drafts[-1], mtp_hidden, covered, slots, blocks, size
                )
                drafts.append(draft.clone())  # the next replay overwrites the graph's output
                self.forward_counts.add("draft", "graph")
                continue
            chain = self._chain_batch(covered, slots, blocks, device, chain_step)
            chain.input_ids.copy_(drafts[-1])
            mtp_hidden = self.model.mtp_forward(chain.input_ids, chain.positions, mtp_hidden, chain)
            self.forward_counts.add("draft", "eager")
            drafts.append(self._greedy(mtp_hidden))
        return torch.stack(drafts, dim=1)  # its own memory: no graph's output buffer

    # -- expert parallelism: the passes of a rank without rows ---------------------------

    @torch.inference_mode()
    def idle(self, group: DraftSteps, graphs: DraftGraphRunner | None) -> None:
        """A rank with no work in a group step that runs: its dummy drafter passes."""
        self._dummy_pass(group.first, graphs)
        self._dummy_chain(group.chain, graphs)

    def _dummy_chain(self, chain: GroupStep | None, graphs: DraftGraphRunner | None) -> None:
        if chain is None:
            return
        for _ in range(1, self.num_speculative_tokens):
            self._dummy_pass(chain, graphs)

    def _dummy_pass(self, step: GroupStep, graphs: DraftGraphRunner | None) -> None:
        """One padding row through the MTP layer (nothing stored or sent), or a draft graph
        replayed with padding only where the group replays one."""
        if step.graph_size is not None:
            graphs.replay_padding(step.graph_size)
            return
        embed = self.model.mtp.embed_tokens.weight
        fb = dummy_step(self.kv_cache, self.attn_backend, embed.device)
        plan_forward(fb)
        step.plan(fb)
        hidden = torch.zeros(1, embed.shape[1], dtype=embed.dtype, device=embed.device)
        self.model.mtp_forward(fb.input_ids, fb.positions, hidden, fb)

    def _first_pass(
        self, ids: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """The MTP layer's hidden states over every row of the target's eager step (the
        caller takes the greedy drafts of the rows it drafts for)."""
        if fb.plan is None:
            plan_forward(fb)
        mtp_hidden = self.model.mtp_forward(ids, fb.positions, hidden, fb)
        self.forward_counts.add("draft", "eager")
        return mtp_hidden

    def _first_pass_rows(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: list[int],
        blocks: list[list[int]],
        graphs: DraftGraphRunner | None,
        group: GroupStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first pass over decode rows (a graph-replayed decode or verify step): one
        draft-graph replay where a graph holds the rows (``group``: where the group
        replays one: hidden and greedy drafts of every row), else eager over the same
        rows (hidden only)."""
        replay = graphs is not None and graphs.can_draft(len(positions))
        if group is not None:
            replay = group.graph_size is not None
        if replay:
            _, slots = self._chain_slots(positions, blocks)
            size = group.graph_size if group is not None else None
            mtp_hidden, draft = graphs.draft(ids, hidden, positions, slots, blocks, size)
            self.forward_counts.add("draft", "graph")
            return mtp_hidden, draft
        steps = [StepRequest([0], p, b, sample=True) for p, b in zip(positions, blocks)]
        fb = build_forward_batch(steps, self.kv_cache, self.attn_backend, hidden.device)
        if group is not None:
            group.plan(fb)
        return self._first_pass(ids, hidden, fb), None

    def _greedy(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.mtp_compute_logits(mtp_hidden).argmax(dim=-1)

    def _chain_slots(
        self, positions: list[int], blocks: list[list[int]]
    ) -> tuple[list[int], list[int]]:
        """Each chained row's position within its block table and its KV slot; a position
        past the table attends as its last slot and stores nothing (slot -1)."""
        size = self.kv_cache.block_size
        covered, slots = [], []
        for p, b in zip(positions, blocks):
            c = min(p, len(b) * size - 1)
            covered.append(c)
            slots.append(b[c // size] * size + c % size if c == p else -1)
        return covered, slots

    def _chain_batch(
        self,
        positions: list[int],
        slots: list[int],
        blocks: list[list[int]],
        device: torch.device,
        group: GroupStep | None = None,
    ) -> ForwardBatch:
        """One row a request at ``positions`` (token ids filled in on the device);
        ``group``: the expert-parallel group's chained pass (its MoE dispatch)."""
        steps = [StepRequest([0], p, b, sample=True) for p, b in zip(positions, blocks)]
        fb = build_forward_batch(steps, self.kv_cache, self.attn_backend, device)
        beyond = [i for i, s in enumerate(slots) if s < 0]
        if beyond:
            fb.slot_mapping[to_device(beyond, device)] = -1
        if group is not None:
            group.plan(fb)
        return fb


def _rows_at(fb: ForwardBatch, rows: list[int]) -> tuple[list[int], list[list[int]]]:
    """Each row's position and its request's block table, read from the batch's host lists."""
    ends = list(itertools.accumulate(fb.query_lens))
    positions, blocks = [], []
    for r in rows:
        i = bisect.bisect_right(ends, r)
        positions.append(fb.seq_lens[i] - (ends[i] - r))
        blocks.append(fb.block_ids[i])
    return positions, blocks
