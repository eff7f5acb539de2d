"""Prepare inputs: turn the scheduled requests of one step into a ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.workers.attention.base import AttentionBackend
from splitserve.workers.forward_batch import ForwardBatch
from splitserve.workers.kv_cache import NULL_BLOCK, KVCache


@dataclass
class StepRequest:
    """One request's part of a step."""

    new_token_ids: list[int]  # tokens whose KV this step computes
    num_computed: int  # tokens already in the KV cache
    block_ids: list[int]  # the request's block table
    sample: bool  # whether this step ends the known tokens and yields logits


def build_forward_batch(
    requests: list[StepRequest],
    kv_cache: KVCache,
    attn_backend: AttentionBackend,
    device: torch.device | str,
    plan: bool = True,
) -> ForwardBatch:
    """Pack the step's requests; ``plan=False`` leaves ``attn_backend.plan`` to the
    caller (a CUDA-graph runner plans its padded batch instead)."""
    block_size = kv_cache.block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    for r in requests:
        start = r.num_computed
        pos = range(start, start + len(r.new_token_ids))
        input_ids += r.new_token_ids
        positions += pos
        slots += [r.block_ids[p // block_size] * block_size + p % block_size for p in pos]
        if r.sample:
            logits_indices.append(len(input_ids) - 1)
    query_lens = [len(r.new_token_ids) for r in requests]
    seq_lens = [r.num_computed + q for r, q in zip(requests, query_lens)]
    max_blocks = max(len(r.block_ids) for r in requests)
    tables = [r.block_ids + [NULL_BLOCK] * (max_blocks - len(r.block_ids)) for r in requests]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    fb = ForwardBatch(
        phase=ForwardBatch.phase_of(query_lens, [r.num_computed for r in requests]),
        input_ids=tensor(input_ids, torch.long),
        positions=tensor(positions, torch.long),
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start_loc=tensor(cu, torch.int32),
        seq_lens_tensor=tensor(seq_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        block_ids=[r.block_ids for r in requests],
        slot_mapping=tensor(slots, torch.long),
        logits_indices=tensor(logits_indices, torch.long),
        kv_cache=kv_cache,
        attn_backend=attn_backend,
    )
    if plan:
        attn_backend.plan(fb)
    return fb
