"""Ray Serve request router of the worker pools: pinned calls, then least loaded.

A call whose message names a ``worker`` (a replica id; ``NcclJoinCall``) goes
to that replica: prefill workers reach a decode worker so for the NCCL
rendezvous. Other calls go to the replica with the lowest cost
(``cluster.routing``) from the stats each replica reports
(``record_routing_stats``), plus what this router sent since.
"""

from __future__ import annotations

from collections import defaultdict

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from splitserve.cluster.routing import RouterConfig, WorkerLoad, decode_cost, prefill_cost


class PoolRequestRouter(RequestRouter):
    def initialize_state(self, pool: str = "decode", router: dict | None = None) -> None:
        self.pool = pool
        self.config = RouterConfig(**(router or {}))
        self._pending: dict[str, int] = defaultdict(int)  # replica -> routed, not completed
        self._routed: dict[str, tuple[str, int]] = {}  # internal request id -> (replica, weight)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = _request_of(pending_request)
        target = getattr(request, "worker", None)
        if target:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [pinned] if pinned else []
        ranked = sorted(candidate_replicas, key=self._cost)
        return [[r] for r in ranked]

    def _cost(self, replica: RunningReplica) -> tuple:
        load = WorkerLoad.from_stats(replica.routing_stats)
        pending = self._pending[replica.replica_id.unique_id]
        if self.pool == "prefill":
            return prefill_cost(load, pending)
        return decode_cost(self.config, load, pending)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        request = _request_of(pending_request)
        weight = len(getattr(request, "prompt_token_ids", ())) if self.pool == "prefill" else 1
        self._pending[replica_id.unique_id] += weight
        self._routed[pending_request.metadata.internal_request_id] = (replica_id.unique_id, weight)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        replica, weight = self._routed.pop(internal_request_id, (None, 0))
        if replica is not None:
            self._pending[replica] = max(0, self._pending[replica] - weight)


def _request_of(pending_request: PendingRequest | None) -> object:
    """The call's message (``workers/engine/messages.py``), or None."""
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]
