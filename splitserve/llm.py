"""Offline interface: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

All prompts of one call are served together by one engine, in shared batches.
A prompt that is rejected (too long, bad token ids, invalid sampling values)
comes back as an output with ``error`` set; the others finish normally.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from splitserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.llm_engine import LLMEngine
from splitserve.workers.output.request_output import CompletionOutput, RequestOutput

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str = "qwen3-tiny", **kwargs: Any):
        """``kwargs`` are EngineConfig fields; cache, scheduler and parallel fields (e.g.
        ``expert_parallel_size=2``) may be given flat."""
        sections = {}
        for name, section in (
            ("cache", CacheConfig),
            ("scheduler", SchedulerConfig),
            ("parallel", ParallelConfig),
        ):
            flat = {k: kwargs.pop(k) for k in list(kwargs) if k in section.__dataclass_fields__}
            sections[name] = {**kwargs.pop(name, {}), **flat}
        config = EngineConfig.from_dict({"model": model, **sections, **kwargs})
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def start_profile(self) -> None:
        """Record what follows with ``torch.profiler`` (needs ``torch_profiler_dir``)."""
        self.engine.start_profile()

    def stop_profile(self) -> str:
        """Stop recording; returns the path of the Chrome trace written."""
        return self.engine.stop_profile()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = _broadcast(sampling_params, len(prompts))
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        index: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = str(next(self._ids))
            try:
                self.engine.add_request(request_id, _prompt_of(prompt), p)
                index[request_id] = i
            except InvalidRequestError as e:
                outputs[i] = _rejected(request_id, prompt, str(e))
        with tqdm(total=len(index), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        outputs[index[out.request_id]] = out
                        bar.update(1)
        return outputs  # type: ignore[return-value]


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)


def _prompt_of(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, dict):
        keys = set(prompt) & {"prompt", "prompt_token_ids"}
        if len(keys) != 1:
            raise InvalidRequestError(
                "a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids', "
                f"got keys {sorted(prompt)}"
            )
        return prompt[keys.pop()]
    return prompt


def _rejected(request_id: str, prompt: PromptType, error: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    ids = prompt if isinstance(prompt, list) else []
    return RequestOutput(
        request_id=request_id,
        prompt=text,
        prompt_token_ids=ids,
        outputs=[CompletionOutput(0, "", [], finish_reason="error")],
        finished=True,
        error=error,
    )
