"""GPU memory the ranks of an expert-parallel group on one host read from each other.

Each rank allocates one buffer and shares it through CUDA IPC: the handles go around
the group's ``control`` (gloo) group once, at start-up, and every rank opens the
others'. DECODE-mode dispatch and combine then skip NCCL (``dispatch.py``;
kernels: ``kernels/triton/ep_peer.py``):

1. ``send``: a rank writes the rows it sends each rank into its own send rows (rank
   ``d``'s at ``d * C ..``, as the all-to-all's buffer) and how many there are;
2. ``pull_rows``: a device-side barrier, then each rank reads its rows out of every
   rank's send rows;
3. its experts run; ``put_parts`` copies their partial sums into its own buffer;
4. ``sum_parts``: a second barrier, then each rank reads its tokens' parts out of
   every rank's buffer and adds them.

A rank writes only into its own buffer, and the two barriers keep every read between
the write before it and the write after it: a rank overwrites its send rows (its
parts) only after a barrier the others reach once their reads of them are done.

A buffer: ``[flags: N int64][counts: N int32][send rows: N * rows x row bytes][parts:
N * rows x hidden float32]``, each part 256-byte aligned (``PeerLayout``). ``rows``
bounds the capacity that goes this way (the engine passes its largest decode batch,
drafts included); a larger DECODE step swaps over NCCL, as every rank decides from the
capacity alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from splitserve.kernels.ep_rows import PeerOffsets, RowLayout

ALIGN = 256  # bytes


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class PeerLayout:
    """Where the parts of every rank's buffer start (the same on every rank)."""

    ranks: int
    rows: int  # rows a rank may send each rank
    row: RowLayout  # the widest row sent

    @property
    def offsets(self) -> PeerOffsets:
        counts = _aligned(8 * self.ranks)
        send = counts + _aligned(4 * self.ranks)
        parts = send + _aligned(self.ranks * self.rows * self.row.bytes)
        return PeerOffsets(flags=0, counts=counts, send=send, parts=parts)

    @property
    def nbytes(self) -> int:
        return self.offsets.parts + _aligned(self.ranks * self.rows * self.row.hidden * 4)

    def holds(self, capacity: int, row: RowLayout) -> bool:
        """Whether a step of ``capacity`` rows of ``row`` fits the buffer."""
        fits = row.bytes <= self.row.bytes and row.hidden <= self.row.hidden
        return 1 <= capacity <= self.rows and fits


def peers_reachable(control: Any, rank: int, size: int, device: torch.device) -> bool:
    """Whether every rank can read every other rank's GPU (each rank asks for its own
    device; the group learns the answer of all: every rank decides the same)."""
    first = device.index if device.index is not None else torch.cuda.current_device()
    rank_devices = range(first - rank, first - rank + size)
    mine = all(d == first or torch.cuda.can_device_access_peer(first, d) for d in rank_devices)
    try:
        import cupy  # noqa: F401
    except ImportError:
        mine = False
    answers = [torch.zeros(1, dtype=torch.int32) for _ in range(size)]
    control.allgather([answers], [torch.tensor([int(mine)], dtype=torch.int32)]).wait()
    return all(int(a) for a in answers)


class PeerMemory:
    """This rank's buffer, the addresses of every rank's, and the barrier over them."""

    def __init__(self, control: Any, rank: int, layout: PeerLayout, device: torch.device):
        import cupy

        self.rank, self.layout, self.device = rank, layout, device
        self.offsets = layout.offsets
        index = device.index if device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(index):
            self._memory = cupy.cuda.memory.Memory(layout.nbytes)
            cupy.cuda.runtime.memset(self._memory.ptr, 0, layout.nbytes)  # flags at 0
            cupy.cuda.runtime.deviceSynchronize()
            handle = cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr)
            handles = _all_gather_bytes(control, layout.ranks, handle)
            self._opened = {
                r: cupy.cuda.runtime.ipcOpenMemHandle(h) for r, h in enumerate(handles) if r != rank
            }
        addresses = [self._opened.get(r, self._memory.ptr) for r in range(layout.ranks)]
        self.bases = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # barrier epochs
        mem = cupy.cuda.MemoryPointer(self._memory, 0)
        whole = cupy.ndarray((layout.nbytes,), dtype=cupy.uint8, memptr=mem)
        self._buffer = torch.as_tensor(whole, device=device)
        control.barrier().wait()  # every rank opened every buffer before any barrier runs

    def send(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        experts_per_rank: int,
        capacity: int,
    ) -> torch.Tensor:
        """Write this rank's send rows and their counts; ``row [T, N]``
        (``ep_rows.send_rows``)."""
        row = RowLayout(hidden.shape[-1], topk_ids.shape[-1], hidden.dtype)
        start, count = self.offsets.send, self.layout.ranks * capacity
        send = self._buffer[start : start + count * row.bytes].view(count, row.bytes)
        counts = self._buffer[self.offsets.counts :][: 4 * self.layout.ranks].view(torch.int32)
        return _kernels().send_rows(
            send, counts, hidden, topk_ids, topk_weights, slot_mapping,
            experts_per_rank, capacity,
        )  # fmt: skip

    def pull_rows(self, capacity: int, row: RowLayout) -> torch.Tensor:
        """After a barrier: the ``[N * C, row bytes]`` rows every rank sent this rank."""
        _kernels().barrier(self.bases, self.counter, self.rank, self.offsets)
        return _kernels().pull_rows(self.bases, self.rank, capacity, self.offsets, row)

    def put_parts(self, parts: torch.Tensor) -> None:
        """Copy the experts' float32 sums (``[N * C, hidden]``) into this rank's parts."""
        start = self.offsets.parts
        flat = self._buffer[start : start + parts.numel() * 4].view(torch.float32)
        flat.view_as(parts).copy_(parts)

    def sum_parts(
        self, row: torch.Tensor, capacity: int, hidden: int, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """After a barrier: each of this rank's tokens' parts from every rank, summed."""
        _kernels().barrier(self.bases, self.counter, self.rank, self.offsets)
        return _kernels().sum_peer_parts(
            self.bases, row, self.rank, capacity, self.offsets, hidden, out_dtype
        )

    def close(self) -> None:
        import cupy

        torch.cuda.synchronize(self.device)
        for address in self._opened.values():
            cupy.cuda.runtime.ipcCloseMemHandle(address)
        self._opened = {}


def _all_gather_bytes(control: Any, size: int, data: bytes) -> list[bytes]:
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(size)]
    control.allgather([every], [mine]).wait()
    return [bytes(t.tolist()) for t in every]


def _kernels():
    from splitserve.kernels.triton import ep_peer

    return ep_peer
