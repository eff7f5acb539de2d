"""One speculative step after the target's forward: verify, then draft the next tokens.

A request that samples in the step either verifies drafts (its last ``1 + k``
rows; ``RejectionSampler``) or samples one token as usual (``Sampler``: a prompt's
first token, or a request that may not be drafted for). Then the MTP drafter
(``MTPProposer``) runs over the step's rows and drafts for every sampling request
that may be drafted for; the scheduler trims the drafts to what the next step can
verify.

The order keeps the device busy while the host waits or works: the sampling and the
verification are queued with the copy of their outcome to the host (``Emission``);
the token after each row is written on the device, so the drafter's first pass (over
every row) is queued next; only then does the host wait, for the copy alone, and the
accepted runs say where each request's chained drafts start (``MTPProposer.chain``).

The drafts stay on the device (``PendingDrafts``): the drafter's passes run while the
host turns the step's tokens into outputs and schedules the next step, which sizes
each request's step by its number of drafts alone (their ids read as ``PLACEHOLDER``);
the next step's inputs take them from the device, and verification reads them from
those inputs. The one read-back of a step is its accepted runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve.scheduler.request import Request
from splitserve.workers.parallel.lockstep import DraftSteps
from splitserve.workers.runner.cuda_graphs.draft_runner import DraftGraphRunner
from splitserve.workers.runner.forward_batch import ForwardBatch
from splitserve.workers.runner.input_batch import StepRequest, to_device
from splitserve.workers.sampling.sampler import SampledTokens, Sampler
from splitserve.workers.spec_decode.mtp_proposer import MTPProposer
from splitserve.workers.spec_decode.rejection_sampler import (
    PendingRuns,
    RejectionSampler,
    VerifiedRun,
    drafts_allowed,
)


@dataclass
class PendingDrafts:
    """The drafts for the next step, launched on the device. The next verify step reads
    them there (``source``: where a request's draft is); ``result()`` reads them back
    (once) as request id -> drafts, for what must leave the device (a prefill worker's
    hand-off)."""

    requests: list[Request] = field(default_factory=list)  # the drafted ones, in rows
    tokens: torch.Tensor | None = None  # [rows, K]; None once read back
    _drafts: dict[str, list[int]] | None = field(default=None, init=False, repr=False)
    _rows: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._rows = {r.request_id: i for i, r in enumerate(self.requests)}

    @property
    def read_back(self) -> bool:
        return self._drafts is not None

    def source(self, request_id: str, k: int) -> int:
        """The index of the request's draft ``k`` (from 0) in ``tokens.view(-1)``."""
        return self._rows[request_id] * self.tokens.shape[1] + k

    def result(self) -> dict[str, list[int]]:
        if self._drafts is None:
            rows = self.tokens.tolist() if self.tokens is not None else []
            self._drafts = {r.request_id: d for r, d in zip(self.requests, rows)}
            self.tokens = None
        return self._drafts


@dataclass
class SpeculativeResult:
    """A speculative step: the tokens emitted (on the host, per sampling request id) and
    the drafts for the next step (on the device)."""

    runs: dict[str, VerifiedRun] = field(default_factory=dict)
    drafts: PendingDrafts = field(default_factory=PendingDrafts)
    # ``run(defer_drafts=True)``: the drafter's passes, not run yet (``drafts`` is empty)
    deferred_drafts: Callable[[], PendingDrafts] | None = None


class Speculator:
    def __init__(
        self,
        model,
        proposer: MTPProposer,
        sampler: Sampler,
        simulated_acceptance: float | None = None,
    ):
        self.model = model
        self.proposer = proposer
        self.sampler = sampler
        self.rejection_sampler = RejectionSampler(sampler, simulated_acceptance)

    @property
    def num_speculative_tokens(self) -> int:
        return self.proposer.num_speculative_tokens

    def run(
        self,
        target: ForwardBatch | list[StepRequest],
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        requests: list[Request],
        steps: list[StepRequest],
        draft_graphs: DraftGraphRunner | None = None,
        group: DraftSteps | None = None,
        defer_drafts: bool = False,
    ) -> SpeculativeResult:
        """Verify or sample, then draft (``target``: the target's eager batch, or its decode
        rows when it replayed a decode graph; ``input_ids``: the step's tokens as the
        target read them, on the device (a draft of the step before may be known only
        there: ``PLACEHOLDER`` in the host's lists); ``draft_graphs``: the step may replay the
        drafter's graphs; ``group``: the expert-parallel group's drafter passes); waits
        for the tokens, not for the drafts. ``defer_drafts``: return once the tokens are
        in, the drafter's passes as ``deferred_drafts`` (a prefill worker's first tokens
        go out first; the caller runs them before the next forward, which may reuse
        ``hidden``'s memory)."""
        starts = [0]
        for s in steps:
            starts.append(starts[-1] + len(s.new_token_ids))
        sampling = [i for i, s in enumerate(steps) if s.sample]
        emission = self._emit(input_ids, hidden, requests, steps, starts, sampling)
        # The token after each row, on the device: the drafter's first pass can start
        # before the host has the tokens.
        next_ids = to_device(_following(requests, steps), hidden.device)
        emission.write_into(next_ids)
        args = (target, hidden, next_ids)
        if defer_drafts:
            runs = emission.runs()
            draft_rows, drafted = _draft_rows(runs, requests, steps, starts)

            def draft() -> PendingDrafts:
                drafts = self.proposer.propose(*args, draft_rows, draft_graphs, group)
                return PendingDrafts(drafted, drafts)

            return SpeculativeResult(runs=_by_id(runs, requests), deferred_drafts=draft)
        first = self.proposer.first_pass(*args, draft_graphs, group)
        runs = emission.runs()  # waits for the verification, not for the first pass
        draft_rows, drafted = _draft_rows(runs, requests, steps, starts)
        drafts = self.proposer.chain(first, draft_rows, draft_graphs, group)
        return SpeculativeResult(_by_id(runs, requests), PendingDrafts(drafted, drafts))

    def _emit(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        requests: list[Request],
        steps: list[StepRequest],
        starts: list[int],
        sampling: list[int],
    ) -> Emission:
        """Sample (a request without drafts) or verify (one with) each sampling request's
        rows, queued on the device."""
        device = hidden.device
        emission = Emission()
        emission.plain = [i for i in sampling if steps[i].num_drafts == 0]
        emission.verifying = [i for i in sampling if steps[i].num_drafts > 0]
        if emission.plain:
            rows = to_device([starts[i + 1] - 1 for i in emission.plain], device)
            logits = self.model.compute_logits(hidden[rows])
            sampled = self.sampler.sample(logits, [requests[i] for i in emission.plain])
            emission.sampled, emission.written = sampled, [(rows, sampled.token_ids)]
        if emission.verifying:
            # Each verify row's draft is the input a row below it (the bonus row has none):
            # read on the device, where a draft of the step before still is.
            rows, below, bonus = [], [], len(input_ids)
            for i in emission.verifying:
                end = starts[i + 1]
                rows += range(end - 1 - steps[i].num_drafts, end)
                below += [*range(end - steps[i].num_drafts, end), bonus]
            index = to_device([rows, below], device)
            logits = self.model.compute_logits(hidden[index[0]])
            draft_ids = torch.cat([input_ids, input_ids.new_full((1,), -1)])[index[1]]
            counts = [1 + steps[i].num_drafts for i in emission.verifying]
            verified = self.rejection_sampler.launch(
                logits, draft_ids, counts, [requests[i] for i in emission.verifying]
            )
            emission.verified = verified
            emission.written.append((index[0], verified.emitted))
        return emission


@dataclass
class Emission:
    """A step's sampling and verification, queued on the device: what each sampling
    request emits, there row by row (``written``: rows, the token after each) and on its
    way to the host (``runs``)."""

    plain: list[int] = field(default_factory=list)  # sampling requests without drafts
    sampled: SampledTokens | None = None
    verifying: list[int] = field(default_factory=list)  # those with drafts
    verified: PendingRuns | None = None
    written: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def write_into(self, next_ids: torch.Tensor) -> None:
        """Each emitting row's next token into ``next_ids``, on the device."""
        for rows, tokens in self.written:
            next_ids[rows] = tokens

    def runs(self) -> dict[int, VerifiedRun]:
        """Per sampling request (by index): the tokens it emits; waits for them."""
        runs: dict[int, VerifiedRun] = {}
        if self.sampled is not None:
            out = self.sampled.result()
            for i, token, lp in zip(self.plain, out.token_ids, out.logprobs):
                runs[i] = VerifiedRun([token], [lp])
        if self.verified is not None:
            runs.update(zip(self.verifying, self.verified.result()))
        return dict(sorted(runs.items()))


def _following(requests: list[Request], steps: list[StepRequest]) -> list[int]:
    """The token after each row of the step as the host knows it: the next input, or for
    a prompt chunk's last row the next prompt token. An emitting row's is written on the
    device (``Emission.write_into``); after a rejected draft the row's token does not
    matter (its MTP KV is written again next step), and a draft the host has not read
    reads as 0."""
    following: list[int] = []
    for request, step in zip(requests, steps):
        ids = step.new_token_ids
        row = ids[1:] + [0]
        if step.num_drafts:  # only the trailing drafts can be on the device alone
            tail = len(row) - 1 - step.num_drafts
            row[tail:] = [max(t, 0) for t in row[tail:]]
        if not step.sample:
            end = step.num_computed + len(ids)
            row[-1] = request.token_ids_between(end, end + 1)[0]
        following += row
    return following


def _draft_rows(
    runs: dict[int, VerifiedRun],
    requests: list[Request],
    steps: list[StepRequest],
    starts: list[int],
) -> tuple[list[int], list[Request]]:
    """The row of each drafted request's last emitted token, and those requests."""
    rows, drafted = [], []
    for i, run in runs.items():
        request, step = requests[i], steps[i]
        if drafts_after(request, step):
            base = len(step.new_token_ids) - 1 - step.num_drafts
            rows.append(starts[i] + base + len(run.token_ids) - 1)
            drafted.append(request)
    return rows, drafted


def _by_id(runs: dict[int, VerifiedRun], requests: list[Request]) -> dict[str, VerifiedRun]:
    return {requests[i].request_id: r for i, r in runs.items()}


def drafts_after(request: Request, step: StepRequest) -> bool:
    """Whether the drafter drafts for ``request`` after its step: it samples in the step
    and may verify drafts."""
    return step.sample and drafts_allowed(request)


def num_draft_rows(requests: list[Request], steps: list[StepRequest]) -> int:
    """The rows of the drafter's chained passes after this step (one a drafted request)."""
    return sum(drafts_after(r, s) for r, s in zip(requests, steps))
