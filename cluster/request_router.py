"""Ray Serve request router of the worker pools: a call that names its replica goes there.

Requests do not reach the worker replicas through Ray (the ingress streams from
their engine processes directly; ``cluster/worker_directory.py`` ranks them).
What does is the NCCL rendezvous: a prefill worker's replica calls
``nccl_join(NcclJoinCall)`` on the decode replica named in the KV ticket, and
this router sends it to exactly that replica (none: the call waits for it).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class PoolRequestRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = getattr(_request_of(pending_request), "worker", None)
        if target:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [pinned] if pinned else []
        return [candidate_replicas]


def _request_of(pending_request: PendingRequest | None) -> object:
    """The call's message (``workers/engine/messages.py``), or None."""
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]
