"""Prepare inputs: turn the scheduled requests of one step into a ForwardBatch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.scheduler.block_manager import NULL_BLOCK
from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.kv.cache import KVCache
from splitserve.workers.runner.forward_batch import ForwardBatch
from splitserve.workers.runner.step_plan import plan_forward


@dataclass
class StepRequest:
    """One request's part of a step."""

    new_token_ids: list[int]  # tokens whose KV this step computes
    num_computed: int  # tokens already in the KV cache
    block_ids: list[int]  # the request's block table
    sample: bool  # whether this step ends the known tokens and yields logits
    num_drafts: int = 0  # of ``new_token_ids``, the trailing drafts the step verifies


def build_forward_batch(
    requests: list[StepRequest],
    kv_cache: KVCache,
    attn_backend: AttentionBackend,
    device: torch.device | str,
    plan: bool = True,
) -> ForwardBatch:
    """Pack the step's requests; ``plan=False`` leaves planning the step (the attention
    backend's plan and the step's fusions: ``step_plan.plan_forward``) to the caller (a
    CUDA-graph runner plans its padded batch instead)."""
    block_size = kv_cache.block_size
    query_lens = [len(r.new_token_ids) for r in requests]
    seq_lens = [r.num_computed + q for r, q in zip(requests, query_lens)]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    logits_indices = [end - 1 for r, end in zip(requests, cu[1:]) if r.sample]
    tables = padded_block_tables([r.block_ids for r in requests])
    max_blocks = tables.shape[1]
    positions = np.concatenate(
        [np.arange(r.num_computed, s, dtype=np.int64) for r, s in zip(requests, seq_lens)]
    )
    request_of = np.repeat(np.arange(len(requests)), query_lens)
    slots = tables[request_of, positions // block_size] * block_size + positions % block_size
    # One host tensor, one copy to the device; every field is a view of it.
    fields = [
        np.fromiter(_token_ids(requests), dtype=np.int64, count=cu[-1]),
        positions,
        slots,
        np.asarray(logits_indices, dtype=np.int64),
        np.asarray(cu, dtype=np.int64),
        np.asarray(seq_lens, dtype=np.int64),
        tables.reshape(-1),
    ]
    # Not blocking: the device may still run the previous step (async scheduling); the
    # driver stages pageable memory before the call returns.
    packed = torch.from_numpy(np.concatenate(fields)).to(device, non_blocking=True)
    ids, pos, slot_mapping, logits, query_start_loc, seq_lens_t, flat_tables = packed.split(
        [len(f) for f in fields]
    )
    fb = ForwardBatch(
        phase=ForwardBatch.phase_of(
            query_lens, [r.num_computed for r in requests], [r.num_drafts for r in requests]
        ),
        input_ids=ids,
        positions=pos,
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        seq_lens_tensor=seq_lens_t,
        block_tables=flat_tables.view(len(requests), max_blocks),
        block_ids=[r.block_ids for r in requests],
        slot_mapping=slot_mapping,
        logits_indices=logits,
        kv_cache=kv_cache,
        attn_backend=attn_backend,
        logits_rows=consecutive(logits_indices),
    )
    if plan:
        plan_forward(fb)
    return fb


def padded_block_tables(block_ids: list[list[int]], dtype=np.int64) -> np.ndarray:
    """``[batch, longest]`` block tables on the host, short rows padded with the null page."""
    tables = np.full((len(block_ids), max(map(len, block_ids))), NULL_BLOCK, dtype=dtype)
    for row, blocks in zip(tables, block_ids):
        row[: len(blocks)] = blocks
    return tables


def consecutive(values: list[int]) -> slice | None:
    """``values`` as a slice when they are consecutive integers, else None (also empty)."""
    if not values:
        return None
    first, end = values[0], values[0] + len(values)
    return slice(first, end) if values == list(range(first, end)) else None


def to_device(values: list, device: torch.device | str, dtype=None) -> torch.Tensor:
    """A host list as a device tensor, without waiting for the device's queued work
    (``torch.tensor(values, device=...)`` would wait: async scheduling queues the
    next step while the device still runs the previous one)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _token_ids(requests: list[StepRequest]) -> Iterator[int]:
    for r in requests:
        yield from r.new_token_ids
