"""An expert-parallel group's load, reported as one worker's.

The router and the autoscaler see a group as one worker: its requests, queued
prompt tokens, KV blocks, transfers and MTP drafts (verified, accepted, run lengths)
are the sums over its ranks (each rank owns its own KV cache), its KV usage is that of
all its blocks. Per rank stay what only makes sense per rank: free KV blocks
(``rank_free_blocks``, a leak shows on the rank that holds it) and the tokens of each
rank's experts (``expert_tokens``, which rank 0's ``LLMEngine.expert_tokens`` fills in).
"""

from __future__ import annotations

import dataclasses
import itertools

from splitserve.workers.engine.messages import WorkerStats
from splitserve.workers.runner.forward_counts import merge_rows

SUMMED = (
    "num_running",
    "num_waiting",
    "num_waiting_for_kv",
    "num_sending_kv",
    "queued_prompt_tokens",
    "num_free_blocks",
    "num_blocks",
    "num_preemptions",
    "kv_transfers",
    "kv_late_tickets",
    "kv_transfer_bytes",
    "kv_transfer_seconds",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
)


def merge_group_stats(rank0: WorkerStats, others: list[WorkerStats]) -> WorkerStats:
    """Rank 0's stats with the other ranks' (their last reports) folded in."""
    ranks = [rank0, *others]
    sums = {key: sum(getattr(s, key) for s in ranks) for key in SUMMED}
    free, total = sums["num_free_blocks"], sums["num_blocks"]
    lengths = [s.spec_acceptance_lengths for s in ranks]
    return dataclasses.replace(
        rank0,
        **sums,
        spec_acceptance_lengths=[sum(n) for n in itertools.zip_longest(*lengths, fillvalue=0)],
        kv_usage=1.0 - free / total if total else 0.0,
        rank_free_blocks=[s.num_free_blocks for s in ranks],
        forward_counts=merge_rows(*(s.forward_counts for s in ranks)),
    )
