"""A worker replica of one pool (prefill, decode or mixed): an engine behind Ray Serve.

Ray Serve places, scales, health-checks and replaces the replica; the engine runs
in a process of its own (``workers/engine/engine_client.py``) that owns the device.
Requests do not pass through the replica: ingress replicas connect to the engine
process's address (posted on the stats board with the replica's load) and stream
from it directly. The replica keeps the engine's control side:

- ``nccl_join(NcclJoinCall)``: the decode side of a prefill worker's rendezvous
  (a prefill engine asks its replica, which calls the decode replica named in the
  ticket through Ray Serve).
- its load, posted to the stats board (routing, ``/metrics``, and the autoscaling
  policy, which reads it there);
- ``check_health``: unhealthy once the engine process is gone, or when it made no
  progress for ``watchdog_timeout_s`` (no stats, or no step while holding requests:
  a hung process), so Ray Serve replaces the replica; a loop that its process's
  heartbeats show inside one long step gets ``step_timeout_s``.
- leaving (scale-down, shutdown; Ray Serve calls ``__del__``): the engine drains
  (fronts stop choosing it, it finishes what it holds) for up to
  ``drain_timeout_s``, then stops; requests still open end with "shutting down".
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray import serve

from splitserve.config import EngineConfig
from splitserve.workers.engine.engine_client import EngineClient
from splitserve.workers.engine.messages import NcclJoinCall
from splitserve.workers.parallel.rank_owner import split_owner

logger = logging.getLogger(__name__)


class EngineWorker:
    def __init__(
        self,
        pool: str,
        engine_config: dict,
        stats_period_s: float,
        namespace: str,
        secret: str,
        max_requests: int,
        watchdog_timeout_s: float = 10.0,
        drain_timeout_s: float = 30.0,
        step_timeout_s: float = 300.0,
    ):
        """``secret``: what an ingress's connection must present; ``max_requests``: open
        requests beyond this are answered ``Overloaded`` (the pool's max_ongoing_requests);
        ``watchdog_timeout_s``: the engine's progress watchdog (``step_timeout_s`` for
        one step its heartbeats show running); ``drain_timeout_s``: how long a leaving
        replica lets its engine finish what it holds."""
        from splitserve.cluster.stats_board import get_or_create_board

        self.pool = pool
        self._watchdog_timeout_s = watchdog_timeout_s
        self._step_timeout_s = step_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        config = EngineConfig.from_dict({**engine_config, "role": pool})
        # One node: the KV control plane stays on loopback; several: the node's address
        # (every connection must still prove the application's key, kv_transfer.auth_key).
        multi_node = ray.is_initialized() and sum(n["Alive"] for n in ray.nodes()) > 1
        if config.kv_transfer.host == "127.0.0.1" and multi_node:
            config.kv_transfer.host = ray.util.get_node_ip_address()
        rendezvous = None
        if pool == "prefill" and config.kv_transfer.transport != "cpu":
            rendezvous = _nccl_rendezvous(serve.get_replica_context().app_name)
        owner = self.worker_id if pool != "mixed" else ""
        self.engine = EngineClient(
            config,
            owner=owner,
            rendezvous=rendezvous,
            front_host=config.kv_transfer.host,
            secret=secret,
            max_requests=max_requests,
        )
        self._board = get_or_create_board(namespace)
        self._stats_period_s = stats_period_s
        self._reporter = asyncio.get_event_loop().create_task(self._report_loop())

    async def nccl_join(self, call: NcclJoinCall) -> bool:
        self.engine.join(call.pair_key, call.unique_id, call.rank)
        return True

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError(f"the engine stopped: {self.engine.error}")
        stalled = self.engine.stalled(self._watchdog_timeout_s, self._step_timeout_s)
        if stalled is not None:
            raise RuntimeError(f"the engine process {self.engine.pid} {stalled}")

    async def _report_loop(self) -> None:
        while True:
            try:
                self._board.post.remote(self.worker_id, self.pool, self.engine.stats.as_dict())
            except Exception:  # the board restarts with the app; keep serving meanwhile
                logger.warning("could not post stats", exc_info=True)
            await asyncio.sleep(self._stats_period_s)

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown: drain the engine, then stop it."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        engine.drain()
        deadline = time.monotonic() + self._drain_timeout_s
        while engine.alive and time.monotonic() < deadline and not self._hung():
            if engine.stats.draining and not engine.holds_requests:
                break
            await asyncio.sleep(0.1)
        if engine.alive and self._hung():  # SIGSTOPped or wedged: it would not stop either
            logger.warning("the %s worker's engine is hung; killing it", self.pool)
            await asyncio.to_thread(engine.shutdown, 0.0)
            return
        if engine.holds_requests:
            logger.warning("the %s worker stops with requests still open", self.pool)
        await asyncio.to_thread(engine.shutdown)

    def _hung(self) -> bool:
        return self.engine.stalled(self._watchdog_timeout_s, self._step_timeout_s) is not None


def _nccl_rendezvous(app_name: str):
    """Ask the decode replica named in the ticket to join the pair's communicator (with the
    rank of its expert-parallel group that the ticket names)."""

    def rendezvous(owner: str, pair_key: str, unique_id: bytes) -> None:
        worker, rank = split_owner(owner)
        handle = serve.get_deployment_handle("decode", app_name=app_name)
        call = NcclJoinCall(worker, pair_key, unique_id, rank)
        handle.nccl_join.remote(call).result(timeout_s=60)

    return rendezvous
