"""The ranks of an expert-parallel group step together: one exchange a step, one choice.

Every MoE layer is a collective, so every rank must run the same number of forwards,
in the same dispatch mode, with the same decode capacity, and either all replay a
decode graph of one size or all run eagerly. Before each forward (a rank with no
work too) the ranks all-gather a ``StepHeader`` over the host (gloo) group: how many
tokens each brings, whether its step is decode-only, whether a decode graph could
run it. That exchange is what lockstep needs anyway (an idle rank learns whether to
run a dummy step, and the decode capacity must cover every rank's tokens); the
phase rides on it. ``agree`` is a pure function of the headers and the group's
shared settings, so every rank reaches the same ``GroupStep`` with no further
collective:

- nobody has tokens: no forward anywhere;
- a prefill worker dispatches in PREFILL mode, a decode worker in DECODE mode, a
  mixed worker in DECODE mode exactly when every rank's step is decode-only (an idle
  rank counts as one), else PREFILL;
- decode graphs run when the mode is DECODE, every rank could replay its step and
  the largest rank's tokens fit a captured size; then every rank replays that size
  (the smallest holding the largest rank's tokens) and it is the capacity. Otherwise
  the capacity is the largest rank's tokens.

A decode graph is captured with DECODE dispatch at its own size as capacity, so a
replay can never meet a PREFILL-mode step (the graph would hold the wrong
collectives).

With the MTP drafter (``agree_drafts``) the MTP layer's MoE is a collective too, so
every rank also runs the same drafter passes: a first pass over the target's rows in
the target's mode and capacity (a draft graph of the target's size where the target
replayed one), then, when any rank drafts (the header's ``draft_rows``: requests that
sample and may be drafted for), ``K - 1`` chained passes of one row per drafting
request, in the step's mode, the capacity the largest rank's rows; in DECODE mode
with draft graphs every rank replays the draft graph holding them. A rank with no
rows in a pass runs a dummy one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from splitserve.scheduler.block_manager import NULL_BLOCK
from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.parallel.dispatch import DispatchMode, MoEDispatch
from splitserve.workers.parallel.group import ExpertGroup, GroupMember, attach_dispatcher
from splitserve.workers.runner.forward_batch import ForwardBatch
from splitserve.workers.runner.input_batch import StepRequest, build_forward_batch


@dataclass(frozen=True)
class StepHeader:
    """What a rank tells the group before its forward."""

    num_tokens: int
    # Every request decodes its next token, or verifies its drafts (an idle rank: True).
    decode_only: bool
    graphable: bool  # a decode graph could replay this rank's step (an idle rank: True)
    draft_rows: int = 0  # MTP: requests the drafter's chained passes run for after the step

    @classmethod
    def idle(cls) -> StepHeader:
        return cls(0, True, True)

    @classmethod
    def of(cls, steps: list[StepRequest], graphable: bool, draft_rows: int = 0) -> StepHeader:
        decode_only = all(
            len(s.new_token_ids) == 1 + s.num_drafts and s.num_computed > 0 for s in steps
        )
        return cls(sum(len(s.new_token_ids) for s in steps), decode_only, graphable, draft_rows)


@dataclass(frozen=True)
class GroupStep:
    """What every rank runs this step."""

    num_tokens: tuple[int, ...]  # each rank's
    mode: DispatchMode | None  # None: no rank has tokens, nobody runs a forward
    capacity: int  # DECODE: rows a rank may send each rank
    graph_size: int | None  # every rank replays the decode graph of this size; None: eager
    draft_rows: tuple[int, ...] = ()  # each rank's ``StepHeader.draft_rows``

    @property
    def runs(self) -> bool:
        return self.mode is not None

    def dispatch(self, slot_mapping: torch.Tensor | None = None) -> MoEDispatch:
        return MoEDispatch(self.mode, self.capacity, slot_mapping)

    def plan(self, fb: ForwardBatch) -> None:
        """Give ``fb``'s planned step (``fb.plan``) this step's MoE dispatch."""
        fb.plan = dataclasses.replace(fb.plan, moe_dispatch=self.dispatch(fb.slot_mapping))


def agree(role: str, headers: list[StepHeader], graph_sizes: list[int]) -> GroupStep:
    """The group's step from every rank's header (``graph_sizes`` ascending; [] without
    decode graphs)."""
    tokens = tuple(h.num_tokens for h in headers)
    drafts = tuple(h.draft_rows for h in headers)
    most = max(tokens)
    if most == 0:
        return GroupStep(tokens, None, 0, None, drafts)
    decode = role == "decode" or (role == "mixed" and all(h.decode_only for h in headers))
    graph_size = None
    if decode and all(h.graphable for h in headers):
        graph_size = _smallest_holding(graph_sizes, most)
    mode = DispatchMode.DECODE if decode else DispatchMode.PREFILL
    return GroupStep(tokens, mode, graph_size or most, graph_size, drafts)


@dataclass(frozen=True)
class DraftSteps:
    """What every rank's MTP drafter runs in a group step that runs."""

    first: GroupStep  # over the target's rows; graph_size: a draft graph of that size
    chain: GroupStep | None  # each of the K - 1 chained passes; None: no rank drafts


