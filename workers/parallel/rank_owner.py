"""How a KV ticket names the rank of an expert-parallel group that receives the KV.

A decode worker's transport writes its ``owner`` (the worker replica's id) into every
ticket; a prefill worker reaches that worker through it for the NCCL rendezvous
(``workers/kv/transfer/nccl_pairs.py``). In a group each rank has its own KV cache
and transport, so each rank's owner names the rank too: rank 0 keeps the worker's id
(a group of one reads as before), rank r > 0 is ``"{worker}/{r}"``.
"""

from __future__ import annotations

SEPARATOR = "/"


def rank_owner(worker: str, rank: int) -> str:
    """Rank ``rank``'s owner within worker ``worker`` ("" stays "": no rendezvous)."""
    return worker if rank == 0 or not worker else f"{worker}{SEPARATOR}{rank}"


def split_owner(owner: str) -> tuple[str, int]:
    """(worker id, rank) of an owner ``rank_owner`` wrote."""
    worker, sep, rank = owner.rpartition(SEPARATOR)
    if sep and rank.isdigit():
        return worker, int(rank)
    return owner, 0
