"""What crosses a process or Ray boundary: the ingress, a worker replica and its engine
process speak only these types.

Calls, into a worker's engine process (from an ingress over its own connection):
    ``Hello``         the first frame of a connection: the application's secret
    ``GenerateCall``  a request to compute here (local), to decode after a prefill
                      worker's hand-off (``remote``), or a prompt to compute and hand
                      off (``kv_ticket``: a prefill worker; ``ticket_follows``: computed
                      at once, the ticket comes later in a ``LateTicket``)
    ``LateTicket``    the decode worker's ticket for a prompt sent with ``ticket_follows``
    ``Abort``         the caller left or failed: free the request's KV
    ``NcclJoinCall``  (through Ray) a prefill worker's NCCL rendezvous with a decode replica
    ``ProfileCall``   open or close the engine's torch.profiler window; ``ProfileDone``
                      answers it
Events, out of a worker, each for one request:
    ``Routed``        a decode worker's route: ``disaggregated`` or ``local_prefix_hit``
    ``TicketIssued``  blocks reserved: a prefill worker may now send the KV there
    ``Delta``         what one step added to a request (tokens, text, logprobs, finish)
    ``Rejected``      invalid request (the ingress answers 400), nothing was computed
    ``Overloaded``    the worker holds its limit of requests: try another, or answer 503
    ``Failed``        the request cannot go on (a failed hand-off; ``engine_down``: the
                      engine's loop died, and the worker takes no more requests)
Load: ``WorkerStats``, every stats period, to the replica and to every connection.

An engine step sends one ``StepEvents`` per connection with all of that
connection's requests' events; nothing crosses a boundary once per token per
request.

Messages are msgpack frames, ``[tag, *fields]`` (``encode`` / ``decode``), each
behind a 4-byte big-endian signed length (``multiprocessing.connection``'s framing,
which the engine process uses; ``read_frame`` / ``framed`` are the asyncio side).
Through Ray they travel as the objects themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from splitserve.sampling_params import SamplingParams
from splitserve.workers.output.request_output import (
    CompletionOutput,
    FirstTokenTimes,
    RequestOutput,
)
from splitserve.workers.sampling.sampler import TokenLogprobs

# ---- calls -----------------------------------------------------------------


@dataclass(frozen=True)
class GenerateCall:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    remote: bool = False  # decode side of a disaggregated request: reserve, then receive
    local_prefix_ratio: float | None = None  # remote: compute here above this prefix hit
    kv_ticket: bytes | None = None  # prefill side: the decode worker's ticket
    ticket_follows: bool = False  # prefill side: compute now, the ticket comes in a LateTicket


@dataclass(frozen=True)
class LateTicket:
    """Front -> engine: the decode worker's ticket for a request sent with
    ``ticket_follows``."""

    request_id: str
    kv_ticket: bytes


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Hello:
    """A connection's first frame; the engine closes a connection whose secret is wrong."""

    secret: str


@dataclass(frozen=True)
class NcclJoinCall:
    """To a decode replica (``worker``): join a prefill worker's NCCL pair as rank 1."""

    worker: str
    pair_key: str
    unique_id: bytes
    rank: int = 0  # the expert-parallel rank whose transport joins (0 without EP)


@dataclass(frozen=True)
class ProfileCall:
    """Front -> engine: open (``start``) or close the engine's ``torch.profiler`` window
    (``workers/engine/torch_profiler.py``); answered with a ``ProfileDone`` of the same
    ``call_id``."""

    call_id: int
    start: bool


@dataclass(frozen=True)
class ProfileDone:
    """Engine -> front: a ``ProfileCall`` done (``trace``: the trace written, at a stop)
    or refused (``error``: why)."""

    call_id: int
    trace: str | None = None
    error: str | None = None


# ---- events ----------------------------------------------------------------


@dataclass(frozen=True)
class Routed:
    request_id: str
    route: str


@dataclass(frozen=True)
class TicketIssued:
    request_id: str
    ticket: bytes