def agree_drafts(step: GroupStep, draft_sizes: list[int]) -> DraftSteps:
    """The drafter's passes from the group's step (``draft_sizes`` ascending: the draft
    graphs' sizes, the same on every rank; [] without draft graphs)."""
    first = step
    if step.graph_size not in draft_sizes:  # no draft graph: eager, same dispatch
        first = dataclasses.replace(step, graph_size=None)
    most = max(step.draft_rows, default=0)
    if most == 0:
        return DraftSteps(first, None)
    graph_size = None
    if step.mode == DispatchMode.DECODE:
        graph_size = _smallest_holding(draft_sizes, most)
    chain = GroupStep(step.draft_rows, step.mode, graph_size or most, graph_size, step.draft_rows)
    return DraftSteps(first, chain)


def _smallest_holding(sizes: list[int], rows: int) -> int | None:
    return next((s for s in sizes if s >= rows), None)


def dummy_step(
    kv_cache: KVCache, attn_backend: AttentionBackend, device: torch.device
) -> ForwardBatch:
    """An idle rank's eager forward: one padding token (id 0, position 0, over the null
    page) whose KV slot is -1, so it stores nothing and dispatch sends nothing."""
    pad = StepRequest(new_token_ids=[0], num_computed=0, block_ids=[NULL_BLOCK], sample=False)
    fb = build_forward_batch([pad], kv_cache, attn_backend, device, plan=False)
    fb.slot_mapping.fill_(-1)
    return fb


class Lockstep:
    """One rank's side of the exchange."""

    def __init__(self, group: ExpertGroup, role: str):
        self.group, self.role = group, role
        self.mode_counts: Counter[DispatchMode | None] = Counter()  # group steps by mode

    @classmethod
    def join(
        cls, member: GroupMember, model: nn.Module, device: torch.device, role: str,
        max_rows: int = 0,
    ):  # fmt: skip
        """Join the group and hand ``model``'s MoE layers its dispatch and combine
        (``max_rows``: a rank's largest DECODE step, ``group.attach_dispatcher``)."""
        group = member.join(device)
        attach_dispatcher(model, group, max_rows)
        return cls(group, role)

    def exchange(self, header: StepHeader, graph_sizes: list[int]) -> GroupStep:
        h = header
        mine = torch.tensor([h.num_tokens, h.decode_only, h.graphable, h.draft_rows])
        everyone = [torch.empty_like(mine) for _ in range(self.group.size)]
        self.group.control.allgather([everyone], [mine]).wait()
        headers = [StepHeader(int(t), bool(d), bool(g), int(r)) for t, d, g, r in everyone]
        step = agree(self.role, headers, graph_sizes)
        self.mode_counts[step.mode] += 1
        return step
