"""A worker replica of one pool (prefill, decode or mixed): an engine behind Ray Serve.

Calls take a plain request dict: ``request_id``, ``prompt_token_ids``,
``params`` (SamplingParams fields) and, by call:

- ``generate`` (streaming): ``remote`` (decode side of a disaggregated request)
  and ``local_prefix_ratio``; yields ``Route``, ticket and delta outputs.
- ``prefill``: ``kv_ticket`` from a decode worker; returns once the decode
  worker has the KV (``{"ok": True}``) or with ``{"ok": False, "error": ...}``.

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
from splitserve.errors import InvalidRequestError
from splitserve.sampling_params import SamplingParams
from splitserve.workers.engine.async_engine import AsyncEngine, Route

logger = logging.getLogger(__name__)


class EngineWorker:
    def __init__(self, pool: str, engine_config: dict, stats_period_s: float, namespace: str):
        from splitserve.cluster.stats_board import get_or_create_board

        self.pool = pool
        self.worker_id = serve.get_replica_context().replica_id.unique_id
        config = EngineConfig.from_dict({**engine_config, "role": pool})
        if config.kv_transfer.host == "127.0.0.1" and ray.is_initialized():
            config.kv_transfer.host = ray.util.get_node_ip_address()
        options = {"owner": self.worker_id} if pool != "mixed" else {}
        if pool == "prefill" and config.kv_transfer.transport != "cpu":
            options["rendezvous"] = _nccl_rendezvous(serve.get_replica_context().app_name)
        self.engine = AsyncEngine(config, **options)
        self._board = get_or_create_board(namespace)
        self._stats_period_s = stats_period_s
        self._reporter = asyncio.get_event_loop().create_task(self._report_loop())

    async def generate(self, request: dict) -> AsyncIterator:
        params = SamplingParams(**request["params"])
        stream = self.engine.generate(
            request["request_id"],
            request["prompt_token_ids"],
            params,
            remote=request.get("remote", False),
            local_prefix_ratio=request.get("local_prefix_ratio"),
        )
        try:
            async for item in stream:
                yield _wire(item)
        except InvalidRequestError as e:
            yield {"error": str(e)}  # the request was rejected: the ingress answers 400
        finally:
            await stream.aclose()

    async def prefill(self, request: dict) -> dict:
        params = SamplingParams(**request["params"])
        stream = self.engine.generate(
            request["request_id"],
            request["prompt_token_ids"],
            params,
            kv_ticket=request["kv_ticket"],
        )
        try:
            async for output in stream:
                if output.finished:
                    return {"ok": output.error is None, "error": output.error}
        except InvalidRequestError as e:
            return {"ok": False, "error": str(e)}
        finally:
            await stream.aclose()
        return {"ok": False, "error": "the prefill ended without a result"}

    async def nccl_join(self, request: dict) -> dict:
        """Decode side of the NCCL rendezvous: join the pair's communicator as rank 1."""
        transport = self.engine.engine.kv_transport
        await asyncio.get_running_loop().run_in_executor(
            None, transport.join, request["pair"], request["unique_id"]
        )
        return {"ok": True}

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
            raise RuntimeError(f"engine loop stopped: {self.engine.error}")

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


def _wire(item) -> dict:
    """What crosses Ray: a route, a ticket, or a delta output."""
    if isinstance(item, Route):
        return {"route": item.name}
    if item.kv_ticket is not None:
        return {"kv_ticket": item.kv_ticket}
    return {"output": item}


def _nccl_rendezvous(app_name: str):
    """Ask the decode replica named in the ticket to join the pair's communicator."""

    def rendezvous(ticket, pair_key: str, unique_id: bytes):
        handle = serve.get_deployment_handle("decode", app_name=app_name)
        request = {"worker": ticket.owner, "pair": pair_key, "unique_id": unique_id}
        return handle.nccl_join.remote(request).result(timeout_s=60)

    return rendezvous
