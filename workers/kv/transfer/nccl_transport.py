"""KV transport over NCCL: a pair of workers (prefill sender, decode receiver) is linked by
2-rank communicators, its lanes (``nccl_pair.Pair``; ``lanes``, two by default).

The control frames (hello, announce, done, ack, cancel) travel over the control
plane's TCP connection (``control.py``); the KV bytes travel over NCCL, one
message per group of layers (``nccl_pair.message_plan``; a message holds at most
``max_message_bytes``, 128 MiB by default, unless one layer is larger), the
messages alternating between the lanes. A transfer sends no frame per layer:
its "announce" frame, written at ``start_send`` (before the prefill computes),
carries its message plan, and the receiver queues every receive and scatter of
the transfer at once. The layers then flow with no CPU work on the receiver.

One transfer (per side, a ring of two staging buffers; CUDA events order them; the
receiver's ring belongs to the pair and is kept from one transfer to the next, its
first receives waiting for the receives and scatters of the transfer before)::

    sender                                       receiver
    start_send: "announce" {plan}   -- TCP -->   for each message i:
                                                   recv i   (lane i % 2; waits scatter i-2)
                                                   scatter i (copy stream; waits recv i)
    send_layer(l), l in message i:
      gather l  (copy stream, into i's buffer;
                 waits the compute stream, and send i-2 for i's first layer)
      send i    (lane i % 2; once i's layers are gathered, waits those gathers)
    finish_send: "done" {layers}    -- TCP -->   wait for the last scatter, "ack"

The parts, each in its module: ``NcclPairs`` makes, finds and aborts the pairs
(the rendezvous, the warm-up, failure: ``nccl_pairs.py``); ``NcclSendPath``
gathers and sends in announce order, with filler for a transfer that ends early
(``nccl_send.py``); ``NcclRecvPath`` queues the receives and scatters, and drops
a transfer through its ``live`` flag (``nccl_recv.py``); ``Copier`` binds the
gathers and scatters to a transfer's staging ring (``copier.py``); ``EventPool``
hands out the CUDA events that order them (``event_pool.py``).
"""

from __future__ import annotations

try:
    import cupy  # noqa: F401  (the parts below need it)
except ImportError as e:  # pragma: no cover - machines without cupy
    raise ImportError(
        "the nccl KV transport needs cupy with NCCL (cupy-cuda12x or cupy-cuda13x)"
    ) from e

import torch

from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.control import cache_listener
from splitserve.workers.kv.transfer.copier import Copier
from splitserve.workers.kv.transfer.event_pool import EventPool
from splitserve.workers.kv.transfer.nccl_pair import NcclOptions, cap_ctas
from splitserve.workers.kv.transfer.nccl_pairs import NcclPairs, Rendezvous
from splitserve.workers.kv.transfer.nccl_recv import NcclRecvPath
from splitserve.workers.kv.transfer.nccl_send import NcclSendPath
from splitserve.workers.kv.transfer.transfers import Transfers
from splitserve.workers.kv.transfer.transport import Transport


class NcclKVTransport(Transport):
    """The transport with the NCCL data path. ``options`` (``NcclOptions``) holds the
    settings, ``copier.fused_copy`` picks the gather/scatter kernels."""

    name = "nccl"

    def __init__(
        self,
        kv_cache: KVCache,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        owner: str = "",
        rendezvous: Rendezvous | None = None,
        layers_per_message: int = 8,
        fused_copy: bool = True,
        first_message_layers: int = 1,
        lanes: int = 2,
        max_message_bytes: int | None = 128 << 20,
        auth_key: str | bytes | None = None,
        max_ctas: int | None = None,
    ):
        self.options = NcclOptions(
            layers_per_message, first_message_layers, max_message_bytes, lanes, max_ctas=max_ctas
        )
        self.options.check()
        cap_ctas(self.options.max_ctas)  # before any communicator: NCCL reads it once
        transfers = Transfers(timeout_s)
        listener = cache_listener(host, kv_cache, auth_key)
        device = kv_cache.k[0].device
        name = owner or listener.address
        self.pairs = NcclPairs(device, name, self.options, timeout_s, rendezvous)
        self.copier = Copier(kv_cache, fused_copy)
        flag_stream = torch.cuda.Stream(device)  # live flags: never waits on others
        self.cuda_events = EventPool(flag_stream, ready=64)
        parts = (transfers, self.pairs, self.copier, self.cuda_events)
        send_path = NcclSendPath(*parts, kv_cache.layout, self.options)
        recv_path = NcclRecvPath(*parts, flag_stream)
        super().__init__(kv_cache, transfers, listener, send_path, recv_path, owner)

    def join(self, pair_key: str, unique_id: bytes) -> None:
        """Become rank 1 of the sender's pair ``pair_key`` (``NcclPairs.join``); returns
        at once."""
        self.pairs.join(pair_key, unique_id)

    def close(self) -> None:
        super().close()
        self.pairs.close()