@dataclass
class Delta:
    """What a step added to a request; ``finish_reason`` set on its last one."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "transferred"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    first_token_times: FirstTokenTimes | None = None  # the engine's share of the TTFT

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, output: RequestOutput) -> Delta:
        out = output.outputs[0]
        return cls(
            output.request_id,
            out.token_ids,
            out.text,
            out.logprobs,
            out.finish_reason,
            out.stop_reason,
            output.num_cached_tokens,
            output.error,
            output.first_token_times,
        )

    def to_output(self) -> RequestOutput:
        """The delta ``RequestOutput`` the response builders read."""
        out = CompletionOutput(
            0, self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs
        )
        return RequestOutput(
            self.request_id,
            None,
            [],
            [out],
            self.finished,
            num_cached_tokens=self.num_cached_tokens,
            new_text=self.text,
            new_token_ids=self.token_ids,
            error=self.error,
            first_token_times=self.first_token_times,
        )


def merge_deltas(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one request as one (a consumer that lagged catches up)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in d.logprobs or []]
    return dataclasses.replace(
        last,
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        logprobs=logprobs,
        num_cached_tokens=max(d.num_cached_tokens for d in deltas),
        first_token_times=next((d.first_token_times for d in deltas if d.first_token_times), None),
    )


@dataclass(frozen=True)
class Rejected:
    request_id: str
    message: str


@dataclass(frozen=True)
class Overloaded:
    request_id: str
    message: str


@dataclass(frozen=True)
class Failed:
    request_id: str
    message: str
    engine_down: bool = False  # the engine failed: nothing more runs there (retry elsewhere)


Event = Routed | TicketIssued | Delta | Rejected | Overloaded | Failed


def is_last(event: Event) -> bool:
    """Whether nothing follows ``event`` for its request."""
    return isinstance(event, Failed | Rejected | Overloaded) or getattr(event, "finished", False)


@dataclass
class StepEvents:
    """Everything one engine step produced, for all of its requests, in order."""

    events: list[Event] = field(default_factory=list)


# ---- load ------------------------------------------------------------------


@dataclass
class WorkerStats:
    role: str
    engine_pid: int  # the engine process
    pid: int = 0  # the replica that holds it (set by the replica)
    address: str = ""  # host:port where fronts connect to the engine process
    num_running: int = 0
    num_waiting: int = 0  # prompts waiting to be scheduled
    num_waiting_for_kv: int = 0  # remote requests with reserved blocks or waiting for them
    num_sending_kv: int = 0  # prefill side: first token sampled, waiting for the ack
    queued_prompt_tokens: int = 0  # prompt tokens not computed yet
    num_free_blocks: int = 0
    num_blocks: int = 1  # usable blocks (the null page excluded)
    kv_usage: float = 0.0
    num_preemptions: int = 0
    kv_transfers: int = 0  # finished sends
    kv_late_tickets: int = 0  # prefill side: prompts sent before their ticket, tickets in
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    num_steps: int = 0  # engine steps so far (progress, for a watchdog)
    draining: bool = False  # the engine finishes what it holds and takes no new requests
    # Speculative decoding (MTP), so far: drafts verified, drafts accepted, and per
    # accepted-run length n the verify steps that accepted n drafts (``SpecDecodeStats``).
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_acceptance_lengths: list[int] = field(default_factory=list)
    # Expert parallelism (load balance): per rank, the (token, expert) pairs each of its
    # routed experts computed so far (rank r holds experts r * E/N ..); [] without it.
    # ``LLMEngine.expert_tokens()``.
    expert_tokens: list[list[int]] = field(default_factory=list)
    # Expert parallelism: per rank, its free KV blocks (the counts above are the
    # group's sums); [] without it.
    rank_free_blocks: list[int] = field(default_factory=list)
    # Forwards so far by step kind and how they ran (graph, piecewise, eager):
    # ``[[kind, how, count], ...]`` (``workers/runner/forward_counts.py``); a group's
    # ranks summed.
    forward_counts: list[list] = field(default_factory=list)
    # The engine loop's turns that ran a step, so far, by the step's kind and batch:
    # ``[[kind, batch bucket, steps, requests, context tokens, seconds, seconds waiting
    # for the device], ...]``
    # (``workers/engine/step_times.py``; an expert-parallel group: rank 0's loop).
    step_times: list[list] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- the codec ------------------------------------------------------------------------

_TYPES: list[type] = [
    GenerateCall,
    Abort,
    Hello,
    NcclJoinCall,
    Routed,
    TicketIssued,
    Delta,
    Rejected,
    Overloaded,
    Failed,
    StepEvents,
    WorkerStats,
    SamplingParams,
    TokenLogprobs,
    FirstTokenTimes,
    LateTicket,
    ProfileCall,
    ProfileDone,
]
_TAG = {t: i for i, t in enumerate(_TYPES)}


def register(message_type: type) -> type:
    """Add a dataclass to the codec (the engine process's control messages)."""
    _TAG[message_type] = len(_TYPES)
    _TYPES.append(message_type)
    return message_type


def encode(message: Any) -> bytes:
    return msgpack.packb(message, default=_pack, use_bin_type=True)


def decode(frame: bytes) -> Any:
    return msgpack.unpackb(frame, ext_hook=_unpack, raw=False, strict_map_key=False)


def _pack(obj: Any) -> msgpack.ExtType:
    tag, fields_of = _packer(type(obj))
    return msgpack.ExtType(tag, msgpack.packb(fields_of(obj), default=_pack, use_bin_type=True))


_PACKERS: dict[type, tuple[int, Callable[[Any], tuple]]] = {}


def _packer(message_type: type) -> tuple[int, Callable[[Any], tuple]]:
    """A message type's tag and a getter of its fields in order, made once per type (a
    step's frame packs a delta per request)."""
    packer = _PACKERS.get(message_type)
    if packer is None:
        tag = _TAG.get(message_type)
        if tag is None:
            raise TypeError(f"{message_type.__name__} is not a message type")
        packer = _PACKERS[message_type] = (tag, _fields_getter(message_type))
    return packer


def _fields_getter(message_type: type) -> Callable[[Any], tuple]:
    names = [f.name for f in dataclasses.fields(message_type)]
    if len(names) > 1:
        return operator.attrgetter(*names)  # a tuple of them
    if names:
        one = operator.attrgetter(names[0])
        return lambda obj: (one(obj),)
    return lambda obj: ()


def _unpack(tag: int, data: bytes) -> Any:
    fields = msgpack.unpackb(data, ext_hook=_unpack, raw=False, strict_map_key=False)
    return _TYPES[tag](*fields)


MAX_FRAME_BYTES = 64 << 20  # a front's frame beyond this closes its connection
_HEADER = struct.Struct("!i")


def framed(frame: bytes) -> bytes:
    """``frame`` behind its length, as ``Connection.send_bytes`` writes it."""
    return _HEADER.pack(len(frame)) + frame


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame ``Connection.send_bytes`` wrote (frames from an engine stay < 2 GiB)."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size < 0:
        raise ConnectionError("a frame of 2 GiB or more")
    return await reader.readexactly(size)
