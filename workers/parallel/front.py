"""Rank 0 of an expert-parallel group: the engine the caller talks to.

``GroupFront`` starts ranks 1..N-1 as processes (``rank_process.py``), places each
new request on the least loaded rank (``distribution.py``), and steps the other
ranks with its own steps: ``start_step`` sends each rank the requests and aborts
queued for it and lets it run one step while rank 0 runs its own; ``finish_step``
collects their outputs. The caller sees one engine: outputs of every rank, one
``has_unfinished`` for all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp

import torch

from splitserve.config import EngineConfig
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.workers.output.request_output import RequestOutput
from splitserve.workers.parallel.distribution import LeastLoaded
from splitserve.workers.parallel.group import (
    GroupMember,
    check_expert_parallel,
    free_address,
    rank_device,
)
from splitserve.workers.parallel.rank_process import (
    Loaded,
    Ready,
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
) -> tuple[GroupFront | None, GroupMember | None]:
    """An engine's place in its group: rank 0 (no ``member`` given) checks the setting
    and starts the other ranks; ``(None, None)`` without expert parallelism."""
    size = config.parallel.expert_parallel_size
    if size == 1 or member is not None:
        return None, member
    check_expert_parallel(size, hf_config, device)  # (MTP with N > 1: EngineConfig refuses)
    front = GroupFront(config, device, delta_outputs)
    return front, front.member


class GroupFront:
    def __init__(self, config: EngineConfig, device: torch.device, delta_outputs: bool = False):
        self.size = config.parallel.expert_parallel_size
        address = free_address()
        context = mp.get_context("spawn")  # never fork a process that may hold a GPU
        self.conns, self.processes = [], []
        for rank in range(1, self.size):
            mine, theirs = context.Pipe()
            rank_config = dataclasses.replace(config, device=str(rank_device(device, rank)))
            member = GroupMember(rank, self.size, address)
            process = context.Process(
                target=rank_main,
                args=(rank_config, member, theirs, delta_outputs),
                name=f"splitserve-ep-rank{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.conns.append(mine)
            self.processes.append(process)
        self.member = GroupMember(0, self.size, address, lambda: self._expect(Loaded))
        self.places = LeastLoaded(self.size)
        self.calls = [StepCall() for _ in self.conns]
        self.busy = [False] * len(self.conns)
        self.expert_tokens: list[list[int] | None] = [None] * len(self.conns)

    def wait_ready(self) -> None:
        self._expect(Ready)

    def peer_expert_tokens(self) -> list[list[int]]:
        """Ranks 1..N-1's latest reports of their experts' (token, expert) pairs."""
        return [tokens or [] for tokens in self.expert_tokens]

    # -- requests --------------------------------------------------------------------

    def place_elsewhere(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        rank0_load: int,
    ) -> bool:
        """Place a new request (validated by rank 0) on the least loaded rank: True when
        another rank computes it (queued for its next step), False for rank 0."""
        if request_id in self.places.rank_of:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        rank = self.places.place(request_id, rank0_load)
        if rank == 0:
            return False
        params = params if params is not None else SamplingParams()
        self.calls[rank - 1].adds.append((request_id, prompt, params))
        return True

    def abort(self, request_id: str) -> bool:
        """Abort a request another rank computes (at its next step); False: not one."""
        rank = self.places.rank_of.get(request_id, 0)
        if rank == 0:
            return False
        self.calls[rank - 1].aborts.append(request_id)
        self.places.finished(request_id)
        return True

    def has_unfinished(self) -> bool:
        return any(self.busy) or any(call.adds for call in self.calls)

    # -- steps -----------------------------------------------------------------------

    def start_step(self) -> None:
        for rank, conn in enumerate(self.conns, 1):
            call, self.calls[rank - 1] = self.calls[rank - 1], StepCall()
            conn.send(call)

    def finish_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Rank 0's outputs of the step, then every other rank's."""
        outputs = list(outputs)
        for rank, conn in enumerate(self.conns, 1):
            reply: StepReply = self._recv(rank, conn)
            outputs += reply.outputs
            self.busy[rank - 1] = reply.has_unfinished
            if reply.tokens_per_expert is not None:
                self.expert_tokens[rank - 1] = reply.tokens_per_expert
        for out in outputs:
            if out.finished:
                self.places.finished(out.request_id)
        return outputs

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

    def _expect(self, kind: type) -> None:
        for rank, conn in enumerate(self.conns, 1):
            message = self._recv(rank, conn)
            if isinstance(message, StartFailed):
                self.close(wait=False)
                raise RuntimeError(f"expert-parallel rank {rank} failed to start:\n{message.error}")
            if not isinstance(message, kind):
                raise RuntimeError(f"expert-parallel rank {rank} sent {message!r}, not {kind}")

    def _recv(self, rank: int, conn):
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            code = self.processes[rank - 1].exitcode
            raise RuntimeError(
                f"expert-parallel rank {rank} is gone (exit code {code}): {e!r}"
            ) from e
