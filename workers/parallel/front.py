"""Rank 0 of an expert-parallel group: the engine the caller talks to.

``GroupFront`` starts ranks 1..N-1 as processes (``rank_process.py``), places each
new request on the least loaded rank (``distribution.py``), and steps the other
ranks with its own steps: ``start_step`` sends each rank the requests and aborts
queued for it and lets it run one step while rank 0 runs its own; ``finish_step``
collects their outputs. The caller sees one engine: outputs of every rank, one
``has_unfinished`` for all, one ``WorkerStats`` (``group_stats``).

Serving: every rank has its own KV cache and KV transport, so a hand-off goes
straight between the two ranks that compute it. A prefill worker's request (with a
decode worker's ticket) is computed by the rank it is placed on, which sends from
its own cache; a decode worker's remote request is reserved by the rank it is placed
on, whose ticket carries that rank's transport address and owner
(``rank_owner.py``), so the prefill worker sends there. The NCCL rendezvous, which
only rank 0's process can ask of the replica, goes through ``rank_calls.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import time
from collections.abc import Callable

import torch

from splitserve.config import EngineConfig
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.messages import WorkerStats
from splitserve.workers.kv.transfer.auth import process_key
from splitserve.workers.kv.transfer.ticket import TransferTicket
from splitserve.workers.output.request_output import RequestOutput
from splitserve.workers.parallel.distribution import LeastLoaded
from splitserve.workers.parallel.group import (
    GroupMember,
    check_expert_parallel,
    free_address,
    rank_device,
)
from splitserve.workers.parallel.group_stats import merge_group_stats
from splitserve.workers.parallel.rank_calls import FrontSide
from splitserve.workers.parallel.rank_owner import rank_owner
from splitserve.workers.parallel.rank_process import (
    Loaded,
    RankAdd,
    RankStart,
    Ready,
    ReportCall,
    Shutdown,
    StartFailed,
    StepCall,
    StepReply,
    rank_main,
)

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0


def start_group(
    config: EngineConfig,
    hf_config,
    device: torch.device,
    member: GroupMember | None,
    delta_outputs: bool,
    transport_options: dict,
) -> tuple[GroupFront | None, GroupMember | None]:
    """An engine's place in its group: rank 0 (no ``member`` given) checks the setting
    and starts the other ranks; ``(None, None)`` without expert parallelism.
    ``transport_options``: rank 0's KV transport's (``owner``, ``rendezvous``)."""
    size = config.parallel.expert_parallel_size
    if size == 1 or member is not None:
        return None, member
    check_expert_parallel(size, hf_config, device)
    front = GroupFront(
        config,
        device,
        delta_outputs,
        owner=transport_options.get("owner", ""),
        rendezvous=transport_options.get("rendezvous"),
    )
    return front, front.member


class GroupFront:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        delta_outputs: bool = False,
        owner: str = "",
        rendezvous: Callable | None = None,
    ):
        self.size = config.parallel.expert_parallel_size
        address = free_address()
        context = mp.get_context("spawn")  # never fork a process that may hold a GPU
        self.conns, self.processes, call_conns = [], [], []
        for rank in range(1, self.size):
            mine, theirs = context.Pipe()
            calls_mine, calls_theirs = context.Pipe()
            start = RankStart(
                dataclasses.replace(config, device=str(rank_device(device, rank))),
                GroupMember(rank, self.size, address),
                delta_outputs,
                rank_owner(owner, rank),
                rendezvous is not None,
                process_key() if config.kv_transfer.auth_key is None else None,
            )
            process = context.Process(
                target=rank_main,
                args=(start, theirs, calls_theirs),
                name=f"splitserve-ep-rank{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            calls_theirs.close()
            self.conns.append(mine)
            call_conns.append(calls_mine)
            self.processes.append(process)
        self.side = FrontSide(call_conns, rendezvous)
        self.member = GroupMember(0, self.size, address, lambda: self._expect(Loaded))
        self.places = LeastLoaded(self.size)
        self.calls = [StepCall() for _ in self.conns]
        self.busy = [False] * len(self.conns)
        self.runnable = [False] * len(self.conns)
        self.stats: list[WorkerStats | None] = [None] * len(self.conns)  # as last reported
        self._report = False

    def wait_ready(self) -> None:
        for rank, ready in enumerate(self._expect(Ready), 1):
            self.stats[rank - 1] = ready.stats

    @property
    def notify(self) -> Callable[[], None] | None:
        return self.side.notify

    @notify.setter
    def notify(self, notify: Callable[[], None] | None) -> None:
        """What wakes rank 0's loop when another rank's transport has news."""
        self.side.notify = notify

    def peer_expert_tokens(self) -> list[list[int]]:
        """Ranks 1..N-1's latest reports of their experts' (token, expert) pairs."""
        return [(s.expert_tokens or [[]])[0] if s is not None else [] for s in self.stats]

    def group_stats(self, rank0: WorkerStats) -> WorkerStats:
        """The group's load as one worker's, from rank 0's and the others' last reports
        (the next step asks them for fresh ones)."""
        self._report = True
        return merge_group_stats(rank0, [s for s in self.stats if s is not None])

    # -- requests --------------------------------------------------------------------

    def place_elsewhere(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        rank0_load: int,
        kv_ticket: TransferTicket | bytes | None = None,
        remote: bool = False,
    ) -> bool:
        """Place a new request (validated by rank 0) on the least loaded rank: True when
        another rank computes it (queued for its next step), False for rank 0.
        ``kv_ticket``: a prefill worker's request, whose KV that rank sends; ``remote``:
        a decode worker's reservation, whose ticket that rank issues."""
        if request_id in self.places.rank_of:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        rank = self.places.place(request_id, rank0_load)
        if rank == 0:
            return False
        params = params if params is not None else SamplingParams()
        self.calls[rank - 1].adds.append(RankAdd(request_id, prompt, params, kv_ticket, remote))
        return True

    def abort(self, request_id: str) -> bool:
        """Abort a request another rank computes (at its next step); False: not one."""
        rank = self.places.rank_of.get(request_id, 0)
        if rank == 0:
            return False
        self.calls[rank - 1].aborts.append(request_id)
        self.places.finished(request_id)
        return True

    def join_kv_pair(self, rank: int, pair_key: str, unique_id: bytes) -> None:
        """NCCL, decode side: rank ``rank``'s transport joins a prefill worker's pair."""
        if not 0 < rank < self.size:
            raise ValueError(f"no rank {rank} in an expert-parallel group of {self.size}")
        self.side.join(rank, pair_key, unique_id)

    def has_unfinished(self) -> bool:
        pending = any(call.adds or call.aborts for call in self.calls)
        return any(self.busy) or pending or bool(self.side.lost)

    def has_runnable(self) -> bool:
        """Another rank has work for a step now (not only transfers under way)."""
        pending = any(call.adds or call.aborts for call in self.calls)
        return any(self.runnable) or pending or bool(self.side.lost)

    # -- steps -----------------------------------------------------------------------

    def start_step(self) -> None:
        for rank in sorted(self.side.lost):
            self._gone(rank, "its process ended")
        for rank, conn in enumerate(self.conns, 1):
            call, self.calls[rank - 1] = self.calls[rank - 1], StepCall()
            call.report = self._report
            try:
                conn.send(call)
            except OSError as e:
                self._gone(rank, repr(e))
        self._report = False

    def finish_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Rank 0's outputs of the step, then every other rank's."""
        outputs = list(outputs)
        for rank, conn in enumerate(self.conns, 1):
            reply: StepReply = self._recv(rank, conn)
            outputs += reply.outputs
            self.busy[rank - 1] = reply.has_unfinished
            self.runnable[rank - 1] = reply.has_runnable
            if reply.stats is not None:
                self.stats[rank - 1] = reply.stats
        for out in outputs:
            if out.finished:
                self.places.finished(out.request_id)
        return outputs

    def refresh_stats(self) -> None:
        """Every other rank's stats now, between steps (the group is idle)."""
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(ReportCall())
            except OSError as e:
                self._gone(rank, repr(e))
        for rank, conn in enumerate(self.conns, 1):
            self.stats[rank - 1] = self._recv(rank, conn)

    def close(self, wait: bool = True) -> None:
        """Stop the other ranks: after their current step (``wait``), or now."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a rank already gone
                conn.send(Shutdown())
        for process in self.processes:
            process.join(SHUTDOWN_TIMEOUT_S if wait else 0)
            if process.is_alive():
                logger.warning("expert-parallel rank process %d did not stop", process.pid)
                process.kill()

    def _expect(self, kind: type) -> list:
        messages = []
        for rank, conn in enumerate(self.conns, 1):
            message = self._recv(rank, conn)
            if isinstance(message, StartFailed):
                self.close(wait=False)
                raise RuntimeError(f"expert-parallel rank {rank} failed to start:\n{message.error}")
            if not isinstance(message, kind):
                raise RuntimeError(f"expert-parallel rank {rank} sent {message!r}, not {kind}")
            messages.append(message)
        return messages

    def _recv(self, rank: int, conn):
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            self._gone(rank, repr(e))

    def check_ranks(self, error: BaseException, wait_s: float = 1.0) -> None:
        """After ``error`` in a step (a collective failing): if a rank's process ended,
        raise that instead (the collective's own error rarely names the rank)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self.processes, 1):
                if rank in self.side.lost or process.exitcode is not None:
                    self._gone(rank, f"{type(error).__name__}: {error}")
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def _gone(self, rank: int, why: str):
        process = self.processes[rank - 1]
        process.join(1.0)  # its exit code, when it is ending
        raise RuntimeError(
            f"expert-parallel rank {rank} of {self.size} is gone (process {process.pid}, "
            f"exit code {process.exitcode}); the group cannot step without it ({why})"
        )
