"""Gather and scatter between a transfer's cache slots and a flat staging buffer.

Each side of an NCCL transfer stages its messages in a ring of ``RING`` buffers,
each as large as the plan's largest message: the sender gathers message i's
layers into buffer ``i % RING`` and sends from it, the receiver receives into it
and scatters out of it, and message i + 2 reuses it once message i's send (or
scatter) is done. A layer lies in a buffer token-major, ``[2, tokens, kv_heads,
head_dim]`` (``kernels/kv_gather.py``), so the two sides may use different
block sizes.

``Copier.bind`` ties a transfer's slots and staging to a stream once, at set-up;
a gather or scatter then takes a layer range and a byte offset, one kernel launch
with the fused kernel (``kernels/kv_gather_cuda.py``), or torch index ops.
"""

from __future__ import annotations

import torch

from splitserve.kernels.kv_gather import gather_kv, scatter_kv
from splitserve.kernels.kv_gather_cuda import KVCopyLaunch, KVGatherKernel
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.ticket import TransferTicket

RING = 2  # staging buffers per transfer and side: message i reuses i - 2's


def ring_size(plan: list[tuple[int, int]], layer_bytes: int) -> tuple[int, int]:
    """(bytes, count) of the ring buffers for a non-empty plan: the largest message's
    bytes, and at most ``RING`` of them."""
    return max(layers for _, layers in plan) * layer_bytes, min(RING, len(plan))


class Copier:
    """Gathers and scatters of one KV cache, with the fused kernel where it built."""

    def __init__(self, kv_cache: KVCache, fused_copy: bool = True):
        self.kv_cache = kv_cache
        self.device = kv_cache.k[0].device
        self.kernel = KVGatherKernel.build(kv_cache.k, kv_cache.v)  # None: not here
        self._fused_copy = fused_copy and self.kernel is not None

    @property
    def fused_copy(self) -> bool:
        """Gather and scatter with the fused kernel (else torch index ops, ``kv_gather.py``).

        Only the fused scatter reads a ``live`` flag: with torch copies, a receiver that
        drops a transfer waits for its scatters (so for the sender's bytes)."""
        return self._fused_copy

    @fused_copy.setter
    def fused_copy(self, fused: bool) -> None:
        if fused and self.kernel is None:
            raise ValueError("the fused KV copy kernel did not build here (see the log)")
        self._fused_copy = fused

    def bytes(self, nbytes: int) -> torch.Tensor:
        """An uninitialised staging buffer on the current stream."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def bind(
        self,
        slots: torch.Tensor,
        staging: torch.Tensor,
        stream: torch.cuda.Stream,
        ticket: TransferTicket,
        live: torch.Tensor | None = None,
    ) -> KVCopyLaunch | TorchCopy:
        """Gathers or scatters between ``slots`` and ``staging`` on ``stream``: the fused
        launch while ``fused_copy`` (scatters skipped once ``live`` holds 0), else torch
        copies (which take no ``live`` flag)."""
        if self.fused_copy:
            return self.kernel.bind(slots, staging, stream, live)
        return TorchCopy(self, slots, staging, stream, ticket)

    def gather(
        self,
        first: int,
        slots: torch.Tensor,
        out: torch.Tensor,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """``out[j] = (K, V)[slots]`` of layer ``first + j`` (``[layers, 2, tokens, heads,
        head_dim]``), on ``stream`` (default: the current stream)."""
        if self.fused_copy:
            self.kernel.gather(first, slots, out, stream)
            return
        with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
            gather_kv(self.kv_cache.k, self.kv_cache.v, first, slots, out)

    def scatter(
        self,
        first: int,
        slots: torch.Tensor,
        kv: torch.Tensor,
        live: torch.Tensor | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """The inverse; with the fused kernel, nothing once ``live`` holds 0."""
        if self.fused_copy:
            self.kernel.scatter(first, slots, kv, live, stream)
        elif live is not None:
            raise ValueError("a live flag needs the fused KV copy kernel")
        else:
            with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
                scatter_kv(self.kv_cache.k, self.kv_cache.v, first, slots, kv)


class TorchCopy:
    """``KVCopyLaunch``'s gather and scatter through ``Copier.gather`` / ``scatter`` on
    views of the staging buffer."""

    def __init__(
        self,
        copier: Copier,
        slots: torch.Tensor,
        staging: torch.Tensor,
        stream: torch.cuda.Stream,
        ticket: TransferTicket,
    ):
        self.copier, self.slots, self.staging, self.stream = copier, slots, staging, stream
        self.ticket = ticket

    def gather(self, first: int, layers: int, offset: int = 0) -> None:
        """Layers ``first .. first + layers - 1`` into the buffer from byte ``offset``."""
        kv = kv_view(self.staging[offset:], layers, self.ticket)
        self.copier.gather(first, self.slots, kv, self.stream)

    def scatter(self, first: int, layers: int, offset: int = 0) -> None:
        """The buffer from byte ``offset`` into layers ``first ..``."""
        kv = kv_view(self.staging[offset:], layers, self.ticket)
        self.copier.scatter(first, self.slots, kv, None, self.stream)


def kv_view(buf: torch.Tensor, layers: int, ticket: TransferTicket) -> torch.Tensor:
    """The start of flat ``buf`` as ``layers`` layers of the ticket's transfer."""
    lay = ticket.layout
    shape = (layers, 2, ticket.num_transfer_tokens, lay.num_kv_heads, lay.head_dim)
    n = torch.Size(shape).numel() * lay.dtype.itemsize
    return buf[:n].view(lay.dtype).view(shape)
