"""The KV hand-off beside the engine, in two halves (as vLLM's KV connector has).

**Scheduler half** (``HandoffScheduler``): which requests wait for KV, and what
stays alive after a prompt is done.

- decode side: a remote request waits in the scheduler (``WAITING_FOR_KV``)
  until blocks are free; ``issue_tickets`` reserves them and expects the
  transfer; ``poll`` reports ``KVArrived`` (the KV and first token are in the
  blocks: the request decodes from here) or ``HandoffFailed``.
- prefill side: ``check_ticket`` checks a decode worker's ticket; ``admit``
  queues the request once the transport is connected to that decode worker (the
  connection, NCCL's rendezvous included, is made on a transport thread: a slow or
  hung decode worker never holds up the loop; until then the request waits here,
  outside the scheduler, and a failed connection fails only the requests bound to
  that worker). Once its prompt is computed it is held (``SENDING_KV``, blocks
  kept) until ``poll`` reports ``SendAcked`` (free them) or ``HandoffFailed``.

**Worker half** (``HandoffWorker``): ``start_sends`` opens the transfers of the
prompts a step finishes and gives the hook the model calls as each layer's KV
is stored (the layer goes out at once); ``finish_send`` sends the first token
after the step is read back (the engine also returns it as an output at once, so a
front can stream it before the KV is in; ``LLMEngine._first_token_ahead``).

Either half ``cancel``s a request's transfer (abort, failure); the transport
tells the other side.

**Late tickets** (a prompt sent with ``ticket_follows``, at the same time as its
decode worker is asked for blocks): the prefill worker computes the prompt at once,
without a ticket, and holds it as any sent prompt once its first token is sampled;
``finish_send`` keeps that "done" (``LateSend``). The ticket comes later
(``LLMEngine.give_ticket``): to a request not scheduled yet whose decode worker is
connected it is given as if it had come with the prompt (``attach``: layer-by-layer
sends); else it waits beside the "done", and once both are in ``send_late`` sends
every layer at once (the MTP layer's too), then the "done". From there the ack or a
failure ends it as any other. An abort or a failure forgets it (``drop_late``); a
ticket that has not come ``kv_transfer.timeout_s`` after the first token fails it.

An FP8 cache's pages travel as they are, and the sender's per-layer scales in the
done message; the decode side takes them before the request decodes
(``KVCache.receive_scales``: adopted where it has none, else the arrived rows are
requantized to its own).

Speculative decoding (MTP): a decode worker that drafts asks for one more layer,
the MTP layer's prompt KV (the MTP layer's first pass over the prompt on the
prefill side writes it, fed the prompt shifted by one and the first token), and
the done message carries the prefill worker's drafts, so the decode worker's
first step verifies them and its drafter attends the prompt from there. Sending
that layer costs ``2 * kv_heads * head_dim`` values a token, less than the
prompt's hidden states it would be recomputed from (``hidden_size``; GLM-4.5-Air:
2,048 against 4,096). A prefill worker without the drafter refuses such tickets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.errors import InvalidRequestError
from splitserve.scheduler.request import Request, RequestStatus
from splitserve.scheduler.scheduler import Scheduler, SchedulerOutput, will_sample
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.base import CONNECTING, KVTransport
from splitserve.workers.kv.transfer.ticket import TransferDone, TransferTicket, token_slots
from splitserve.workers.output.processor import first_token_times
from splitserve.workers.sampling.sampler import TokenLogprobs


@dataclass(frozen=True)
class KVArrived:
    """Decode side: the prompt's KV is in the request's blocks; ``done`` has its first
    token (and its logprobs when asked for)."""

    request: Request
    done: TransferDone


@dataclass(frozen=True)
class SendAcked:
    """Prefill side: the decode worker has the KV; the request's blocks may go."""

    request: Request


@dataclass(frozen=True)
class HandoffFailed:
    request: Request
    error: str


HandoffEvent = KVArrived | SendAcked | HandoffFailed


