"""Pick a KV transport by name: "cpu", "nccl", or "auto" (NCCL when the cache is on a GPU)."""

from __future__ import annotations

from splitserve.workers.kv.cache import KVCache
from splitserve.workers.kv.transfer.base import KVTransport
from splitserve.workers.kv.transfer.cpu_transport import CpuKVTransport

TRANSPORTS = ("auto", "cpu", "nccl")


def make_kv_transport(
    kind: str,
    kv_cache: KVCache,
    host: str = "127.0.0.1",
    timeout_s: float = 60.0,
    owner: str = "",
    auth_key: str | None = None,
    **nccl_options,
) -> KVTransport:
    """The transport ``kind``; ``auth_key`` the control plane's key (``auth.py``);
    ``nccl_options`` (``rendezvous``, ``layers_per_message``,
    ``first_message_layers``, ``lanes``, ...) go to the NCCL transport only."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {kind!r}: choose one of {', '.join(TRANSPORTS)}")
    on_gpu = kv_cache.k[0].is_cuda
    if kind == "nccl" or (kind == "auto" and on_gpu):
        if not on_gpu:
            raise ValueError("the nccl KV transport needs the KV cache on a GPU (device=cuda)")
        from splitserve.workers.kv.transfer.nccl_transport import NcclKVTransport

        return NcclKVTransport(kv_cache, host, timeout_s, owner, auth_key=auth_key, **nccl_options)
    return CpuKVTransport(kv_cache, host=host, timeout_s=timeout_s, owner=owner, auth_key=auth_key)
