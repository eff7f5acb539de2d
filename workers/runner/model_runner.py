"""Runs one scheduled step on the device: prepare inputs, forward, logits, sample.

``launch`` queues a step and returns at once (``LaunchedStep.result`` waits for
its tokens), so the engine can schedule and prepare the next step while the
device computes; ``execute`` does both.

On a GPU the forward replays CUDA graphs where the step's shape allows (see
``workers/runner/cuda_graphs``); every other step runs eagerly. The runner also owns
the weights' lifecycle: ``clear_parameters`` drops every graph and frees the
weights, ``load_parameters`` brings new ones, and the graphs are captured
again at the next step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from splitserve.config import CudaGraphConfig
from splitserve.scheduler.request import PLACEHOLDER, Request
from splitserve.scheduler.scheduler import SchedulerOutput, will_sample
from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.parallel.lockstep import (
    GroupStep,
    Lockstep,
    StepHeader,
    agree_drafts,
    dummy_step,
)
from splitserve.workers.runner.cuda_graphs.decode_runner import DecodeGraphRunner
from splitserve.workers.runner.cuda_graphs.draft_runner import DraftGraphRunner
from splitserve.workers.runner.cuda_graphs.owner import GraphOwner
from splitserve.workers.runner.cuda_graphs.piecewise_runner import PiecewiseGraphRunner
from splitserve.workers.runner.cuda_graphs.roles import DECODE, DRAFT, PIECEWISE, graphs_for
from splitserve.workers.runner.forward_batch import ForwardBatch
from splitserve.workers.runner.forward_counts import ForwardCounts, merge_rows
from splitserve.workers.runner.input_batch import (
    StepRequest,
    build_forward_batch,
    consecutive,
    to_device,
)
from splitserve.workers.runner.step_plan import plan_forward
from splitserve.workers.sampling.sampler import SampledTokens, Sampler, TokenLogprobs
from splitserve.workers.spec_decode.speculator import (
    PendingDrafts,
    SpeculativeResult,
    Speculator,
    num_draft_rows,
)


@dataclass
class StepResult:
    # request id -> (tokens, their logprobs): one token, or a verify step's accepted run
    sampled: dict[str, tuple[list[int], list[TokenLogprobs | None]]]
    num_prefill_tokens: int
    num_decode_tokens: int
    # MTP: the drafts for the next step, on the device until ``drafts.result()``
    drafts: PendingDrafts = field(default_factory=PendingDrafts)


@dataclass
class LaunchedStep:
    """A step queued on the device whose tokens the host has not read yet."""

    batch: SchedulerOutput
    sampling: list[Request]  # the requests that sample, in the rows of ``tokens``
    tokens: SampledTokens | None
    num_prefill_tokens: int
    num_decode_tokens: int
    # Request id -> KV transfer that could not be opened (set by the engine).
    send_errors: dict[str, str] = field(default_factory=dict)
    speculative: SpeculativeResult | None = None  # MTP: tokens on the host, drafts pending

    def __post_init__(self) -> None:
        self._rows = {r.request_id: i for i, r in enumerate(self.sampling)}

    def row_of(self, request_id: str) -> int:
        """The row of ``tokens`` that holds the request's sampled token."""
        return self._rows[request_id]

    def result(self) -> StepResult:
        """Wait for the step's tokens on the host (MTP: not for its drafts)."""
        sampled = {}
        if self.speculative is not None:
            spec = self.speculative
            sampled = {rid: (run.token_ids, run.logprobs) for rid, run in spec.runs.items()}
            return StepResult(sampled, self.num_prefill_tokens, self.num_decode_tokens, spec.drafts)
        if self.tokens is not None:
            out = self.tokens.result()
            for r, tok, lp in zip(self.sampling, out.token_ids, out.logprobs):
                sampled[r.request_id] = ([tok], [lp])
        return StepResult(sampled, self.num_prefill_tokens, self.num_decode_tokens)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        attn_backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        graph_limits: GraphLimits | None = None,
        speculator: Speculator | None = None,
        lockstep: Lockstep | None = None,
    ):
        """``graph_limits`` (on a CUDA device) turns CUDA graphs on; ``speculator``
        verifies drafts and proposes the next ones (MTP speculative decoding);
        ``lockstep``: this rank's part in its expert-parallel group's steps."""
        self.model = model
        self.lockstep = lockstep
        self.speculator = speculator
        self.forward_counts = ForwardCounts()  # each step's forward: its kind, how it ran
        self.kv_cache = kv_cache
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device
        self.graphs: GraphOwner | None = None
        self.decode_graphs: DecodeGraphRunner | None = None  # also registered with graphs
        self.draft_graphs: DraftGraphRunner | None = None  # MTP chained drafts, registered too
        if graph_limits is not None and device.type == "cuda":
            self.graphs = self.graph_owner(graph_limits)
        self._param_shapes: dict[str, torch.Size] = {}

    def graph_owner(self, limits: GraphLimits) -> GraphOwner | None:
        """The graphs this worker captures (``roles.py``: by its role), registered with one
        owner; None when there are none."""
        kinds = graphs_for(limits.role)
        owner = GraphOwner(self.device, self.attn_backend, limits.role)
        self.decode_graphs = self.draft_graphs = None
        config = limits.config
        max_blocks = -(-limits.max_model_len // self.kv_cache.block_size)
        # Sizes in tokens: a verify step of every request has 1 + K rows a request.
        rows = limits.max_num_seqs * (1 + self.num_speculative_tokens)
        decode_sizes = [n for n in config.decode_capture_sizes(rows) if n <= rows]
        fits = decode_sizes and self.attn_backend.supports_decode_graphs(
            decode_sizes[-1], max_blocks
        )
        if DECODE in kinds and fits:
            self.decode_graphs = DecodeGraphRunner(
                self.model,
                self.attn_backend,
                self.kv_cache,
                decode_sizes,
                max_blocks,
                self.device,
                expert_parallel=self.lockstep is not None,
            )
            owner.register(self.decode_graphs)
        # The drafter's first pass covers a verify step's rows; its chained steps, one a request.
        if DRAFT in kinds:
            self._register_draft_graphs(owner, decode_sizes, max_blocks)
        prefill_sizes = [n for n in config.prefill_sizes if n <= limits.max_num_batched_tokens]
        piecewise = PIECEWISE in kinds and config.piecewise and prefill_sizes
        if piecewise and self.lockstep is None:  # EP: eager prefill
            owner.register(
                PiecewiseGraphRunner(
                    self.model, self.attn_backend, self.kv_cache, prefill_sizes, self.device
                )
            )
        return owner if owner.runners else None

    def _register_draft_graphs(self, owner: GraphOwner, sizes: list[int], max_blocks: int) -> None:
        """The MTP drafter's chained steps, one graph per batch size, with the one owner."""
        proposer = self.speculator.proposer if self.speculator is not None else None
        backend = proposer.graph_attn_backend if proposer is not None else None
        if (
            backend is None
            or not sizes
            or not backend.supports_decode_graphs(sizes[-1], max_blocks)
        ):
            return
        self.draft_graphs = DraftGraphRunner(
            self.model,
            backend,
            self.kv_cache,
            sizes,
            max_blocks,
            self.device,
            expert_parallel=self.lockstep is not None,
        )
        owner.register(self.draft_graphs)

    def capture_graphs(self) -> None:
        """Capture now (engine start) rather than at the first step that could use them."""
        if self.graphs is not None and not self.graphs.captured:
            self.graphs.capture()

    def execute(
        self, batch: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None
    ) -> StepResult:
        """Run one step and wait for its tokens."""
        return self.launch(batch, on_layer_stored).result()

    @torch.inference_mode()
    def launch(
        self,
        batch: SchedulerOutput,
        on_layer_stored: Callable[[int], None] | None = None,
        previous: LaunchedStep | None = None,
        defer_drafts: bool = False,
        drafts: PendingDrafts | None = None,
    ) -> LaunchedStep:
        """Queue one step on the device: inputs, forward, logits, sampling; wait for nothing.
        (With the MTP drafter: the tokens are read back at once, the drafts left on the
        device; ``drafts``: the step before's, which this step's ``PLACEHOLDER`` drafts
        are read from; ``defer_drafts``: the drafter's passes left to the caller,
        ``speculative.deferred_drafts``.)

        A request's pending token (``PLACEHOLDER``, sampled by ``previous``, still
        in flight) is fed from ``previous``'s tokens on the device. A decode step that
        a graph holds goes to the graph runner as host rows (``replay_steps``: no
        copies); any other is built on the device first.
        """
        steps = [_step_request(r, n) for r, n in zip(batch.requests, batch.num_scheduled_tokens)]
        if self.speculator is not None:
            return self._launch_speculative(batch, steps, on_layer_stored, defer_drafts, drafts)
        graphs = self.decode_graphs
        replay = graphs is not None and on_layer_stored is None and graphs.can_run_steps(steps)
        group = self.group_step(steps, replay)
        if replay and (group is None or group.graph_size is not None):
            self.capture_graphs()
            sources = _pending_sources(steps, batch.requests, previous)
            in_flight = previous.tokens.token_ids if previous and previous.tokens else None
            size = group.graph_size if group is not None else None
            hidden, fb = graphs.replay_steps(steps, sources, in_flight, size)
            self.forward_counts.add("decode", "graph")
        else:
            fb = build_forward_batch(
                steps, self.kv_cache, self.attn_backend, self.device, plan=False
            )
            _feed_pending_tokens(fb, steps, batch.requests, previous)
            fb.on_layer_stored = on_layer_stored
            hidden = self._counted_forward(fb, group)
        logits = self.model.compute_logits(fb.sampled_hidden(hidden))
        sampling = [r for r, s in zip(batch.requests, steps) if s.sample]
        tokens = self.sampler.sample(logits, sampling) if sampling else None
        decode = fb.num_decode_tokens
        return LaunchedStep(batch, sampling, tokens, fb.num_tokens - decode, decode)

    def _launch_speculative(
        self,
        batch: SchedulerOutput,
        steps: list[StepRequest],
        on_layer_stored: Callable[[int], None] | None,
        defer_drafts: bool = False,
        drafts: PendingDrafts | None = None,
    ) -> LaunchedStep:
        """A step with the MTP drafter: forward, verify or sample, draft; the tokens read
        back at once (the accepted runs decide where the drafts go), the drafts launched.
        A draft still on the device (``PLACEHOLDER``) is fed from ``drafts``.

        A step of decodes and verifies replays the decode graph of its token count: a
        request's ``1 + k`` tokens are ``1 + k`` decode rows over its block table, row
        ``j`` attending ``j`` more keys (the causal mask of a verify step). The drafter's
        first pass then replays a draft graph over the same rows."""
        rows = decode_rows(steps)
        graphs = self.decode_graphs if on_layer_stored is None else None
        replay = rows is not None and graphs is not None and graphs.can_run_steps(rows)
        group = self.group_step(steps, replay, num_draft_rows(batch.requests, steps))
        sources, fed = _draft_sources(steps, batch.requests, drafts)
        on_device = drafts.tokens.view(-1) if fed else None
        target: ForwardBatch | list[StepRequest]
        if replay and (group is None or group.graph_size is not None):
            self.capture_graphs()
            size = group.graph_size if group is not None else None
            hidden, fb = graphs.replay_steps(rows, sources, on_device, size)
            self.forward_counts.add("verify" if len(rows) > len(steps) else "decode", "graph")
            target, input_ids = rows, fb.input_ids  # the drafter's first pass: the same rows
        else:
            target = build_forward_batch(
                steps, self.kv_cache, self.attn_backend, self.device, plan=False
            )
            if fed:
                _feed_rows(target.input_ids, fed, [sources[r] for r in fed], on_device)
            target.on_layer_stored = on_layer_stored  # the MTP layer's KV follows the target's
            hidden = self._counted_forward(target, group)
            input_ids = target.input_ids
        # The step's graph decision, made once, goes to the drafter (with expert
        # parallelism the group's: every rank runs the same drafter passes).
        draft_graphs = self.draft_graphs if on_layer_stored is None else None
        if draft_graphs is not None:
            self.capture_graphs()
        agreed = agree_drafts(group, self._draft_sizes()) if group is not None else None
        spec = self.speculator.run(
            target, input_ids, hidden, batch.requests, steps, draft_graphs, agreed, defer_drafts
        )
        sampling = [r for r, s in zip(batch.requests, steps) if s.sample]
        num_tokens = sum(len(s.new_token_ids) for s in steps)
        decode = sum(
            len(s.new_token_ids)
            for s in steps
            if s.num_computed and len(s.new_token_ids) == 1 + s.num_drafts
        )
        return LaunchedStep(batch, sampling, None, num_tokens - decode, decode, speculative=spec)

    def forward_rows(self) -> list[list]:
        """Every forward so far, the MTP drafter's passes included (``ForwardCounts.rows``)."""
        if self.speculator is None:
            return self.forward_counts.rows()
        return merge_rows(
            self.forward_counts.rows(), self.speculator.proposer.forward_counts.rows()
        )

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculator.num_speculative_tokens if self.speculator is not None else 0

    def forward(
        self, fb: ForwardBatch, use_graphs: bool = True, group: GroupStep | None = None
    ) -> torch.Tensor:
        """Hidden states of the step's tokens: a graph replay where one fits, else eager.
        ``group``: the expert-parallel group's step (eager, its MoE dispatch planned)."""
        return self._forward(fb, use_graphs, group)[0]

    def _counted_forward(self, fb: ForwardBatch, group: GroupStep | None) -> torch.Tensor:
        """``forward`` of a step's batch, counted by its kind and how it ran."""
        hidden, how = self._forward(fb, True, group)
        self.forward_counts.add(fb.phase.value, how)
        return hidden

    def _forward(
        self, fb: ForwardBatch, use_graphs: bool, group: GroupStep | None
    ) -> tuple[torch.Tensor, str]:
        if self.graphs is not None and use_graphs and group is None:
            self.capture_graphs()
            runner = self.graphs.runner_for(fb)
            if runner is not None:
                how = "piecewise" if runner.name.startswith("piecewise") else "graph"
                return runner.forward(fb), how
        plan_forward(fb)
        if group is not None:
            fb.plan = dataclasses.replace(fb.plan, moe_dispatch=group.dispatch(fb.slot_mapping))
        return self.model(fb.input_ids, fb.positions, fb), "eager"

    # -- expert parallelism ----------------------------------------------------

    def group_step(
        self, steps: list[StepRequest], replay: bool, draft_rows: int = 0
    ) -> GroupStep | None:
        """The group's agreement on this step (None: no expert parallelism)."""
        if self.lockstep is None:
            return None
        header = StepHeader.of(steps, replay, draft_rows)
        return self.lockstep.exchange(header, self._graph_sizes())

    def _graph_sizes(self) -> list[int]:
        return self.decode_graphs.sizes if self.decode_graphs is not None else []

    def _draft_sizes(self) -> list[int]:
        return self.draft_graphs.sizes if self.draft_graphs is not None else []

    @torch.inference_mode()
    def idle_step(self) -> None:
        """A rank of an expert-parallel group with no work: its part of the group's step,
        a dummy forward (padding rows only, nothing stored or sent) if any rank has work,
        and with the MTP drafter its dummy drafter passes."""
        group = self.lockstep.exchange(StepHeader.idle(), self._graph_sizes())
        if not group.runs:
            return
        if group.graph_size is not None:
            self.capture_graphs()
            self.decode_graphs.replay_padding(group.graph_size)
        else:
            self.forward(dummy_step(self.kv_cache, self.attn_backend, self.device), group=group)
        if self.speculator is not None:
            drafts = agree_drafts(group, self._draft_sizes())
            self.speculator.proposer.idle(drafts, self.draft_graphs)

    # -- weights -------------------------------------------------------------

    def clear_parameters(self) -> None:
        """Drop every CUDA graph, then free the weights' memory (before a weight update)."""
        if self.graphs is not None:
            self.graphs.clear()
        for name, param in self.model.named_parameters():
            self._param_shapes[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def load_parameters(self, load: Callable[[nn.Module], None]) -> None:
        """Re-create freed weights at their shapes, then ``load(model)`` fills them.

        Graphs are dropped first in any case (they hold the old addresses) and
        are captured again at the next step.
        """
        if self.graphs is not None:
            self.graphs.clear()
        for name, param in self.model.named_parameters():
            shape = self._param_shapes.get(name)
            if shape is not None and param.numel() == 0:
                param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        self._param_shapes = {}
        load(self.model)


@dataclass(frozen=True)
class GraphLimits:
    """What bounds the captured sizes: the graph config and the scheduler's limits."""

    config: CudaGraphConfig
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    role: str = "mixed"  # which graphs the worker's steps can replay (``cuda_graphs/roles.py``)


def decode_rows(steps: list[StepRequest]) -> list[StepRequest] | None:
    """A step whose requests all decode or verify as one decode row a token (row ``j`` of a
    request: its token ``j`` after ``num_computed + j`` keys); None when one prefills."""
    if not all(s.num_computed and len(s.new_token_ids) == 1 + s.num_drafts for s in steps):
        return None
    return [
        StepRequest([token], s.num_computed + j, s.block_ids, sample=True)
        for s in steps
        for j, token in enumerate(s.new_token_ids)
    ]


def _step_request(request: Request, num_tokens: int) -> StepRequest:
    start = request.num_computed_tokens
    return StepRequest(
        new_token_ids=request.token_ids_between(start, start + num_tokens),
        num_computed=start,
        block_ids=request.block_ids,
        sample=will_sample(request, num_tokens),
        num_drafts=max(0, start + num_tokens - request.num_tokens),
    )


def _pending_sources(
    steps: list[StepRequest], requests: list[Request], previous: LaunchedStep | None
) -> list[int]:
    """For each request, the row of ``previous``'s tokens that holds its pending token
    (``PLACEHOLDER``, in flight), or -1. A pending token is always its request's last
    token, so only a step's last input can be one."""
    sources = []
    for step, request in zip(steps, requests):
        if step.new_token_ids[-1] != PLACEHOLDER:
            sources.append(-1)
            continue
        if previous is None or previous.tokens is None:
            raise RuntimeError(
                f"request {request.request_id!r} has a pending token but no step in flight"
            )
        sources.append(previous.row_of(request.request_id))
    return sources


def _feed_pending_tokens(
    fb: ForwardBatch,
    steps: list[StepRequest],
    requests: list[Request],
    previous: LaunchedStep | None,
) -> None:
    """Write the in-flight tokens of the previous step into ``fb.input_ids`` on the device."""
    rows, sources, end = [], [], 0
    for step, source in zip(steps, _pending_sources(steps, requests, previous)):
        end += len(step.new_token_ids)
        if source >= 0:
            rows.append(end - 1)
            sources.append(source)
    if rows:
        _feed_rows(fb.input_ids, rows, sources, previous.tokens.token_ids)


def _draft_sources(
    steps: list[StepRequest], requests: list[Request], drafts: PendingDrafts | None
) -> tuple[list[int], list[int]]:
    """For each row of the step, the index in ``drafts.tokens.view(-1)`` of the draft it
    reads (a draft still on the device: ``PLACEHOLDER``), else -1; and the rows that read
    one. Only a step's trailing ``num_drafts`` rows can (drafts 0, 1, ...)."""
    sources: list[int] = []
    rows: list[int] = []
    for step, request in zip(steps, requests):
        n = len(step.new_token_ids)
        sources += [-1] * (n - step.num_drafts)
        for k, token in enumerate(step.new_token_ids[n - step.num_drafts :]):
            if token != PLACEHOLDER:
                sources.append(-1)
                continue
            if drafts is None or drafts.tokens is None:
                raise RuntimeError(
                    f"request {request.request_id!r} verifies a draft that is on no device"
                )
            rows.append(len(sources))
            sources.append(drafts.source(request.request_id, k))
    return sources, rows


def _feed_rows(
    input_ids: torch.Tensor, rows: list[int], sources: list[int], tokens: torch.Tensor
) -> None:
    """``input_ids[rows[i]] = tokens[sources[i]]`` on the device."""
    dst, src = consecutive(rows), consecutive(sources)
    if dst is not None and src is not None:  # a steady decode: one copy, no index upload
        input_ids[dst].copy_(tokens[src])
        return
    rows_t, sources_t = to_device([rows, sources], input_ids.device)
    input_ids[rows_t] = tokens[sources_t]
