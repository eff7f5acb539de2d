"""A worker replica of one pool (prefill, decode or mixed): an engine behind Ray Serve.

The replica is an asyncio front; its engine runs in a process of its own
(``workers/engine/engine_client.py``), so the replica's event loop never waits
on the model and the engine never waits on the replica. Calls and events are
the typed messages of ``workers/engine/messages.py``:

- ``generate(GenerateCall)`` (streaming): yields lists of the request's events
  (``Routed``, ``TicketIssued``, ``Delta``, ``Rejected``, ``Failed``), as many
  as piled up since the last item, so a slow consumer takes several steps at
  once instead of one Ray item per token.
- ``prefill(GenerateCall with kv_ticket)``: returns the request's last event
  once the decode worker has the KV (a ``Delta`` finished "transferred"), or
  why not (``Rejected``, ``Failed``, a ``Delta`` with an error).
- ``nccl_join(NcclJoinCall)``: the decode side of a prefill worker's rendezvous.

Each replica posts its load to the stats board and reports it to Ray Serve
for routing (``record_routing_stats``) and autoscaling
(``record_autoscaling_stats``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import ray
from ray import serve

from splitserve.config import EngineConfig
from splitserve.workers.engine.engine_client import EngineClient
from splitserve.workers.engine.messages import (
    Event,
    Failed,
    GenerateCall,
    NcclJoinCall,
)

logger = logging.getLogger(__name__)


class EngineWorker:
    def __init__(self, pool: str, engine_config: dict, stats_period_s: float, namespace: str):
        from splitserve.cluster.stats_board import get_or_create_board

        self.pool = pool
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        config = EngineConfig.from_dict({**engine_config, "role": pool})
        if config.kv_transfer.host == "127.0.0.1" and ray.is_initialized():
            config.kv_transfer.host = ray.util.get_node_ip_address()
        rendezvous = None
        if pool == "prefill" and config.kv_transfer.transport != "cpu":
            rendezvous = _nccl_rendezvous(serve.get_replica_context().app_name)
        owner = self.worker_id if pool != "mixed" else ""
        self.engine = EngineClient(config, owner=owner, rendezvous=rendezvous)
        self._board = get_or_create_board(namespace)
        self._stats_period_s = stats_period_s
        self._reporter = asyncio.get_event_loop().create_task(self._report_loop())

    async def generate(self, call: GenerateCall) -> AsyncIterator[list[Event]]:
        async for events in self.engine.generate(call):
            yield events

    async def prefill(self, call: GenerateCall) -> Event:
        async for events in self.engine.generate(call):
            last = events[-1]
            if getattr(last, "finished", True):
                return last
        return Failed(call.request_id, "the prefill ended without a result")

    async def nccl_join(self, call: NcclJoinCall) -> bool:
        self.engine.join(call.pair_key, call.unique_id)
        return True

    def record_routing_stats(self) -> dict:
        return self.engine.stats.as_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        s = self.engine.stats
        return {
            "queued_prompt_tokens": float(s.queued_prompt_tokens),
            "running_requests": float(s.num_running + s.num_waiting_for_kv),
            "kv_usage": float(s.kv_usage),
        }

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError(f"the engine stopped: {self.engine.error}")

    async def _report_loop(self) -> None:
        while True:
            try:
                self._board.post.remote(self.worker_id, self.pool, self.engine.stats.as_dict())
            except Exception:  # the board restarts with the app; keep serving meanwhile
                logger.warning("could not post stats", exc_info=True)
            await asyncio.sleep(self._stats_period_s)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _nccl_rendezvous(app_name: str):
    """Ask the decode replica named in the ticket to join the pair's communicator."""

    def rendezvous(owner: str, pair_key: str, unique_id: bytes) -> None:
        handle = serve.get_deployment_handle("decode", app_name=app_name)
        handle.nccl_join.remote(NcclJoinCall(owner, pair_key, unique_id)).result(timeout_s=60)

    return rendezvous