class HandoffScheduler:
    def __init__(
        self,
        transport: KVTransport,
        scheduler: Scheduler,
        num_layers: int,
        drafts: bool = False,
        kv_cache: KVCache | None = None,
    ):
        """``num_layers``: the model's decoder layers; ``drafts``: this worker drafts with
        the MTP layer (its KV layer ``num_layers`` travels too); ``kv_cache``: the cache
        the KV arrives in (an FP8 one takes the sender's scales)."""
        self.transport = transport
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.drafts = drafts
        self.num_layers = num_layers + drafts  # layers a ticket of this worker asks for
        self._connecting: dict[str, Request] = {}  # prefill side: waiting for their receiver

    def check_ticket(self, ticket: TransferTicket | bytes, request: Request) -> TransferTicket:
        """Prefill side: the ticket, unpacked; InvalidRequestError naming every mismatch."""
        if isinstance(ticket, bytes):
            try:
                ticket = TransferTicket.unpack(ticket)
            except Exception as e:  # not a ticket: the caller's error, not the engine's
                raise InvalidRequestError(f"invalid KV ticket: {type(e).__name__}: {e}") from e
        problems = []
        try:
            self.transport.layout.check_matches(ticket.layout)
        except ValueError as e:
            problems.append(str(e))
        if ticket.num_tokens != request.num_prompt_tokens:
            problems.append(
                f"the ticket covers {ticket.num_tokens} tokens, the prompt has "
                f"{request.num_prompt_tokens}"
            )
        if ticket.num_layers == self.num_layers + 1 and not self.drafts:
            problems.append(
                f"the ticket asks for {ticket.num_layers} layers, the MTP layer's KV included: "
                "the decode worker drafts with MTP, this prefill worker has no "
                "speculative_config; give both workers the same speculative_config"
            )
        elif ticket.num_layers not in (self.num_layers, self.num_layers - self.drafts):
            problems.append(
                f"the ticket asks for {ticket.num_layers} layers, the model has {self.num_layers}"
            )
        if ticket.request_id != request.request_id:
            problems.append(f"the ticket is for request {ticket.request_id!r}")
        if problems:
            raise InvalidRequestError("invalid KV ticket: " + "; ".join(problems))
        return ticket

    def attach(self, request: Request, ticket: TransferTicket) -> bool:
        """Prefill side, a checked late ticket: a request not scheduled yet takes it as if
        it had come with the prompt, when its decode worker is connected; False: it goes
        the late way (``HandoffWorker.give_ticket``)."""
        unscheduled = request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        if not unscheduled or self.transport.connect(ticket) is not None:
            return False
        request.kv_ticket, request.ticket_follows = ticket, False
        return True

    def admit(self, request: Request) -> None:
        """Prefill side: queue a request with a checked ticket, once the transport is
        connected to its decode worker (until then it waits here)."""
        self.scheduler.add_request(request)  # checked as any request is
        if self.transport.connect(request.kv_ticket) is None:
            return
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)  # not yet
        self._connecting[request.request_id] = request

    @property
    def num_connecting(self) -> int:
        """Requests waiting for their decode worker's connection."""
        return len(self._connecting)

    def issue_tickets(self) -> list[tuple[Request, TransferTicket]]:
        """Decode side: reserve blocks for waiting remote requests and expect their KV."""
        issued = []
        for request in self.scheduler.reserve_kv_blocks():
            ticket = self.transport.make_ticket(
                request.request_id,
                request.block_ids,
                start_token=request.num_cached_tokens,
                num_tokens=request.num_prompt_tokens,
                num_layers=self.num_layers,
            )
            self.transport.expect(ticket)
            issued.append((request, ticket))
        return issued

    def hold(self, batch_sampling: list[Request]) -> None:
        """Prefill side: requests whose prompt the launched step finishes keep their blocks
        (and leave the running set) until the decode worker acks; those whose ticket
        follows, until it came and their KV was sent and acked."""
        for request in batch_sampling:
            if request.sends_kv:
                self.scheduler.hold_for_transfer(request)

    def poll(self) -> list[HandoffEvent]:
        """Finished transfers; decode-side arrivals are already running in the scheduler.
        Prefill side: requests whose decode worker is now connected are queued, and those
        whose connection failed fail."""
        events = self._connected() if self._connecting else []
        for event in self.transport.poll():
            request = self.scheduler.get_request(event.request_id)
            if request is None:
                continue  # aborted meanwhile
            if not event.ok:
                events.append(HandoffFailed(request, event.error))
            elif event.side == "send":
                events.append(SendAcked(request))
            else:
                if error := self._receive_scales(request, event.done):
                    events.append(HandoffFailed(request, error))
                    continue
                self.scheduler.kv_arrived(request.request_id, event.done.first_token)
                events.append(KVArrived(request, event.done))
        return events

    def _receive_scales(self, request: Request, done: TransferDone) -> str | None:
        """Decode side, FP8: the sender's scales for the arrived rows; why not, or None."""
        if self.kv_cache is None or not self.kv_cache.is_fp8:
            return None
        start, end = request.num_cached_tokens, request.num_prompt_tokens
        slots = token_slots(request.block_ids, self.kv_cache.block_size, start, end)
        try:
            self.kv_cache.receive_scales(done.kv_scales, self.num_layers, slots)
        except ValueError as e:
            return str(e)
        return None

    def cancel(self, request_id: str, ticket: TransferTicket | None = None) -> None:
        """Before the request's blocks can be reused: end its transfer on both sides
        (``ticket``: a late request's, not attached to it)."""
        request = self.scheduler.get_request(request_id) or self._connecting.pop(request_id, None)
        if ticket is None and request is not None:
            ticket = request.kv_ticket
        self.transport.cancel(request_id, ticket)

    def _connected(self) -> list[HandoffEvent]:
        states: dict[str, str | None] = {}  # receiver address -> its connection's state
        failed = []
        for rid, request in list(self._connecting.items()):
            ticket = request.kv_ticket
            if ticket.address not in states:
                states[ticket.address] = self.transport.connect(ticket)
            state = states[ticket.address]
            if state == CONNECTING:
                continue
            del self._connecting[rid]
            self.scheduler.add_request(request)  # failed: in the scheduler to end there
            if state is not None:
                failed.append(HandoffFailed(request, f"could not reach the decode worker: {state}"))
        return failed


