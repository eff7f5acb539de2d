"""Runs one scheduled step on the device: prepare inputs, forward, logits, sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from splitserve.scheduler.request import Request
from splitserve.scheduler.scheduler import SchedulerOutput, will_sample
from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.input_batch import StepRequest, build_forward_batch
from splitserve.workers.kv_cache import KVCache
from splitserve.workers.sampler import Sampler, TokenLogprobs


@dataclass
class StepResult:
    sampled: dict[str, tuple[int, TokenLogprobs | None]]  # request id -> (token, logprobs)
    num_prefill_tokens: int
    num_decode_tokens: int


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        attn_backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.attn_backend = attn_backend
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def execute(
        self, batch: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None
    ) -> StepResult:
        steps = [_step_request(r, n) for r, n in zip(batch.requests, batch.num_scheduled_tokens)]
        fb = build_forward_batch(steps, self.kv_cache, self.attn_backend, self.device)
        fb.on_layer_stored = on_layer_stored
        hidden = self.model(fb.input_ids, fb.positions, fb)
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        sampling = [r for r, s in zip(batch.requests, steps) if s.sample]
        out = self.sampler(logits, sampling) if sampling else None
        sampled = {}
        if out is not None:
            for r, tok, lp in zip(sampling, out.token_ids, out.logprobs):
                sampled[r.request_id] = (tok, lp)
        decode = fb.num_decode_tokens
        return StepResult(sampled, fb.num_tokens - decode, decode)


def _step_request(request: Request, num_tokens: int) -> StepRequest:
    start = request.num_computed_tokens
    return StepRequest(
        new_token_ids=request.token_ids_between(start, start + num_tokens),
        num_computed=start,
        block_ids=request.block_ids,
        sample=will_sample(request, num_tokens),
    )
