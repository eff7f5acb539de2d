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
  ``add_request(..., ticket_follows=True)`` computes the prompt before the ticket
  exists; ``give_ticket`` brings it later, and the KV goes out once both the
  ticket and the first token are in.
- ``decode``: ``add_remote_request`` reserves blocks (an output carries the
  packed ticket), the KV and first token arrive over the transport, and the
  request decodes from there. Short prompts may still be added locally.

The hand-off itself (tickets, holding a sent prompt's blocks until the ack,
starting sends and sending each layer as it is stored) is ``workers/kv/handoff.py``;
the engine only turns its events into outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from splitserve.config import EngineConfig, env, resolve_device, resolve_dtype
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.scheduler.block_manager import BlockManager
from splitserve.scheduler.request import PLACEHOLDER, Request, RequestStatus
from splitserve.scheduler.scheduler import Scheduler, SchedulerOutput
from splitserve.workers.attention.registry import make_attention_backend
from splitserve.workers.engine import admission
from splitserve.workers.engine.torch_profiler import TorchProfiler
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.handoff import (
    HandoffEvent,
    HandoffFailed,
    KVHandoff,
    SendAcked,
    StepSends,
)
from splitserve.workers.kv.scales import checkpoint_scales
from splitserve.workers.kv.transfer.base import KVTransport
from splitserve.workers.kv.transfer.registry import make_kv_transport
from splitserve.workers.kv.transfer.ticket import TransferTicket
from splitserve.workers.model.loader import (
    checkpoint_files,
    load_checkpoint,
    load_hf_config,
    load_model,
)
from splitserve.workers.model.tokenizer import load_tokenizer, tiny_tokenizer
from splitserve.workers.output.processor import OutputProcessor
from splitserve.workers.output.request_output import CompletionOutput, RequestOutput
from splitserve.workers.parallel.expert_load import ExpertLoad
from splitserve.workers.parallel.front import GroupFront, start_group
from splitserve.workers.parallel.group import GroupMember
from splitserve.workers.parallel.lockstep import Lockstep
from splitserve.workers.runner.kernel_warmup import warm_eager_forwards, warm_sampling_kernels
from splitserve.workers.runner.model_runner import GraphLimits, LaunchedStep, ModelRunner
from splitserve.workers.sampling.sampler import Sampler, TokenLogprobs
from splitserve.workers.spec_decode.mtp_proposer import MTPProposer
from splitserve.workers.spec_decode.speculator import PendingDrafts, Speculator
from splitserve.workers.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0
    num_requests: int = 0  # in the step's batch
    num_prompt_requests: int = 0  # of them, those computing prompt tokens
    num_context_tokens: int = 0  # their tokens in the KV cache once the step is done
    # Of ``seconds``, those waiting for the device's tokens (a step read back): with
    # async scheduling, how long the device's step outlasted the host's work beside it.
    wait_seconds: float = 0.0


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        delta_outputs: bool = False,
        member: GroupMember | None = None,
        **transport_options,
    ):
        """``delta_outputs``: each output holds only what is new (for streams).

        With ``parallel.expert_parallel_size`` N > 1 this engine is rank 0 of an
        expert-parallel group and starts ranks 1..N-1 (``workers/parallel``), which
        construct their engines with their ``member``ship.
        ``transport_options`` go to the KV transport (``owner``, NCCL's ``rendezvous``).
        """
        self.config = config
        self.role = config.role
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype)
        self.hf_config, path = load_hf_config(config.model)
        self.tokenizer = load_tokenizer(path) if path is not None else tiny_tokenizer()
        self.ep_front: GroupFront | None  # rank 0 of an expert-parallel group: the others
        self.ep_front, member = start_group(
            config, self.hf_config, self.device, member, delta_outputs, transport_options
        )
        model = load_model(
            self.hf_config,
            path,
            dtype,
            self.device,
            seed=config.seed,
            load_format=config.load_format,
            expert_shard=member.expert_shard(self.hf_config) if member else None,
        )
        lockstep = None
        if member:
            max_rows = config.scheduler.max_num_seqs * (1 + config.num_speculative_tokens)
            lockstep = Lockstep.join(member, model, self.device, self.role, max_rows)
        self.expert_load = ExpertLoad(model) if member else None
        self.max_model_len = admission.max_model_len(config, self.hf_config)
        self.eos_token_ids = admission.eos_token_ids(self.hf_config, self.tokenizer)
        kv_dtype = config.cache.kv_dtype(dtype)
        kv_layout = model.kv_layout.with_storage(config.cache.block_size, kv_dtype)
        num_blocks = admission.num_kv_blocks(config, kv_layout, self.max_model_len)
        self.kv_cache = KVCache(kv_layout, num_blocks, self.device)
        if self.kv_cache.is_fp8 and path is not None:  # the checkpoint's scales, if any
            found = checkpoint_scales(checkpoint_files(path), kv_layout.num_layers)
            self.kv_cache.scales.set(*found)
        self.block_manager = BlockManager(
            num_blocks, kv_layout.block_size, config.cache.enable_prefix_caching
        )
        num_spec = config.num_speculative_tokens
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, self.max_model_len, num_lookahead_tokens=num_spec
        )
        self.sampler = Sampler(self.tokenizer, seed=config.seed)
        backend = make_attention_backend(
            config.attention_backend,
            self.device,
            self.hf_config.num_attention_heads,
            kv_layout,
            config.kernels,
            dtype,
        )
        speculator = None
        if num_spec:
            graph_backend = None  # the drafter's CUDA graphs keep their own attention state
            if config.cuda_graph.enabled and self.device.type == "cuda":
                graph_backend = make_attention_backend(
                    config.attention_backend,
                    self.device,
                    self.hf_config.num_attention_heads,
                    kv_layout,
                    config.kernels,
                    dtype,
                )
            proposer = MTPProposer(model, num_spec, self.kv_cache, backend, graph_backend)
            simulated = config.speculative_config.simulated_acceptance
            if simulated is not None:
                logger.warning(
                    "speculative_config.simulated_acceptance=%s: drafts are replaced by the "
                    "target's greedy token with that probability (benchmarks only; the output "
                    "is not the model's)",
                    simulated,
                )
            speculator = Speculator(model, proposer, self.sampler, simulated)
        self.spec_stats = SpecDecodeStats()
        graph_limits = None
        if config.cuda_graph.enabled:
            graph_limits = GraphLimits(
                config.cuda_graph,
                config.scheduler.max_num_seqs,
                config.scheduler.max_num_batched_tokens,
                self.max_model_len,
                self.role,
            )
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            backend,
            self.sampler,
            self.device,
            graph_limits,
            speculator,
            lockstep,
        )
        self.output_processor = OutputProcessor(
            self.tokenizer,
            self.max_model_len,
            delta=delta_outputs,
            stream_interval=config.scheduler.stream_interval,
        )
        self.last_step = StepStats()
        self.profiler = TorchProfiler(config.torch_profiler_dir, self.role, self.device)
        self._wait_seconds = 0.0  # the step in progress's ``StepStats.wait_seconds``
        self.num_preemptions = 0
        self.num_late_tickets = 0  # tickets given after their prompt (give_ticket)
        self.handoff: KVHandoff | None = None  # prefill and decode workers: the KV hand-off
        if self.role != "mixed":
            kt = config.kv_transfer
            options = {**kt.nccl_options(), **transport_options}
            transport = make_kv_transport(
                kt.transport, self.kv_cache, kt.host, kt.timeout_s, auth_key=kt.auth_key, **options
            )
            num_layers = self.hf_config.num_hidden_layers
            self.handoff = KVHandoff(
                transport,
                self.scheduler,
                num_layers,
                num_spec > 0,
                self.kv_cache,
                ticket_timeout_s=config.kv_transfer.timeout_s,
            )
        self.async_scheduling = config.scheduler.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.device.type == "cuda"
        if num_spec:  # where the drafts go depends on the tokens accepted: read back first
            self.async_scheduling = False
        self._in_flight: LaunchedStep | None = None  # launched, tokens not read back yet
        # MTP: the last step's drafts, on the device while the host turns its tokens into
        # outputs and schedules the next step (held while a drafted request runs); that
        # step's inputs read them on the device
        self._pending_drafts: PendingDrafts | None = None
        self._device_drafts: PendingDrafts | None = None  # those the next launch reads
        # A prefill worker with MTP sends each prompt's first token before its drafts: the
        # drafter's passes run at the start of the next step, then the KV's "done" frames
        # (with the drafts) go out. Not in an expert group, whose ranks step in lockstep.
        self.defers_drafts = self.role == "prefill" and num_spec > 0 and lockstep is None
        self._deferred_drafts: Callable[[], PendingDrafts] | None = None
        self._awaiting_drafts: list[tuple[Request, int, TokenLogprobs | None]] = []
        self.runner.capture_graphs()
        max_rows = config.scheduler.max_num_seqs * (1 + num_spec)  # sampled rows a step
        warm_sampling_kernels(model, self.sampler, self.device, max_rows)
        if warms_up(self.device):  # every role computes prompts (a decode worker short ones)
            sched = config.scheduler
            warm_eager_forwards(self.runner, sched.max_num_batched_tokens, sched.max_num_seqs)
        if self.ep_front is not None:
            self.ep_front.wait_ready()
        logger.info(
            "%s engine ready: %s on %s, %s attention, %d KV blocks of %d tokens (%s), "
            "max_model_len %d, CUDA graphs %s",
            self.role,
            config.model,
            self.device,
            backend.name,
            num_blocks,
            kv_layout.block_size,
            str(kv_dtype).removeprefix("torch."),
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
        ticket_follows: bool = False,
    ) -> Request:
        """Validate and queue one request; raise InvalidRequestError naming the problem.

        With ``kv_ticket`` (a prefill worker) the prompt's KV goes to the ticket's
        decode worker and the request ends once that worker has it. With
        ``ticket_follows`` instead (a prefill worker, not expert-parallel) the prompt
        is computed at once and its ticket comes later (``give_ticket``).
        """
        request, text = self._new_request(request_id, prompt, params)
        if ticket_follows:
            self._check_ticket_follows(kv_ticket)
            request.ticket_follows = True
        elif kv_ticket is not None:
            if self.handoff is None:
                raise InvalidRequestError(f"a {self.role} worker has no KV transport to send with")
            request.kv_ticket = self.handoff.scheduler.check_ticket(kv_ticket, request)
        elif self.role == "prefill":
            raise InvalidRequestError(
                "a prefill worker serves only requests with a KV ticket from a decode worker "
                "(or with ticket_follows, the ticket given later)"
            )
        if self._placed_elsewhere(request, prompt, params, kv_ticket=request.kv_ticket):
            return request  # another rank of the group computes it (and sends its KV)
        add = self.handoff.scheduler.admit if kv_ticket is not None else self.scheduler.add_request
        self._queue(request, text, add)
        return request

    def _check_ticket_follows(self, kv_ticket) -> None:
        if self.role != "prefill" or self.handoff is None:
            raise InvalidRequestError(
                f"ticket_follows is for a prefill worker's requests; this is a {self.role} worker"
            )
        if kv_ticket is not None:
            raise InvalidRequestError(
                "a request with both a kv_ticket and ticket_follows: give the ticket with the "
                "prompt or after it (give_ticket), not both"
            )
        if self.ep_front is not None or self.runner.lockstep is not None:
            raise InvalidRequestError(
                "an expert-parallel prefill worker needs the KV ticket with the prompt "
                "(ticket_follows is not supported there)"
            )

    def give_ticket(self, request_id: str, kv_ticket: bytes) -> list[RequestOutput]:
        """Prefill side: the decode worker's ticket for a request added with
        ``ticket_follows``. [] when the request is gone (aborted or failed meanwhile) or
        has its ticket; an invalid ticket fails that request alone (its output says why).

        A request not scheduled yet whose decode worker is connected takes the ticket as
        if it had come with the prompt; any other sends its KV, all layers at once, once
        its first token is in too (at once if it is)."""
        request = self.scheduler.get_request(request_id)
        if request is None or not request.ticket_follows:
            return []
        try:
            ticket = self.handoff.scheduler.check_ticket(kv_ticket, request)
        except InvalidRequestError as e:
            return [self._fail(request, str(e))]
        self.num_late_tickets += 1
        if not self.handoff.scheduler.attach(request, ticket):
            self.handoff.worker.give_ticket(request, ticket)
        return self._send_late()

    def add_remote_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Request:
        """Decode side: reserve blocks for a prompt a prefill worker will compute.

        A later ``step()`` output carries the packed ``kv_ticket`` once blocks are free.
        """
        if self.handoff is None or self.role == "prefill":
            raise InvalidRequestError(
                f"a {self.role} worker does not receive KV; send remote requests to a decode worker"
            )
        request, text = self._new_request(request_id, prompt, params)
        if self._placed_elsewhere(request, prompt, params, remote=True):
            return request  # another rank reserves the blocks and issues the ticket
        self._queue(request, text, self.scheduler.add_remote_request)
        return request

    def _placed_elsewhere(self, request: Request, prompt, params, **kind) -> bool:
        """Rank 0 of an expert-parallel group: whether the least loaded rank is another one,
        which then takes the request (``kind``: its ``kv_ticket`` or ``remote``)."""
        if self.ep_front is None:
            return False
        load = len(self.scheduler.requests) + self.handoff_connecting
        return self.ep_front.place_elsewhere(request.request_id, prompt, params, load, **kind)

    @property
    def handoff_connecting(self) -> int:
        """Prefill side: requests waiting for their decode worker's connection."""
        return self.handoff.scheduler.num_connecting if self.handoff is not None else 0

    def join_kv_pair(self, pair_key: str, unique_id: bytes, rank: int = 0) -> None:
        """NCCL, decode side: the transport of ``rank`` (of an expert-parallel group; 0
        without one) joins a prefill worker's pair as its rank 1 (returns at once)."""
        if rank == 0:
            self.kv_transport.join(pair_key, unique_id)
        elif self.ep_front is None:
            raise ValueError(f"a KV pair for rank {rank}, but this engine is one rank")
        else:
            self.ep_front.join_kv_pair(rank, pair_key, unique_id)

    def num_cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens this worker's prefix cache would serve (for routing)."""
        probe = Request("", list(token_ids), SamplingParams())
        return self.block_manager.get_computed_blocks(probe)[1]

    def abort_request(self, request_id: str) -> bool:
        """Abort at any point; the request's KV blocks return to the pool."""
        if self.ep_front is not None and self.ep_front.abort(request_id):
            return True
        if self.handoff is not None:  # before its blocks can be reused
            self.handoff.cancel(request_id)
        aborted = self.scheduler.abort_request(request_id)
        self.sampler.release(request_id)
        self._hold_drafts(self._pending_drafts)  # none of them for a request that ended
        return aborted

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or self._deferred_drafts is not None
            or (self.ep_front is not None and self.ep_front.has_unfinished())
            or (self.handoff is not None and self.handoff.scheduler.num_connecting > 0)
        )

    def has_runnable_requests(self) -> bool:
        """Work for ``step`` right now; False while every request waits on a transfer."""
        return (
            self.scheduler.has_runnable_requests()
            or self._in_flight is not None
            or self._deferred_drafts is not None
            or (self.handoff is not None and self.handoff.worker.has_ready_late())
            or (self.ep_front is not None and self.ep_front.has_runnable())
        )

    def expert_tokens(self, wait: bool | None = None) -> list[list[int]]:
        """Expert parallelism: per rank, the (token, expert) pairs each of its experts
        computed so far (rank r holds experts ``r * E/N ..``; the other ranks' as last
        reported); [] without it. ``wait`` (None: when the engine is idle): for the
        device; else on a GPU the counts are those of the last snapshot it finished
        (``ExpertLoad``), so a step is never held up."""
        if self.expert_load is None:
            return []
        if wait is None:
            wait = not self.has_unfinished_requests()
        peers = self.ep_front.peer_expert_tokens() if self.ep_front is not None else []
        return [self.expert_load.read(wait), *peers]

    # -- weights -------------------------------------------------------------

    def clear_parameters(self) -> None:
        """Free the weights and drop every CUDA graph (e.g. before an RL weight update)."""
        if self.runner.lockstep is not None:  # the other ranks would keep theirs
            raise NotImplementedError("weight updates of an expert-parallel group are not built")
        self.runner.clear_parameters()

    def update_parameters(self, checkpoint: str | Path) -> None:
        """Load new weights from a checkpoint directory of the same architecture.

        Needs an idle engine. Every CUDA graph is dropped and captured again at
        the next step, and the prefix cache is reset (its KV came from the old
        weights).
        """
        if self.has_unfinished_requests():
            raise RuntimeError("update_parameters needs an idle engine; requests are in flight")
        if self.runner.lockstep is not None:  # every rank would have to reload and recapture
            raise NotImplementedError("weight updates of an expert-parallel group are not built")
        self.runner.load_parameters(lambda model: load_checkpoint(model, Path(checkpoint)))
        self.block_manager.reset_prefix_cache()
        self.runner.capture_graphs()

    @property
    def kv_transport(self) -> KVTransport | None:
        return self.handoff.transport if self.handoff is not None else None

    def start_profile(self) -> None:
        """Open a ``torch.profiler`` window (``torch_profiler_dir``; ``torch_profiler.py``)."""
        self.profiler.start()

    def stop_profile(self) -> str:
        """Close the window; returns the path of its Chrome trace."""
        return self.profiler.stop()

    def close(self) -> None:
        self.profiler.close()
        if self.handoff is not None:
            self.handoff.close()
        if self.ep_front is not None:
            self.ep_front.close()
        if self.runner.lockstep is not None:  # its process groups' threads stop here
            if self.runner.graphs is not None:  # NCCL waits for graphs holding its kernels
                self.runner.graphs.clear()
            self.runner.lockstep.group.close()

    def _new_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None
    ) -> tuple[Request, str | None]:
        params = params if params is not None else SamplingParams()
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        try:
            params.check(self.config.limits)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        text, token_ids = admission.tokenize_prompt(
            prompt, self.tokenizer, self.hf_config.vocab_size, self.max_model_len
        )
        return Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids), text

    def _queue(self, request: Request, text: str | None, add) -> None:
        try:
            add(request)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        self.output_processor.start(request, text)

    # -- the loop ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and queue the next step, then read back the step before it.

        With async scheduling the device computes step i + 1 while the host
        turns step i's tokens into outputs; without it, each step is read back
        before ``step`` returns (with MTP its tokens: the drafts stay on the device, the
        drafter running while the host schedules the next step). Rank 0 of
        an expert-parallel group steps the other ranks with it and returns their
        outputs too.
        """
        if self.ep_front is None:
            return self._step()
        self.ep_front.start_step()
        try:
            outputs = self._step()
        except Exception as e:  # a collective failed: a rank's process may have ended
            self.ep_front.check_ranks(e)
            raise
        outputs = self.ep_front.finish_step(outputs)
        if not self.has_unfinished_requests():  # the group went idle: every rank's counts
            self.ep_front.refresh_stats()
        return outputs

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self._wait_seconds = 0.0
        lockstep = self.runner.lockstep is not None  # every call is one step of the group
        outputs = self._handle_transfers()
        self._send_deferred_drafts()  # before this step's forward reuses their inputs
        outputs += self._send_late()  # late tickets' KV, once their first token is in
        if any(o.new_token_ids or o.kv_ticket for o in outputs) and not lockstep:
            # First tokens that arrived, and tickets (a prefill worker starts on each), go
            # out now, not after a forward.
            return outputs
        self._resolve_drafts()  # the scheduler sizes each request's step by its drafts
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        if self._in_flight is not None and not self._can_overlap(batch):
            outputs += self._read_back(self._in_flight)
            self._in_flight = None
            batch = batch.without_finished()
        if batch.is_empty and lockstep:
            self.runner.idle_step()  # a dummy step where another rank has work
        prompting = sum(r.num_computed_tokens < r.num_prompt_tokens for r in batch.requests)
        context = batch.total_num_tokens + sum(r.num_computed_tokens for r in batch.requests)
        launched = None
        if not batch.is_empty:
            with self.profiler.step_range(len(batch.requests), prompting):
                launched = self._launch(batch)
        self._drop_unread_drafts(batch)
        if self._in_flight is not None:
            outputs += self._read_back(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._read_back(launched)
            self._in_flight = None
        # First tokens read back whose ticket is in send their KV at the next step, after
        # this one's outputs went out: the posting of every layer is not in their TTFT.
        if launched is not None:
            self.last_step = StepStats(
                launched.num_prefill_tokens,
                launched.num_decode_tokens,
                time.perf_counter() - start,
                len(batch.requests),
                prompting,
                context,
                self._wait_seconds,
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
        sends = self.handoff.worker.start_sends(batch) if self.handoff else StepSends()
        launched = self.runner.launch(
            batch,
            sends.on_layer_stored,
            self._in_flight,
            defer_drafts=self.defers_drafts,
            drafts=self._device_drafts,
        )
        launched.send_errors = sends.errors
        self.scheduler.advance(batch)
        if self.handoff is not None:
            self.handoff.scheduler.hold(launched.sampling)  # until the decode worker acks
        return launched

    def _read_back(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        waiting = time.perf_counter()
        result = launched.result()
        self._wait_seconds += time.perf_counter() - waiting
        tokens = {rid: toks for rid, (toks, _) in result.sampled.items()}
        self.spec_stats.count(launched.sampling, result.sampled)
        self.scheduler.resolve(launched.batch, tokens)
        outputs = []
        for request in launched.sampling:
            if request.is_finished:  # aborted, or stopped by the step before
                continue
            failure = self.sampler.failures.pop(request.request_id, None)
            try:
                if failure is not None:
                    raise RuntimeError(failure)
                output = self._on_sampled(request, result, launched)
            except Exception as e:  # this request's doing: it alone ends, with the cause
                output = self._fail_alone(request, e)
            if output is not None:
                outputs.append(output)
        spec = launched.speculative
        if spec is not None and spec.deferred_drafts is not None:  # a chunk's step too:
            self._deferred_drafts = spec.deferred_drafts  # its pass writes the MTP layer's KV
        if spec is not None:
            self._hold_drafts(spec.drafts)
        return outputs

    def _hold_drafts(self, pending: PendingDrafts | None) -> None:
        """Hold a step's drafts for the next schedule while a request drafted for still
        runs; else drop them, never read (an idle engine holds no device tensor). Drafts
        read back went out with their KV (a prefill worker's): none to hold."""
        running = (
            pending is not None
            and not pending.read_back
            and any(r.status == RequestStatus.RUNNING for r in pending.requests)
        )
        self._pending_drafts = pending if running else None

    def _resolve_drafts(self) -> None:
        """The last step's drafts onto its requests still running (one finished, aborted or
        failed since gets none), as many ``PLACEHOLDER`` ids: the scheduler sizes each
        request's step by their number, the runner reads them on the device."""
        pending, self._pending_drafts = self._pending_drafts, None
        if pending is None:
            return
        k = pending.tokens.shape[1]
        for request in pending.requests:
            if request.status == RequestStatus.RUNNING:
                request.spec_token_ids = [PLACEHOLDER] * k
        self._device_drafts = pending

    def _drop_unread_drafts(self, batch: SchedulerOutput) -> None:
        """Drafts on the device of requests the step did not schedule (or of none, in an
        empty step): their memory goes with the step, so those requests decode without
        drafts next time."""
        pending, self._device_drafts = self._device_drafts, None
        if pending is None:
            return
        scheduled = {r.request_id for r in batch.requests}
        for request in pending.requests:
            if request.request_id not in scheduled and PLACEHOLDER in request.spec_token_ids:
                request.spec_token_ids = []

    def _send_deferred_drafts(self) -> None:
        """Prefill side with MTP: the last step's drafter passes (the MTP layer's prompt KV
        follows the target's layers out), then each prompt's "done" frame with its drafts;
        a request aborted meanwhile sends nothing (its transfer was cancelled)."""
        if self._deferred_drafts is None:
            return
        draft, awaiting = self._deferred_drafts, self._awaiting_drafts
        self._deferred_drafts, self._awaiting_drafts = None, []
        drafts = draft().result()
        for request, token, logprobs in awaiting:
            if not request.is_finished:
                rid = request.request_id
                self.handoff.worker.finish_send(request, token, logprobs, drafts.get(rid, []))

    def _on_sampled(self, request: Request, result, launched: LaunchedStep) -> RequestOutput | None:
        """A request's sampled tokens as its output (None: a prefill hands them on)."""
        toks, logprobs = result.sampled[request.request_id]
        if not request.sends_kv:  # its drafts: at the next schedule (_resolve_drafts)
            self._record_run(request, toks, logprobs)
            due = self.output_processor.due(request)  # a stream's: every stream_interval
            return self.output_processor.make_output(request) if due else None
        if request.request_id in launched.send_errors:
            return self._fail(request, launched.send_errors[request.request_id])
        # prefill side: the first token (and drafts) follow the KV to the decode worker (a
        # late ticket's: kept until the ticket is in)
        if launched.speculative is not None and launched.speculative.deferred_drafts:
            self._awaiting_drafts.append((request, toks[0], logprobs[0]))  # next step's
        else:  # read back now: the "done" frame carries them (an expert group's prefill rank)
            drafts = result.drafts.result().get(request.request_id, [])
            self.handoff.worker.finish_send(request, toks[0], logprobs[0], drafts)
        return self._first_token_ahead(request, toks[0], logprobs[0])

    def _first_token_ahead(
        self, request: Request, token: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput | None:
        """Prefill side: the first token as an output now, so the front can stream it
        while the KV is still on its way (the decode worker's first output repeats it).
        None when the token ends the request: the decode worker says how it ends."""
        if self.output_processor.append(request, token, logprobs) is not None:
            return None
        return self.output_processor.make_output(request)

    def _fail_alone(self, request: Request, error: Exception) -> RequestOutput:
        """End ``request`` with an error that its own sampling or output raised; the
        loop and the other requests go on, and its blocks return to the pool."""
        logger.error("request %s failed in the engine", request.request_id, exc_info=error)
        if self.handoff is not None:  # both sides end its transfer
            self.handoff.cancel(request.request_id)
        if not request.is_finished:
            self._finish(request, RequestStatus.FINISHED_ERROR)
        message = f"the engine could not process the request: {type(error).__name__}: {error}"
        # Built bare: the request's own output state may be what failed.
        out = CompletionOutput(0, "", [], "error", None, None)
        return RequestOutput(request.request_id, None, [], [out], True, error=message)

    def _record_run(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> None:
        """Record tokens the scheduler already appended, one at a time: the first one that
        stops the request drops those after it (a verify step's run may overshoot)."""
        first = len(request.output_token_ids) - len(tokens)
        for j, (token, lp) in enumerate(zip(tokens, logprobs)):
            status = self.output_processor.append(request, token, lp)
            if status is not None:
                del request.output_token_ids[first + j + 1 :]
                self._finish(request, status)
                break

    def _append(
        self, request: Request, token: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        self._record_run(request, [token], [logprobs])
        return self.output_processor.make_output(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.sampler.release(request.request_id)

    def _fail(self, request: Request, error: str) -> RequestOutput:
        if self.handoff is not None:  # both sides end its transfer
            self.handoff.cancel(request.request_id)
        self._finish(request, RequestStatus.FINISHED_ERROR)
        output = self.output_processor.make_output(request)
        output.error = error
        return output

    # -- KV hand-off (``workers/kv/handoff.py``) -------------------------------

    def _send_late(self) -> list[RequestOutput]:
        """Prefill side: the KV of late tickets whose first token is in; those whose decode
        worker cannot be reached fail."""
        if self.handoff is None:
            return []
        return [self._on_handoff(event) for event in self.handoff.worker.send_late()]

    def _handle_transfers(self) -> list[RequestOutput]:
        """Finished hand-offs, then tickets for remote requests that got blocks."""
        if self.handoff is None:
            return []
        outputs = []
        for event in self.handoff.scheduler.poll():
            try:
                outputs.append(self._on_handoff(event))
            except Exception as e:
                outputs.append(self._fail_alone(event.request, e))
        return outputs + self.issue_tickets()

    def issue_tickets(self) -> list[RequestOutput]:
        """Decode side: blocks for the remote requests that wait for them, each as an
        output with its packed ``kv_ticket`` (a step also does this first)."""
        if self.handoff is None:
            return []
        outputs = []
        for request, ticket in self.handoff.scheduler.issue_tickets():
            output = self.output_processor.make_output(request)
            output.kv_ticket = ticket.pack()
            outputs.append(output)
        return outputs

    def _on_handoff(self, event: HandoffEvent) -> RequestOutput:
        request = event.request
        if isinstance(event, HandoffFailed):
            return self._fail(request, event.error)
        if isinstance(event, SendAcked):
            self._finish(request, RequestStatus.FINISHED_TRANSFERRED)
            return self.output_processor.make_output(request)
        done, logprobs = event.done, None  # decode side: the first token arrived
        if request.sampling_params.logprobs is not None and done.logprob is not None:
            logprobs = TokenLogprobs(done.first_token, done.logprob, list(done.top_logprobs))
        output = self._append(request, done.first_token, logprobs)
        output.first_token_times = done.first_token_times  # where the prefill worker's went
        if not request.is_finished and self.config.num_speculative_tokens:
            drafts = done.draft_token_ids[: self.config.num_speculative_tokens]
            request.spec_token_ids = list(drafts)  # the prefill worker's drafts
        return output


def warms_up(device) -> bool:
    """Whether the engine runs its eager forwards at start (``SPLITSERVE_WARMUP``)."""
    setting = env("SPLITSERVE_WARMUP")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"SPLITSERVE_WARMUP={setting!r}: must be auto, 0 or 1")
    return setting == "1" or (setting == "auto" and device.type == "cuda")
