"""KV transport that carries the layer data in the TCP frames themselves.

For machines without GPUs (and CI): the sender gathers a layer's tokens into
one ``[2, tokens, heads, head_dim]`` tensor (K then V) and posts its bytes; the
receiver views the bytes as that tensor and scatters it into its own slots.
"""

from __future__ import annotations

from typing import Any

import torch

from splitserve.workers.kv.transfer.base import Incoming, KVTransport, Outgoing


class CpuKVTransport(KVTransport):
    name = "cpu"

    def _send_layer_data(self, out: Outgoing, header: dict[str, Any]) -> None:
        k, v = self.kv_cache.layer(header["layer"])
        kv = torch.stack((_flat(k)[out.src_slots], _flat(v)[out.src_slots])).cpu()
        out.peer.post(header, memoryview(kv.view(torch.uint8).numpy()).cast("B"))

    def _recv_layer_data(self, inc: Incoming | None, header: dict, payload: bytearray) -> None:
        if inc is None:
            return  # cancelled or unknown: the bytes are already consumed
        layout = inc.ticket.layout
        shape = (2, inc.ticket.num_transfer_tokens, layout.num_kv_heads, layout.head_dim)
        expected = layout.bytes_per_token(1) * inc.ticket.num_transfer_tokens
        if len(payload) != expected:
            raise ConnectionError(f"layer frame has {len(payload)} bytes, expected {expected}")
        kv = torch.frombuffer(payload, dtype=layout.dtype).view(shape).to(self.device)
        k, v = self.kv_cache.layer(header["layer"])
        _flat(k)[inc.dst_slots] = kv[0]
        _flat(v)[inc.dst_slots] = kv[1]


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, block_size, heads, dim]`` -> ``[slots, heads, dim]`` (a view)."""
    return cache.view(-1, *cache.shape[2:])
