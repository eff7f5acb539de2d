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
    tables = [
        b for r in requests for b in r.block_ids + [NULL_BLOCK] * (max_blocks - len(r.block_ids))
    ]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    # One host tensor, one copy to the device; every field is a view of it.
    fields = [input_ids, positions, slots, logits_indices, cu, seq_lens, tables]
    packed = torch.tensor([v for f in fields for v in f], dtype=torch.long).to(device)
    ids, pos, slot_mapping, logits, query_start_loc, seq_lens_t, flat_tables = packed.split(
        [len(f) for f in fields]
    )
    fb = ForwardBatch(
        phase=ForwardBatch.phase_of(query_lens, [r.num_computed for r in requests]),
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
    )
    if plan:
        attn_backend.plan(fb)
    return fb
