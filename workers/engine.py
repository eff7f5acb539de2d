"""The engine loop: schedule -> prepare inputs -> run model -> sample -> emit.

``LLMEngine`` owns one model on one device, its paged KV cache, the scheduler
and the output processor. Callers add requests, call ``step()`` until nothing
is left, and read ``RequestOutput``s; ``abort_request`` works at any point.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from splitserve.config import EngineConfig, resolve_device, resolve_dtype
from splitserve.errors import InvalidRequestError
from splitserve.scheduler.block_manager import BlockManager
from splitserve.scheduler.request import Request, RequestStatus
from splitserve.scheduler.sampling_params import SamplingParams
from splitserve.scheduler.scheduler import Scheduler
from splitserve.workers.attention.registry import make_attention_backend
from splitserve.workers.kv_cache import KVCache, KVCacheSpec
from splitserve.workers.model_loader import load_hf_config, load_model
from splitserve.workers.model_runner import ModelRunner
from splitserve.workers.output_processor import OutputProcessor
from splitserve.workers.outputs import RequestOutput
from splitserve.workers.sampler import Sampler
from splitserve.workers.tokenizer import load_tokenizer, tiny_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype)
        self.hf_config, path = load_hf_config(config.model)
        self.tokenizer = load_tokenizer(path) if path is not None else tiny_tokenizer()
        model = load_model(self.hf_config, path, dtype, self.device, seed=config.seed)
        self.max_model_len = _max_model_len(config, self.hf_config)
        self.eos_token_ids = _eos_token_ids(self.hf_config, self.tokenizer)
        kv_spec = model.kv_spec.cache_spec(config.cache.block_size, dtype)
        num_blocks = _num_kv_blocks(config, kv_spec, self.max_model_len)
        self.kv_cache = KVCache(kv_spec, num_blocks, self.device)
        self.block_manager = BlockManager(
            num_blocks, kv_spec.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.sampler = Sampler(self.tokenizer, seed=config.seed)
        backend = make_attention_backend(config.attention_backend, self.device)
        self.runner = ModelRunner(model, self.kv_cache, backend, self.sampler, self.device)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.last_step = StepStats()
        self.num_preemptions = 0
        logger.info(
            "engine ready: %s on %s, %d KV blocks of %d tokens, max_model_len %d",
            config.model,
            self.device,
            num_blocks,
            kv_spec.block_size,
            self.max_model_len,
        )

    # -- requests ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
    ) -> Request:
        """Validate and queue one request; raise InvalidRequestError naming the problem."""
        params = params if params is not None else SamplingParams()
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        request = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids)
        try:
            self.scheduler.add_request(request)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        self.output_processor.start(request, text)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Abort at any point; the request's KV blocks return to the pool."""
        aborted = self.scheduler.abort_request(request_id)
        self.sampler.release(request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        if batch.is_empty:
            return []
        result = self.runner.execute(batch)
        tokens = {rid: tok for rid, (tok, _) in result.sampled.items()}
        self.scheduler.update_from_output(batch, tokens)
        outputs = []
        for request in batch.requests:
            if request.request_id not in result.sampled:
                continue
            token, logprobs = result.sampled[request.request_id]
            status = self.output_processor.append(request, token, logprobs)
            if status is not None:
                self._finish(request, status)
            outputs.append(self.output_processor.make_output(request))
        self.last_step = StepStats(
            result.num_prefill_tokens, result.num_decode_tokens, time.perf_counter() - start
        )
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.sampler.release(request.request_id)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
            vocab = self.hf_config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids {bad[:5]} are out of range: ids must be in [0, {vocab})"
                )
        else:
            raise InvalidRequestError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not token_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, but the context length is "
                f"{self.max_model_len}: a prompt may have at most {self.max_model_len - 1} tokens"
            )
        return text, token_ids


def _max_model_len(config: EngineConfig, hf_config) -> int:
    limit = hf_config.max_position_embeddings
    asked = config.scheduler.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(
            f"max_model_len={asked} exceeds the model's max_position_embeddings={limit}"
        )
    return asked or limit


def _eos_token_ids(hf_config, tokenizer) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, max_model_len: int) -> int:
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:
        num_blocks = int(config.cache.kv_cache_memory_gb * 2**30) // spec.bytes_per_block()
    needed = -(-max_model_len // spec.block_size) + 1  # one full-length request + the null page
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks but one request of max_model_len="
            f"{max_model_len} needs {needed}: raise num_kv_blocks / kv_cache_memory_gb "
            "or lower max_model_len"
        )
    return num_blocks
