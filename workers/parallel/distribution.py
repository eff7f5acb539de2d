"""Which rank of an expert-parallel group computes a request: the least loaded.

A rank's load is the number of its requests that have not finished; a new request
goes to the rank with the fewest, the lowest rank on a tie (so a single request
runs on rank 0 and the other ranks idle). Rank 0 places every request: its own load
it reads from its scheduler, the other ranks' it keeps here, hearing of every
finish and abort.
"""

from __future__ import annotations


class LeastLoaded:
    def __init__(self, size: int):
        self.load = [0] * size  # rank 0's entry unused: it is passed in
        self.rank_of: dict[str, int] = {}  # requests on ranks 1..N-1

    def place(self, request_id: str, rank0_load: int) -> int:
        loads = [rank0_load, *self.load[1:]]
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        if rank != 0:
            self.load[rank] += 1
            self.rank_of[request_id] = rank
        return rank

    def finished(self, request_id: str) -> None:
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            self.load[rank] -= 1
