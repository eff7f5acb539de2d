"""The engine loop: schedule -> prepare inputs -> run model -> sample -> emit.

``LLMEngine`` owns one model on one device, its paged KV cache, the scheduler
and the output processor. Callers add requests, call ``step()`` until nothing
is left, and read ``RequestOutput``s; ``abort_request`` works at any point.

Roles change what the loop admits, never the loop:

- ``mixed``: prompts and decodes in shared batches (``add_request``).
- ``prefill``: ``add_request(..., kv_ticket=...)``. The step that finishes the
  prompt streams each layer's KV to the ticket's decode worker as the layer is
  stored, then sends the first token; the request keeps its blocks until the
  decode worker acks, and its last output has finish reason "transferred".
- ``decode``: ``add_remote_request`` reserves blocks (an output carries the
  packed ticket), the KV and first token arrive over the transport, and the
  request decodes from there. Short prompts may still be added locally.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.config import EngineConfig, resolve_device, resolve_dtype
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.block_manager import BlockManager
from splitserve.scheduler.request import Request, RequestStatus
from splitserve.scheduler.scheduler import Scheduler, SchedulerOutput, will_sample
from splitserve.workers.attention.registry import make_attention_backend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.layout import KVLayout
from splitserve.workers.kv.transfer.base import KVTransport, TransferEvent
from splitserve.workers.kv.transfer.registry import make_kv_transport
from splitserve.workers.kv.transfer.ticket import TransferDone, TransferTicket
from splitserve.workers.model.loader import load_checkpoint, load_hf_config, load_model
from splitserve.workers.model.tokenizer import load_tokenizer, tiny_tokenizer
from splitserve.workers.output.processor import OutputProcessor
from splitserve.workers.output.request_output import RequestOutput
from splitserve.workers.runner.model_runner import GraphLimits, LaunchedStep, ModelRunner
from splitserve.workers.sampling.sampler import Sampler, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, delta_outputs: bool = False, **transport_options):
        """``delta_outputs``: each output holds only what is new (for streams).

        ``transport_options`` go to the KV transport (``owner``, NCCL's ``rendezvous``).
        """
        self.config = config
        self.role = config.role
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype)
        self.hf_config, path = load_hf_config(config.model)
        self.tokenizer = load_tokenizer(path) if path is not None else tiny_tokenizer()
        model = load_model(
            self.hf_config,
            path,
            dtype,
            self.device,
            seed=config.seed,
            load_format=config.load_format,
        )
        self.max_model_len = _max_model_len(config, self.hf_config)
        self.eos_token_ids = _eos_token_ids(self.hf_config, self.tokenizer)
        kv_layout = model.kv_layout.with_storage(config.cache.block_size, dtype)
        num_blocks = _num_kv_blocks(config, kv_layout, self.max_model_len)
        self.kv_cache = KVCache(kv_layout, num_blocks, self.device)
        self.block_manager = BlockManager(
            num_blocks, kv_layout.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.sampler = Sampler(self.tokenizer, seed=config.seed)
        backend = make_attention_backend(
            config.attention_backend,
            self.device,
            self.hf_config.num_attention_heads,
            kv_layout,
        )
        graph_limits = None
        if config.cuda_graph.enabled:
            graph_limits = GraphLimits(
                config.cuda_graph,
                config.scheduler.max_num_seqs,
                config.scheduler.max_num_batched_tokens,
                self.max_model_len,
            )
        self.runner = ModelRunner(
            model, self.kv_cache, backend, self.sampler, self.device, graph_limits
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, self.max_model_len, delta=delta_outputs
        )
        self.last_step = StepStats()
        self.num_preemptions = 0
        self.num_transfer_layers = self.hf_config.num_hidden_layers  # MTP layers stay local
        self.kv_transport: KVTransport | None = None
        if self.role != "mixed":
            kt = config.kv_transfer
            options = {**kt.nccl_options(), **transport_options}
            self.kv_transport = make_kv_transport(
                kt.transport, self.kv_cache, kt.host, kt.timeout_s, **options
            )
        self.async_scheduling = config.scheduler.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.device.type == "cuda"
        self._in_flight: LaunchedStep | None = None  # launched, tokens not read back yet
        self.runner.capture_graphs()
        logger.info(
            "%s engine ready: %s on %s, %s attention, %d KV blocks of %d tokens, "
            "max_model_len %d, CUDA graphs %s",
            self.role,
            config.model,
            self.device,
            backend.name,
            num_blocks,
            kv_layout.block_size,
            self.max_model_len,
            "on" if self.runner.graphs is not None else "off",
        )

    # -- requests ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        kv_ticket: TransferTicket | bytes | None = None,
    ) -> Request:
        """Validate and queue one request; raise InvalidRequestError naming the problem.

        With ``kv_ticket`` (a prefill worker) the prompt's KV goes to the ticket's
        decode worker and the request ends once that worker has it.
        """
        request, text = self._new_request(request_id, prompt, params)
        if kv_ticket is not None:
            request.kv_ticket = self._check_ticket(kv_ticket, request)
        elif self.role == "prefill":
            raise InvalidRequestError(
                "a prefill worker serves only requests with a KV ticket from a decode worker"
            )
        self._queue(request, text, self.scheduler.add_request)
        return request

    def add_remote_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Request:
        """Decode side: reserve blocks for a prompt a prefill worker will compute.

        A later ``step()`` output carries the packed ``kv_ticket`` once blocks are free.
        """
        if self.kv_transport is None or self.role == "prefill":
            raise InvalidRequestError(
                f"a {self.role} worker does not receive KV; send remote requests to a decode worker"
            )
        request, text = self._new_request(request_id, prompt, params)
        self._queue(request, text, self.scheduler.add_remote_request)
        return request

    def num_cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens this worker's prefix cache would serve (for routing)."""
        probe = Request("", list(token_ids), SamplingParams())
        return self.block_manager.get_computed_blocks(probe)[1]

    def abort_request(self, request_id: str) -> bool:
        """Abort at any point; the request's KV blocks return to the pool."""
        if self.kv_transport is not None:  # before its blocks can be reused
            request = self.scheduler.get_request(request_id)
            self.kv_transport.cancel(request_id, request.kv_ticket if request else None)
        aborted = self.scheduler.abort_request(request_id)
        self.sampler.release(request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def has_runnable_requests(self) -> bool:
        """Work for ``step`` right now; False while every request waits on a transfer."""
        return self.scheduler.has_runnable_requests() or self._in_flight is not None

    # -- weights -------------------------------------------------------------

    def clear_parameters(self) -> None:
        """Free the weights and drop every CUDA graph (e.g. before an RL weight update)."""
        self.runner.clear_parameters()

    def update_parameters(self, checkpoint: str | Path) -> None:
        """Load new weights from a checkpoint directory of the same architecture.

        Needs an idle engine. Every CUDA graph is dropped and captured again at
        the next step, and the prefix cache is reset (its KV came from the old
        weights).
        """
        if self.has_unfinished_requests():
            raise RuntimeError("update_parameters needs an idle engine; requests are in flight")
        self.runner.load_parameters(lambda model: load_checkpoint(model, Path(checkpoint)))
        self.block_manager.reset_prefix_cache()
        self.runner.capture_graphs()

    def close(self) -> None:
        if self.kv_transport is not None:
            self.kv_transport.close()

    def _new_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None
    ) -> tuple[Request, str | None]:
        params = params if params is not None else SamplingParams()
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        return Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids), text

    def _queue(self, request: Request, text: str | None, add) -> None:
        try:
            add(request)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        self.output_processor.start(request, text)

    def _check_ticket(self, ticket: TransferTicket | bytes, request: Request) -> TransferTicket:
        if self.kv_transport is None:
            raise InvalidRequestError(f"a {self.role} worker has no KV transport to send with")
        if isinstance(ticket, bytes):
            ticket = TransferTicket.unpack(ticket)
        problems = []
        try:
            self.kv_transport.layout.check_matches(ticket.layout)
        except ValueError as e:
            problems.append(str(e))
        if ticket.num_tokens != request.num_prompt_tokens:
            problems.append(
                f"the ticket covers {ticket.num_tokens} tokens, the prompt has "
                f"{request.num_prompt_tokens}"
            )
        if ticket.num_layers != self.num_transfer_layers:
            problems.append(
                f"the ticket asks for {ticket.num_layers} layers, the model has "
                f"{self.num_transfer_layers}"
            )
        if ticket.request_id != request.request_id:
            problems.append(f"the ticket is for request {ticket.request_id!r}")
        if problems:
            raise InvalidRequestError("invalid KV ticket: " + "; ".join(problems))
        return ticket

    # -- the loop ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and queue the next step, then read back the step before it.

        With async scheduling the device computes step i + 1 while the host
        turns step i's tokens into outputs; without it, each step is read back
        before ``step`` returns.
        """
        start = time.perf_counter()
        outputs = self._handle_transfers()
        if any(o.new_token_ids for o in outputs):
            return outputs  # first tokens that arrived go out now, not after a forward
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        if self._in_flight is not None and not self._can_overlap(batch):
            outputs += self._read_back(self._in_flight)
            self._in_flight = None
            batch = batch.without_finished()
        launched = self._launch(batch) if not batch.is_empty else None
        if self._in_flight is not None:
            outputs += self._read_back(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._read_back(launched)
            self._in_flight = None
        if launched is not None:
            self.last_step = StepStats(
                launched.num_prefill_tokens,
                launched.num_decode_tokens,
                time.perf_counter() - start,
            )
        return outputs

    def _can_overlap(self, batch: SchedulerOutput) -> bool:
        """Whether ``batch`` may be queued before the step in flight is read back: not
        when it is empty (nothing to overlap) or samples with penalties or bad words,
        which read the request's tokens on the host."""
        return (
            self.async_scheduling
            and not batch.is_empty
            and not any(r.sampling_params.reads_output_tokens for r in batch.requests)
        )

    def _launch(self, batch: SchedulerOutput) -> LaunchedStep:
        sending, send_errors = self._start_sends(batch)
        hook = self._layer_sender(sending) if sending else None
        launched = self.runner.launch(batch, hook, previous=self._in_flight)
        launched.send_errors = send_errors
        self.scheduler.advance(batch)
        for request in launched.sampling:
            if request.kv_ticket is not None:  # the prompt is done: hand its KV off
                self.scheduler.hold_for_transfer(request)
        return launched

    def _read_back(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        result = launched.result()
        tokens = {rid: tok for rid, (tok, _) in result.sampled.items()}
        self.scheduler.resolve(launched.batch, tokens)
        outputs = []
        for request in launched.sampling:
            if request.is_finished:  # aborted, or stopped by the step before
                continue
            token, logprobs = result.sampled[request.request_id]
            if request.kv_ticket is not None:
                out = self._hand_off(request, token, logprobs, launched.send_errors)
                if out is not None:
                    outputs.append(out)
                continue
            status = self.output_processor.append(request, token, logprobs)
            if status is not None:
                self._finish(request, status)
            outputs.append(self.output_processor.make_output(request))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.sampler.release(request.request_id)

    # -- KV hand-off -----------------------------------------------------------

    def _start_sends(self, batch: SchedulerOutput) -> tuple[list[str], dict[str, str]]:
        """Open the transfers of prompts that finish in this step: (opened, failures)."""
        opened, errors = [], {}
        for request, n in zip(batch.requests, batch.num_scheduled_tokens):
            if request.kv_ticket is None or not will_sample(request, n):
                continue
            try:
                self.kv_transport.start_send(request.kv_ticket, request.block_ids)
                opened.append(request.request_id)
            except (OSError, ValueError) as e:
                errors[request.request_id] = f"could not reach the decode worker: {e}"
        return opened, errors

    def _layer_sender(self, request_ids: list[str]):
        transport = self.kv_transport

        def on_layer_stored(layer_id: int) -> None:
            for rid in request_ids:
                transport.send_layer(rid, layer_id)

        return on_layer_stored

    def _hand_off(
        self,
        request: Request,
        token: int,
        logprobs: TokenLogprobs | None,
        send_errors: dict[str, str],
    ) -> RequestOutput | None:
        """Prefill side, first token read back: finish the transfer (the request holds
        its blocks since its step was launched)."""
        rid = request.request_id
        if rid in send_errors:
            return self._fail(request, send_errors[rid])
        lp, top = (logprobs.logprob, logprobs.top) if logprobs is not None else (None, [])
        self.kv_transport.finish_send(rid, TransferDone(rid, token, lp, top))
        return None

    def _handle_transfers(self) -> list[RequestOutput]:
        """Finished hand-offs, then tickets for remote requests that got blocks."""
        if self.kv_transport is None:
            return []
        outputs = [self._on_transfer(e) for e in self.kv_transport.poll()]
        outputs = [o for o in outputs if o is not None]
        for request in self.scheduler.reserve_kv_blocks():
            ticket = self.kv_transport.make_ticket(
                request.request_id,
                request.block_ids,
                start_token=request.num_cached_tokens,
                num_tokens=request.num_prompt_tokens,
                num_layers=self.num_transfer_layers,
            )
            self.kv_transport.expect(ticket)
            output = self.output_processor.make_output(request)
            output.kv_ticket = ticket.pack()
            outputs.append(output)
        return outputs

    def _on_transfer(self, event: TransferEvent) -> RequestOutput | None:
        request = self.scheduler.get_request(event.request_id)
        if request is None:
            return None  # aborted meanwhile
        if not event.ok:
            return self._fail(request, event.error)
        if event.side == "send":
            self._finish(request, RequestStatus.FINISHED_TRANSFERRED)
            return self.output_processor.make_output(request)
        done = event.done
        self.scheduler.kv_arrived(request.request_id, done.first_token)
        logprobs = None
        if request.sampling_params.logprobs is not None and done.logprob is not None:
            logprobs = TokenLogprobs(done.first_token, done.logprob, list(done.top_logprobs))
        status = self.output_processor.append(request, done.first_token, logprobs)
        if status is not None:
            self._finish(request, status)
        return self.output_processor.make_output(request)

    def _fail(self, request: Request, error: str) -> RequestOutput:
        if self.kv_transport is not None:
            self.kv_transport.cancel(request.request_id)
        self._finish(request, RequestStatus.FINISHED_ERROR)
        output = self.output_processor.make_output(request)
        output.error = error
        return output

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


def _num_kv_blocks(config: EngineConfig, layout: KVLayout, max_model_len: int) -> int:
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:
        num_blocks = int(config.cache.kv_cache_memory_gb * 2**30) // layout.bytes_per_block()
    needed = -(-max_model_len // layout.block_size) + 1  # one full-length request + the null page
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks but one request of max_model_len="
            f"{max_model_len} needs {needed}: raise num_kv_blocks / kv_cache_memory_gb "
            "or lower max_model_len"
        )
    return num_blocks
