"""How each forward of the engine's steps ran: by the step's kind, whether a CUDA graph
replayed it (a whole decode or draft graph, or the piecewise graphs between attention
calls) or it ran eagerly. Served as ``splitserve_forwards_total{pool, kind, how}``: the
graph hit rate of each kind of step, per pool."""

from __future__ import annotations

from collections import Counter

KINDS = ("prefill", "mixed", "decode", "verify", "draft")  # draft: an MTP drafter pass
HOWS = ("graph", "piecewise", "eager")


class ForwardCounts:
    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, kind: str, how: str) -> None:
        if kind not in KINDS or how not in HOWS:
            raise ValueError(f"a forward of kind {kind!r} run {how!r}: not one of {KINDS} x {HOWS}")
        self._counts[kind, how] += 1

    def rows(self) -> list[list]:
        """``[[kind, how, forwards], ...]`` so far (what ``WorkerStats`` carries)."""
        return [[kind, how, n] for (kind, how), n in sorted(self._counts.items())]


def merge_rows(*rows: list[list]) -> list[list]:
    """Several engines' ``rows`` summed (an expert-parallel group's ranks)."""
    total: Counter[tuple[str, str]] = Counter()
    for one in rows:
        for kind, how, n in one:
            total[kind, how] += n
    return [[kind, how, n] for (kind, how), n in sorted(total.items())]
