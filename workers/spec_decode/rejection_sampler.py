"""Verification: the target's logits at a request's ``1 + k`` verify rows against its drafts.

Row ``j`` of a request holds the target's distribution ``p_j`` for the token after
``[last token, d_1 .. d_j]``. The drafter is greedy, so each draft is a point mass
(``q = onehot(d)``), and:

- greedy requests accept drafts while each equals the target's argmax; the token
  after the run is the target's argmax at the first mismatch, or at the last row
  (the bonus token) when every draft was accepted;
- sampled requests accept ``d_j`` with probability ``min(1, p_j(d) / q(d)) =
  p_j(d)``; at the first rejection the token is drawn from ``p_j`` without ``d``
  (``norm(max(0, p - q))``), after ``k`` acceptances from ``p_k`` (the bonus).
  Each emitted token is then distributed exactly as the target's ``p``.

``p`` is what the sampler would draw from: ``min_tokens`` masks (counting the
drafts before the row), temperature, top-k, top-p and min-p. Requests whose
sampling reads their output tokens (penalties, bad words) are not drafted for
(``drafts_allowed``); the plain sampler serves them.

Randomness: every step a request draws ``k`` uniforms and one vocabulary row of
Exp(1) noise from ``Sampler.generator`` (its own when seeded), whatever it
accepts, so a seeded request's tokens do not depend on the batch. The drawn token
is ``argmax(residual / noise)`` (the sampler's exponential race).

Logprobs: of each emitted token under the raw target distribution at its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.scheduler.request import Request
from splitserve.workers.runner.host_copy import HostCopy
from splitserve.workers.runner.input_batch import to_device
from splitserve.workers.sampling.sampler import Sampler, TokenLogprobs, filter_logits


@dataclass
class VerifiedRun:
    """What one request emits in a verify step: its accepted drafts, then one more token."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


class PendingRuns:
    """A verification queued on the device: ``emitted`` there (row ``j`` of a request: the
    token it emits if its run reaches the row), and a copy of the outcome on its way to
    the host; ``result`` waits for the copy alone, not for work queued after it."""

    def __init__(
        self,
        emitted: torch.Tensor,
        outcome: torch.Tensor,  # [2, rows]: accepted (0/1), emitted
        logits: torch.Tensor,
        counts: list[int],
        requests: list[Request],
    ):
        self.emitted = emitted
        self._logits, self._counts, self._requests = logits, counts, requests
        self._outcome = HostCopy([outcome], outcome.device)

    def result(self) -> list[VerifiedRun]:
        """Each request's run: its accepted drafts, then one more token (with logprobs)."""
        accepted, emitted = self._outcome.wait()[0].tolist()
        runs, start = [], 0
        for n in self._counts:
            a = 0
            while a < n - 1 and accepted[start + a]:
                a += 1
            runs.append(VerifiedRun(emitted[start : start + a + 1], []))
            start += n
        RejectionSampler._logprobs(self._logits, runs, self._requests, self._counts)
        return runs


def drafts_allowed(request: Request) -> bool:
    """Whether the request may verify drafts (its sampling reads no output tokens)."""
    return not request.sampling_params.reads_output_tokens


