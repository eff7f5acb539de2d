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
"""

from __future__ import annotations

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
    decode_only: bool  # every request adds one token to its KV (an idle rank: True)
    graphable: bool  # a decode graph could replay this rank's step (an idle rank: True)

    @classmethod
    def idle(cls) -> StepHeader:
        return cls(0, True, True)

    @classmethod
    def of(cls, steps: list[StepRequest], graphable: bool) -> StepHeader:
        decode_only = all(len(s.new_token_ids) == 1 and s.num_computed > 0 for s in steps)
        return cls(sum(len(s.new_token_ids) for s in steps), decode_only, graphable)


@dataclass(frozen=True)
class GroupStep:
    """What every rank runs this step."""

    num_tokens: tuple[int, ...]  # each rank's
    mode: DispatchMode | None  # None: no rank has tokens, nobody runs a forward
    capacity: int  # DECODE: rows a rank may send each rank
    graph_size: int | None  # every rank replays the decode graph of this size; None: eager

    @property
    def runs(self) -> bool:
        return self.mode is not None

    def dispatch(self, slot_mapping: torch.Tensor | None = None) -> MoEDispatch:
        return MoEDispatch(self.mode, self.capacity, slot_mapping)


def agree(role: str, headers: list[StepHeader], graph_sizes: list[int]) -> GroupStep:
    """The group's step from every rank's header (``graph_sizes`` ascending; [] without
    decode graphs)."""
    tokens = tuple(h.num_tokens for h in headers)
    most = max(tokens)
    if most == 0:
        return GroupStep(tokens, None, 0, None)
    decode = role == "decode" or (role == "mixed" and all(h.decode_only for h in headers))
    graph_size = None
    if decode and all(h.graphable for h in headers):
        graph_size = next((s for s in graph_sizes if s >= most), None)
    mode = DispatchMode.DECODE if decode else DispatchMode.PREFILL
    return GroupStep(tokens, mode, graph_size or most, graph_size)


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
    def join(cls, member: GroupMember, model: nn.Module, device: torch.device, role: str):
        """Join the group and hand ``model``'s MoE layers its dispatch and combine."""
        group = member.join(device)
        attach_dispatcher(model, group)
        return cls(group, role)

    def exchange(self, header: StepHeader, graph_sizes: list[int]) -> GroupStep:
        mine = torch.tensor([header.num_tokens, header.decode_only, header.graphable])
        everyone = [torch.empty_like(mine) for _ in range(self.group.size)]
        self.group.control.allgather([everyone], [mine]).wait()
        headers = [StepHeader(int(t), bool(d), bool(g)) for t, d, g in everyone]
        step = agree(self.role, headers, graph_sizes)
        self.mode_counts[step.mode] += 1
        return step
