"""KV transport that carries the layer data in the TCP frames themselves.

For machines without GPUs (and CI): the sender gathers a layer's tokens into
one ``[2, tokens, heads, head_dim]`` tensor (K then V) and posts its bytes in a
"layer" frame, behind the transfer's earlier frames and before its "done"; the
receiver views the bytes as that tensor and scatters it into its own slots.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.control import Peer, cache_listener, unknown_frame
from splitserve.workers.kv.transfer.framing import Connection
from splitserve.workers.kv.transfer.ticket import TransferTicket
from splitserve.workers.kv.transfer.transfers import (
    START_TIMEOUT_S,
    Incoming,
    Outgoing,
    Transfers,
)
from splitserve.workers.kv.transfer.transport import Transport


class LayerFrames:
    """Both halves of the CPU data path (``data_path.SendPath`` and ``RecvPath``)."""

    def __init__(self, kv_cache: KVCache, transfers: Transfers):
        self.kv_cache = kv_cache
        self.transfers = transfers

    # ---- send path ------------------------------------------------------------

    def connect(self, peer: Peer, ticket: TransferTicket) -> None:
        pass

    def open(self, out: Outgoing) -> None:
        pass

    def send_layer(self, out: Outgoing, layer: int) -> None:
        k, v = self.kv_cache.layer(layer)
        kv = torch.stack((_flat(k)[out.src_slots], _flat(v)[out.src_slots])).cpu()
        header = {"kind": "layer", "request_id": out.ticket.request_id, "layer": layer}
        out.peer.post(header, memoryview(kv.view(torch.uint8).numpy()).cast("B"))

    def finish(self, out: Outgoing, done: dict[str, Any]) -> None:
        out.peer.post(done)  # behind the transfer's layer frames

    def peer_lost(self, peer: Peer, error: str) -> None:
        pass

    # ---- receive path ---------------------------------------------------------

    def expect(self, inc: Incoming) -> None:
        pass

    def on_frame(self, conn: Connection, header: dict[str, Any], payload: bytearray) -> None:
        kind = header["kind"]
        if kind == "hello":  # an NCCL sender's; the announce after it ends the connection
            return
        if kind != "layer":
            raise unknown_frame(kind)
        rid = header["request_id"]
        with self.transfers.lock:
            inc = self.transfers.receiving(rid, conn)
            if inc is None:
                return  # cancelled or unknown: the bytes are already consumed
            # Under the lock: a cancel cannot free the blocks while they are written.
            self._scatter(inc, header["layer"], payload)
            inc.layers_received += 1
            if self.transfers.tracer is not None:
                at = time.perf_counter()
                self.transfers.tracer("layer_received", rid, at, layer=header["layer"])

    def settle(self, inc: Incoming, layers: int) -> str | None:
        return None  # each layer was scattered as its frame came

    def disconnected(self, conn: Connection) -> None:
        pass

    def _scatter(self, inc: Incoming, layer: int, payload: bytearray) -> None:
        layout = inc.ticket.layout
        shape = (2, inc.ticket.num_transfer_tokens, layout.num_kv_heads, layout.head_dim)
        expected = layout.bytes_per_token(1) * inc.ticket.num_transfer_tokens
        if len(payload) != expected:
            raise ConnectionError(f"layer frame has {len(payload)} bytes, expected {expected}")
        kv = torch.frombuffer(payload, dtype=layout.dtype).view(shape).to(self.kv_cache.k[0].device)
        k, v = self.kv_cache.layer(layer)
        _flat(k)[inc.dst_slots] = kv[0]
        _flat(v)[inc.dst_slots] = kv[1]


class CpuKVTransport(Transport):
    """The transport with the CPU data path (``LayerFrames``)."""

    name = "cpu"

    def __init__(
        self,
        kv_cache: KVCache,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        owner: str = "",
        auth_key: str | bytes | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        """``auth_key``: the control plane's key (``auth.py``; None: this process's);
        ``start_timeout_s``: how long an expected transfer may take to start."""
        transfers = Transfers(timeout_s, start_timeout_s)
        frames = LayerFrames(kv_cache, transfers)
        listener = cache_listener(host, kv_cache, auth_key)
        super().__init__(kv_cache, transfers, listener, frames, frames, owner)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, block_size, heads, dim]`` -> ``[slots, heads, dim]`` (a view)."""
    return cache.view(-1, *cache.shape[2:])