class RejectionSampler:
    def __init__(self, sampler: Sampler, simulated_acceptance: float | None = None):
        """``simulated_acceptance`` (benchmarks only): each draft becomes the target's greedy
        token with this probability before it is verified (``SpeculativeConfig``)."""
        self.sampler = sampler  # its random generators
        self.simulated_acceptance = simulated_acceptance
        self._simulation: torch.Generator | None = None

    def verify(
        self,
        logits: torch.Tensor,
        draft_ids: torch.Tensor,
        counts: list[int],
        requests: list[Request],
    ) -> list[VerifiedRun]:
        """``launch``, then wait for its runs."""
        return self.launch(logits, draft_ids, counts, requests).result()

    def launch(
        self,
        logits: torch.Tensor,
        draft_ids: torch.Tensor,
        counts: list[int],
        requests: list[Request],
    ) -> PendingRuns:
        """``logits``: ``[sum(counts), V]``, request ``i``'s ``counts[i] = 1 + k`` rows in a
        run; ``draft_ids``: on the same rows, the draft each row verifies (-1 on a bonus
        row), on the device (``draft_tensor`` makes it from host lists). Queues the
        verification and the copy of its outcome to the host; waits for nothing."""
        assert logits.shape[0] == sum(counts) == draft_ids.shape[0], (logits.shape, counts)
        device = logits.device
        x = logits.to(torch.float32, copy=True)
        _apply_min_tokens(x, requests, counts)
        candidate = x.argmax(dim=-1)
        if self.simulated_acceptance is not None:
            draft_ids = self._simulate(draft_ids, candidate)
        accepted = candidate == draft_ids
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled:
            rows = _rows_of(sampled, counts)
            index = to_device(rows, device)
            accept, draw = self._rejection(
                x[index],
                draft_ids[index],
                [requests[i] for i in sampled],
                [counts[i] for i in sampled],
            )
            accepted[index], candidate[index] = accept, draw
        # Row j emits its draft while the run holds, then the target's token.
        emitted = torch.where(accepted, draft_ids, candidate)
        outcome = torch.stack([accepted.long(), emitted])
        return PendingRuns(emitted, outcome, logits, counts, requests)

    def _rejection(
        self,
        x: torch.Tensor,  # [rows, V] float32 logits of the sampled requests
        draft_ids: torch.Tensor,  # [rows], -1 on bonus rows
        requests: list[Request],
        counts: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: whether its draft is accepted, and the token drawn were it the last."""
        device, vocab = x.device, x.shape[1]
        params = [r.sampling_params for r in requests]
        per_row = lambda values: torch.tensor(  # noqa: E731
            [v for v, n in zip(values, counts) for _ in range(n)]
        )
        temperature = per_row([p.temperature for p in params]).to(device, non_blocking=True)
        top_k, top_p, min_p = (
            per_row([getattr(p, key) for p in params]) for key in ("top_k", "top_p", "min_p")
        )
        probs = filter_logits(x / temperature[:, None], top_k, top_p, min_p).softmax(dim=-1)
        uniform = torch.empty(x.shape[0], device=device)
        noise = torch.empty(x.shape[0], vocab, device=device)
        start = 0
        for r, n in zip(requests, counts):
            gen = self.sampler.generator(r, device, vocab)
            uniform[start : start + n].uniform_(generator=gen)
            noise[start].exponential_(generator=gen)
            noise[start + 1 : start + n] = noise[start]  # one draw, whichever row ends the run
            start += n
        has_draft = draft_ids >= 0
        safe_ids = draft_ids.clamp(min=0)[:, None]
        p_draft = probs.gather(1, safe_ids)[:, 0].masked_fill(~has_draft, 0.0)
        accept = uniform < p_draft
        residual = torch.where(has_draft[:, None], probs.scatter(1, safe_ids, 0.0), probs)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return accept, residual.div_(noise).argmax(dim=-1)

    def _simulate(self, draft_ids: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """Benchmarks only: each draft replaced by the target's greedy token with
        probability ``simulated_acceptance`` (its own generator, seed 0)."""
        device = draft_ids.device
        if self._simulation is None:
            self._simulation = torch.Generator(device).manual_seed(0)
        draw = torch.rand(draft_ids.shape, generator=self._simulation, device=device)
        hit = (draw < self.simulated_acceptance) & (draft_ids >= 0)
        return torch.where(hit, candidate, draft_ids)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, runs: list[VerifiedRun], requests: list[Request], counts: list[int]
    ) -> None:
        """Fill each run's logprobs (None entries for requests that did not ask)."""
        rows, tokens, owners = [], [], []
        start = 0
        for i, (run, r, n) in enumerate(zip(runs, requests, counts)):
            run.logprobs = [None] * len(run.token_ids)
            if r.sampling_params.logprobs is not None:
                rows += range(start, start + len(run.token_ids))
                tokens += run.token_ids
                owners += [(i, j) for j in range(len(run.token_ids))]
            start += n
        if not rows:
            return
        device = logits.device
        logprobs = torch.log_softmax(logits[to_device(rows, device)].float(), dim=-1)
        chosen = logprobs.gather(1, to_device(tokens, device)[:, None])[:, 0].tolist()
        n_top = min(max(requests[i].sampling_params.logprobs for i, _ in owners), logprobs.shape[1])
        top_values, top_ids = (t.tolist() for t in logprobs.topk(n_top, dim=-1))
        for (i, j), token, lp, values, ids in zip(owners, tokens, chosen, top_values, top_ids):
            k = requests[i].sampling_params.logprobs
            runs[i].logprobs[j] = TokenLogprobs(token, lp, list(zip(ids[:k], values[:k])))


def draft_tensor(
    drafts: list[list[int]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, list[int]]:
    """``verify``'s ``draft_ids`` and ``counts`` from host drafts: each request's drafts, then
    -1 on its bonus row."""
    rows = [t for d in drafts for t in (*d, -1)]
    return to_device(rows, device), [len(d) + 1 for d in drafts]


def _rows_of(indices: list[int], counts: list[int]) -> list[int]:
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    return [row for i in indices for row in range(starts[i], starts[i + 1])]


def _apply_min_tokens(x: torch.Tensor, requests: list[Request], counts: list[int]) -> None:
    """Ban EOS and stop ids on the rows whose token would come before ``min_tokens``
    (row ``j`` emits output token ``num_output_tokens + j + 1``)."""
    rows, cols, start = [], [], 0
    for r, n in zip(requests, counts):
        p = r.sampling_params
        banned = [t for t in {*r.eos_token_ids, *p.stop_token_ids} if t < x.shape[1]]
        for j in range(n):
            if r.num_output_tokens + j < p.min_tokens:
                rows += [start + j] * len(banned)
                cols += banned
        start += n
    if rows:
        index = (to_device(rows, x.device), to_device(cols, x.device))
        x.index_put_(index, torch.tensor(float("-inf"), device=x.device))
