"""Sampler: logits ``[B, V]`` -> one token (and optional logprobs) per request.

Order, as in vLLM: penalties, min_tokens and bad-words masks on the raw logits;
greedy rows take the argmax; the other rows divide by temperature, apply top-k,
top-p and min-p, and sample by an exponential race (``argmax(probs / q)``,
``q ~ Exp(1)``). A seeded request draws ``q`` from its own generator, one full
vocabulary row per step, so its tokens do not depend on the rest of the batch.
Logprobs always describe the raw model distribution. A batch of greedy rows
without logprobs that no processor edits takes one argmax of the model's own
logits: no float32 copy, and on CUDA one launch (``ops.argmax``) that also
stores the tokens into page-locked host memory, so no copy to the host follows
(a decode step's tail, ``docs/PERFORMANCE.md``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.kernels import ops
from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.request import Request
from splitserve.workers.runner.host_copy import HostCopy
from splitserve.workers.runner.input_batch import to_device
from splitserve.workers.runner.pinned_ring import PinnedRing, PinnedSlot
from splitserve.workers.sampling.logits_processors import (
    BadWords,
    apply_min_tokens,
    apply_penalties,
    edits_logits,
)

logger = logging.getLogger(__name__)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token, under log_softmax of the raw logits
    top: list[tuple[int, float]]  # top-n (token_id, logprob) of the raw distribution, desc


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf what top-k (0 = off), top-p (keep the smallest head with cumulative
    prob >= top_p) and then min-p (prob < min_p * max prob) drop. The top token stays."""
    vocab_size = logits.shape[1]
    use_k, use_p, use_min = (top_k > 0) & (top_k < vocab_size), top_p < 1.0, min_p > 0.0
    # Parameters given on the host are checked there, without waiting for the device.
    any_k, any_p, any_min = bool(use_k.any()), bool(use_p.any()), bool(use_min.any())
    if not (any_k or any_p or any_min):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size, device=device)
    keep = torch.where(use_k, top_k, vocab_size).to(device, non_blocking=True)
    sorted_logits.masked_fill_(rank >= keep[:, None], -torch.inf)
    if any_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # exclusive cumsum; 0 at rank 0
        top_p, use_p = (t.to(device, non_blocking=True) for t in (top_p, use_p))
        drop = (mass_before >= top_p[:, None]) & use_p[:, None]
        sorted_logits.masked_fill_(drop, -torch.inf)
    if any_min:
        probs = sorted_logits.softmax(dim=-1)
        min_p = min_p.to(device, non_blocking=True)
        sorted_logits.masked_fill_(probs < min_p[:, None] * probs[:, :1], -torch.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class SampledTokens:
    """One step's sampled tokens and logprobs, on their way from the device to the host.

    The copies are queued without waiting; ``result`` waits for them. Until then
    the host is free to prepare the next step, which reads ``token_ids`` on the
    device. ``host_tokens``: a page-locked slot that the sampling kernel fills
    with the tokens itself, so they need no copy; it is handed out again once the
    step's ``ready`` event has passed.
    """

    def __init__(
        self,
        token_ids: torch.Tensor,
        requests: list[Request],
        logprob_rows: list[int],
        chosen: torch.Tensor | None = None,
        top_values: torch.Tensor | None = None,
        top_ids: torch.Tensor | None = None,
        host_tokens: PinnedSlot | None = None,
    ) -> None:
        self.token_ids = token_ids  # [B] int64 on the device
        self._requests = requests
        self._logprob_rows = logprob_rows
        self._host_tokens = host_tokens
        copied = token_ids if host_tokens is None else None
        tensors = [t for t in (copied, chosen, top_values, top_ids) if t is not None]
        self._copy = HostCopy(tensors, token_ids.device)
        if host_tokens is not None:
            host_tokens.queued(self._copy.ready)

    def result(self) -> SamplerOutput:
        """Wait for the copies; the tokens and logprobs as host values."""
        host = self._copy.wait()
        if self._host_tokens is not None:
            self._host_tokens.check()
            host = [self._host_tokens.tensor, *host]
        token_ids = host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self._logprob_rows:
            chosen, top_values, top_ids = (t.tolist() for t in host[1:])
            for j, i in enumerate(self._logprob_rows):
                k = self._requests[i].sampling_params.logprobs
                top = list(zip(top_ids[j][:k], top_values[j][:k]))
                logprobs[i] = TokenLogprobs(token_ids[i], chosen[j], top)
        return SamplerOutput(token_ids, logprobs)


class Sampler:
    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.seed = seed
        self.bad_words = BadWords(tokenizer)
        self._generator: torch.Generator | None = None  # for unseeded rows
        self._request_generators: dict[str, torch.Generator] = {}
        self._host_tokens: PinnedRing | None = None  # on CUDA: where the argmax stores tokens
        self.failures: dict[str, str] = {}  # request id -> why it could not be sampled

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        return self.sample(logits, requests).result()

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampledTokens:
        """Queue the sampling of one token per row; nothing here waits for the device.

        A request whose row fails to sample on its own (its settings, or a processor
        that raises on it) does not fail the batch: its row is sampled greedily
        instead and ``failures`` says why, for the engine to end that request with an
        error. In that step the other seeded rows may draw differently than they
        would have without it.
        """
        assert logits.shape[0] == len(requests), (logits.shape, len(requests))
        try:
            return self._sample_batch(logits, requests)
        except Exception:
            failed = self._failing_rows(logits, requests)
            if not failed:
                raise  # not one request's doing: the engine cannot go on
        stand_ins = [_stand_in(r) if i in failed else r for i, r in enumerate(requests)]
        for i, error in failed.items():
            self.failures[requests[i].request_id] = error
        return self._sample_batch(logits, stand_ins)

    def _failing_rows(self, logits: torch.Tensor, requests: list[Request]) -> dict[int, str]:
        """Row -> error, for the rows that fail when sampled alone."""
        failed = {}
        for i, request in enumerate(requests):
            try:
                self._sample_batch(logits[i : i + 1], [request]).result()
            except Exception as e:
                logger.exception("sampling request %s failed", request.request_id)
                failed[i] = f"sampling failed: {type(e).__name__}: {e}"
        return failed

    def _sample_batch(self, logits: torch.Tensor, requests: list[Request]) -> SampledTokens:
        if not edits_logits(requests) and all(_plain_greedy(r) for r in requests):
            # Nothing edits or reads the float32 logits: one argmax, no copies (an argmax of
            # the model's dtype picks what the float32 one picks, first index on ties).
            return self._greedy(logits, requests)
        x = logits.to(torch.float32, copy=True)  # the processors edit it; logits stay raw
        apply_penalties(x, requests)
        apply_min_tokens(x, requests)
        self.bad_words.apply(x, requests)
        tokens = x.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if rows:
            index = to_device(rows, x.device)
            tokens[index] = self._sample(x[index], [requests[i] for i in rows])
        # A row with every token banned falls back to the unmasked argmax.
        dead = x.amax(dim=-1) == -torch.inf
        tokens = torch.where(dead, logits.argmax(dim=-1), tokens)
        return self._with_logprobs(logits, tokens, requests)

    def _greedy(self, logits: torch.Tensor, requests: list[Request]) -> SampledTokens:
        """The argmax of each row; on CUDA stored into a page-locked slot by the kernel."""
        if not logits.is_cuda:
            return SampledTokens(ops.argmax(logits), requests, [])
        if self._host_tokens is None:
            self._host_tokens = PinnedRing(torch.int64)
        slot = self._host_tokens.take(logits.shape[0])
        return SampledTokens(ops.argmax(logits, slot.tensor), requests, [], host_tokens=slot)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        device = logits.device
        temperature = to_device([p.temperature for p in params], device)
        top_k = torch.tensor([p.top_k for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        probs = filter_logits(logits / temperature[:, None], top_k, top_p, min_p).softmax(dim=-1)

        q = torch.empty_like(probs)
        unseeded = []
        for i, r in enumerate(requests):
            if r.sampling_params.seed is None:
                unseeded.append(i)
            else:
                q[i].exponential_(generator=self._request_generator(r, device, q.shape[1]))
        if unseeded:
            noise = torch.empty(len(unseeded), probs.shape[1], device=device)
            q[to_device(unseeded, device)] = noise.exponential_(generator=self._shared(device))
        # q == 0 would turn a banned token's 0 / q into NaN, which argmax prefers.
        return probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)

    def generator(self, request: Request, device: torch.device, vocab_size: int) -> torch.Generator:
        """Where a request's random draws come from: its own generator when seeded (so its
        tokens do not depend on the batch), else the one shared by unseeded rows."""
        if request.sampling_params.seed is None:
            return self._shared(device)
        return self._request_generator(request, device, vocab_size)

    def _shared(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device).manual_seed(self.seed)
        return self._generator

    def _request_generator(
        self, request: Request, device: torch.device, vocab_size: int
    ) -> torch.Generator:
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device).manual_seed(request.sampling_params.seed)
            # A request that arrives with tokens already sampled elsewhere (a decode
            # worker after a prefill worker) skips their draws, so its stream continues.
            for _ in request.output_token_ids:
                torch.empty(vocab_size, device=device).exponential_(generator=gen)
            self._request_generators[request.request_id] = gen
        return gen

    @staticmethod
    def _with_logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, requests: list[Request]
    ) -> SampledTokens:
        """The sampled rows' logprobs under the raw distribution (in float32), where asked
        for."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return SampledTokens(tokens, requests, rows)
        index = to_device(rows, raw.device)
        logprobs = torch.log_softmax(raw[index].float(), dim=-1)
        chosen = logprobs.gather(1, tokens[index, None])[:, 0]
        n = min(max(requests[i].sampling_params.logprobs for i in rows), raw.shape[1])
        top_values, top_ids = logprobs.topk(n, dim=-1)
        return SampledTokens(tokens, requests, rows, chosen, top_values, top_ids)

    def release(self, request_id: str) -> None:
        """Drop per-request state (generator, bad-word ids) once a request has ended."""
        self._request_generators.pop(request_id, None)
        self.bad_words.release(request_id)
        self.failures.pop(request_id, None)


def _stand_in(request: Request) -> Request:
    """A greedy request in a failed request's row, so the batch keeps its shape."""
    return Request(f"{request.request_id} (failed)", [0], SamplingParams(temperature=0.0))


def _plain_greedy(request: Request) -> bool:
    """Greedy, without logprobs."""
    params = request.sampling_params
    return params.greedy and params.logprobs is None
