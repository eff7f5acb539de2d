"""An expert-parallel group: N ranks, each a process, joined over torch.distributed.

Each rank holds two process groups built straight from one ``TCPStore`` (rank 0 is
its server), so the caller's process keeps no torch.distributed default group:

- ``data``: dispatch and combine of the MoE layers; NCCL on GPUs, gloo on CPU;
- ``control``: gloo on the host, for the one small exchange a step makes before its
  forward (``lockstep.py``), so it never waits for the device.

On a GPU rank ``r`` runs on the device ``r`` places after rank 0's. Where the GPUs
can read each other's memory, the group also shares one buffer a rank
(``peer_memory.py``) for DECODE-mode dispatch and combine.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from splitserve.kernels.ep_rows import RowLayout
from splitserve.workers.model.layers.moe import Experts, ExpertShard, MoEBlock
from splitserve.workers.parallel.dispatch import Dispatcher
from splitserve.workers.parallel.peer_memory import PeerLayout, PeerMemory, peers_reachable

# A rank waits this long for the others in a collective before it gives up: long
# enough for a peer's slow step (a long prefill, graph capture at start-up).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class ExpertGroup:
    rank: int
    size: int
    device: torch.device
    data: Any  # dist.ProcessGroup of the MoE exchanges
    control: Any  # dist.ProcessGroupGloo of the per-step exchange
    peers: PeerMemory | None = None  # GPUs of one host: the buffers the ranks share

    def shard(self, num_experts: int) -> ExpertShard:
        """The routed experts this rank holds: a contiguous E/N of them."""
        return expert_shard(self.rank, self.size, num_experts)

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
            self.peers = None
        for group in (self.data, self.control):
            if hasattr(group, "shutdown"):
                group.shutdown()


@dataclass(frozen=True)
class GroupMember:
    """Where an engine stands in its group: its rank, rank 0's ``host:port``, and what
    to do right before joining (rank 0: wait until every rank loaded its model, so a
    rank that failed to start is an error, not a hang; the others: say so)."""

    rank: int
    size: int
    address: str
    before_join: Callable[[], None] | None = None

    def join(self, device: torch.device) -> ExpertGroup:
        if self.before_join is not None:
            self.before_join()
        return join_group(self.rank, self.size, self.address, device)

    def expert_shard(self, hf_config: Any) -> ExpertShard:
        return expert_shard(self.rank, self.size, num_routed_experts(hf_config))


def expert_shard(rank: int, size: int, num_experts: int) -> ExpertShard:
    count = num_experts // size
    return ExpertShard(first=rank * count, count=count, total=num_experts)


def join_group(rank: int, size: int, address: str, device: torch.device) -> ExpertGroup:
    """Join (rank 0: open) the group at ``address`` (``host:port``); returns when all
    ``size`` ranks have joined."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)
    control = dist.ProcessGroupGloo(
        dist.PrefixStore("control", store), rank, size, COLLECTIVE_TIMEOUT
    )
    if device.type == "cuda":
        torch.cuda.set_device(rank_device(device, 0))  # rank 0's "cuda": the current GPU
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, size, options)
    else:
        data = dist.ProcessGroupGloo(
            dist.PrefixStore("data", store), rank, size, COLLECTIVE_TIMEOUT
        )
    control.barrier().wait()  # every rank is here: the store may go when rank 0 leaves
    return ExpertGroup(rank, size, device, data, control)


def attach_dispatcher(model: nn.Module, group: ExpertGroup, max_rows: int = 0) -> None:
    """Give every routed-experts module of ``model`` the group's dispatch and combine.
    ``max_rows``: the most tokens a rank's DECODE step carries (its largest batch, drafts
    included); on GPUs that reach each other, steps up to it go through shared buffers."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        return
    if group.device.type == "cuda" and max_rows > 0 and group.peers is None:
        group.peers = _shared_buffers(model, experts[0], group, max_rows)
    shard = experts[0].shard
    dispatcher = Dispatcher(group.data, group.rank, group.size, shard.count, group.peers)
    for module in experts:
        module.dispatcher = dispatcher


def _shared_buffers(
    model: nn.Module, experts: Experts, group: ExpertGroup, max_rows: int
) -> PeerMemory | None:
    """The group's shared buffers, sized for ``max_rows`` of the model's widest dispatched
    row; None (NCCL) unless every rank reaches every other rank's GPU."""
    if not peers_reachable(group.control, group.rank, group.size, group.device):
        return None
    top_k = max(m.gate.top_k for m in model.modules() if isinstance(m, MoEBlock))
    weight = experts.w13_weight
    row = RowLayout(weight.shape[-1], top_k, weight.dtype)
    return PeerMemory(
        group.control, group.rank, PeerLayout(group.size, max_rows, row), group.device
    )


def free_address(host: str = "127.0.0.1") -> str:
    """A ``host:port`` with a port free right now, for rank 0's store."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def num_routed_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer (Qwen3-MoE: ``num_experts``, GLM-4.5: ``n_routed_experts``);
    0 for a dense model."""
    return int(
        getattr(hf_config, "n_routed_experts", None) or getattr(hf_config, "num_experts", 0) or 0
    )


def check_expert_parallel(size: int, hf_config: Any, device: torch.device) -> None:
    """A clear error when ``size`` ranks cannot hold this model here."""
    num_experts = num_routed_experts(hf_config)
    if num_experts == 0:
        raise ValueError(
            f"parallel.expert_parallel_size={size} needs a mixture-of-experts model; "
            f"{hf_config.architectures} has no routed experts"
        )
    if num_experts % size:
        raise ValueError(
            f"parallel.expert_parallel_size={size} does not divide the model's {num_experts} "
            f"routed experts; use a divisor of {num_experts}"
        )
    if device.type == "cuda":
        first = device.index or 0
        count = torch.cuda.device_count()  # the GPUs this process sees
        if first + size > count:
            raise ValueError(
                f"parallel.expert_parallel_size={size} needs GPUs {first}..{first + size - 1}, "
                f"but this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES; a serving "
                "replica sees the GPUs it was given)"
            )


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: on GPUs the one ``rank`` places after rank 0's (``cuda``
    without an index: the current one)."""
    if device.type != "cuda":
        return device
    first = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", first + rank)