@dataclass
class StepSends:
    """The transfers a launched step opened: the per-layer hook and the ones that failed."""

    request_ids: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why it failed
    on_layer_stored: Callable[[int], None] | None = None


@dataclass
class LateSend:
    """Prefill side, a request whose ticket follows: its ticket and its "done" as each
    comes; its KV goes out once both are in."""

    request: Request
    ticket: TransferTicket | None = None
    done: TransferDone | None = None
    since: float = field(default_factory=time.monotonic)  # the first of the two came
    connecting: bool = False  # ready, its decode worker's connection not up at the last try

    @property
    def ready(self) -> bool:
        return self.ticket is not None and self.done is not None


class HandoffWorker:
    def __init__(
        self,
        transport: KVTransport,
        kv_cache: KVCache | None = None,
        ticket_timeout_s: float = 60.0,
    ):
        """``ticket_timeout_s``: a late request whose first token is in waits this long for
        its ticket, then fails (its blocks return)."""
        self.transport = transport
        self.kv_cache = kv_cache  # an FP8 one's scales go with the first token
        self.ticket_timeout_s = ticket_timeout_s
        self._late: dict[str, LateSend] = {}  # by request id: not sent, ticket not attached

    def start_sends(self, batch: SchedulerOutput) -> StepSends:
        """Open the transfers of prompts this step finishes; each layer goes out once the
        model has stored it (``on_layer_stored``)."""
        sends = StepSends()
        for request, n in zip(batch.requests, batch.num_scheduled_tokens):
            if request.kv_ticket is None or not will_sample(request, n):
                continue
            try:
                self.transport.start_send(request.kv_ticket, request.block_ids)
                sends.request_ids.append(request.request_id)
            except Exception as e:  # this request's decode worker: it alone fails
                sends.errors[request.request_id] = f"could not reach the decode worker: {e}"
        if sends.request_ids:
            sends.on_layer_stored = self._layer_sender(sends.request_ids)
        return sends

    def finish_send(
        self,
        request: Request,
        token: int,
        logprobs: TokenLogprobs | None,
        drafts: list[int] | None = None,
    ) -> None:
        """After the step is read back: the first token (and the drafts after it) follow
        the last layer; a request whose ticket follows keeps them for ``send_late``."""
        lp, top = (logprobs.logprob, logprobs.top) if logprobs is not None else (None, [])
        rid = request.request_id
        scales = self.kv_cache.scales_to_wire() if self.kv_cache is not None else []
        times = first_token_times(request)
        done = TransferDone(rid, token, lp, top, list(drafts or []), scales, times)
        if request.ticket_follows:
            self._late_send(request).done = done
        else:
            self.transport.finish_send(rid, done)

    def give_ticket(self, request: Request, ticket: TransferTicket) -> None:
        """A late request's checked ticket, not attached: it goes out with ``send_late``
        (the connection to its decode worker is made meanwhile)."""
        self._late_send(request).ticket = ticket
        self.transport.connect(ticket)

    def has_ready_late(self) -> bool:
        """Whether a late request has its ticket and its first token: ``send_late`` sends."""
        return any(late.ready and not late.connecting for late in self._late.values())

    def send_late(self) -> list[HandoffFailed]:
        """Late requests with their ticket and their "done": every layer, then the "done"
        (the ack ends them as any other). Those whose decode worker is still connecting
        wait; those whose decode worker cannot be reached fail, and so do those whose
        ticket has not come within ``ticket_timeout_s``."""
        failed, states = [], {}  # receiver address -> its connection's state
        now = time.monotonic()
        for rid, late in list(self._late.items()):
            if late.request.is_finished:  # ended where nothing dropped it
                del self._late[rid]
                continue
            if late.ticket is None and now - late.since > self.ticket_timeout_s:
                del self._late[rid]
                wait = f"{self.ticket_timeout_s:g} s (kv_transfer.timeout_s)"
                failed.append(HandoffFailed(late.request, f"no KV ticket came within {wait}"))
                continue
            if not late.ready:
                continue
            address = late.ticket.address
            if address not in states:
                states[address] = self.transport.connect(late.ticket)
            late.connecting = states[address] == CONNECTING  # tried again at the next step
            if late.connecting:
                continue
            del self._late[rid]
            error = states[address] or self._send_all(late)
            if error is not None:
                failed.append(
                    HandoffFailed(late.request, f"could not reach the decode worker: {error}")
                )
        return failed

    def drop_late(self, request_id: str) -> TransferTicket | None:
        """A late request ends before its KV went out (abort, failure): forget it; its
        ticket if it came (the decode worker hears of the cancel)."""
        late = self._late.pop(request_id, None)
        return late.ticket if late is not None else None

    def _late_send(self, request: Request) -> LateSend:
        late = self._late.get(request.request_id)
        if late is None or late.request is not request:  # a new request under an old id
            late = self._late[request.request_id] = LateSend(request)
        return late

    def _send_all(self, late: LateSend) -> str | None:
        """The whole transfer of a late request at once; why it could not start, or None."""
        request, ticket, rid = late.request, late.ticket, late.request.request_id
        try:
            self.transport.start_send(ticket, request.block_ids)
        except Exception as e:  # this request's decode worker: it alone fails
            return str(e)
        for layer_id in range(ticket.num_layers):
            self.transport.send_layer(rid, layer_id)
        self.transport.finish_send(rid, late.done)
        request.kv_ticket, request.ticket_follows = ticket, False
        return None

    def _layer_sender(self, request_ids: list[str]) -> Callable[[int], None]:
        send_layer = self.transport.send_layer

        def on_layer_stored(layer_id: int) -> None:
            for rid in request_ids:
                send_layer(rid, layer_id)

        return on_layer_stored


class KVHandoff:
    """Both halves over one transport (a prefill or decode worker has one; mixed: none)."""

    def __init__(
        self,
        transport: KVTransport,
        scheduler: Scheduler,
        num_layers: int,
        drafts: bool = False,
        kv_cache: KVCache | None = None,
        ticket_timeout_s: float = 60.0,
    ):
        self.transport = transport
        self.scheduler = HandoffScheduler(transport, scheduler, num_layers, drafts, kv_cache)
        self.worker = HandoffWorker(transport, kv_cache, ticket_timeout_s)

    def cancel(self, request_id: str) -> None:
        """Abort or failure: end the request's transfer on both sides before its blocks are
        reused (a late request is forgotten; its ticket, if it came, reaches its decode
        worker)."""
        self.scheduler.cancel(request_id, self.worker.drop_late(request_id))

    def close(self) -> None:
        self.transport.close()
