"""The per-step input of a model forward: one ForwardBatch per engine step.

Tokens of all requests in the step are packed along one axis (no padding):
request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]``. Its
attention sees ``seq_lens[i]`` tokens of KV: the cached prefix, earlier chunks,
and the new rows, whose KV is written at ``slot_mapping`` before attention.
``plan`` says which kernels the step's layers fuse (``step_plan.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from splitserve.workers.attention.base import AttentionBackend
    from splitserve.workers.kv.cache import KVCache
    from splitserve.workers.runner.step_plan import StepPlan


class Phase(enum.Enum):
    PREFILL = "prefill"  # every request computes prompt tokens
    DECODE = "decode"  # every request computes exactly one new token
    MIXED = "mixed"  # prefill chunks next to decodes
    VERIFY = "verify"  # MTP: each request checks 1 + num_draft_tokens tokens


@dataclass
class ForwardBatch:
    phase: Phase
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_lens: list[int]  # new tokens per request
    seq_lens: list[int]  # KV length per request after this step (cached + new)
    query_start_loc: torch.Tensor  # [batch + 1] int, cumulative query_lens
    seq_lens_tensor: torch.Tensor  # [batch] int
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int, padded with 0 (null page)
    block_ids: list[list[int]]  # the same block tables on the host, unpadded
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset; -1 skips
    # The device tensors above are int64 views of one buffer (one host-to-device copy).
    logits_indices: torch.Tensor  # [num_sampled] rows whose hidden state becomes logits
    kv_cache: KVCache
    attn_backend: AttentionBackend
    attn_metadata: Any = field(default=None)  # set by attn_backend.plan()
    # The step's fusions, set with the attention plan (``step_plan.py``; a graph runner:
    # at capture, for the size it captures). The layers read it; None: not planned.
    plan: StepPlan | None = None
    # Called with the layer id right after a layer's attention stored its KV (a prefill
    # worker streams each layer to the decode worker while later layers compute).
    on_layer_stored: Callable[[int], None] | None = None
    # ``logits_indices`` as a slice when they are consecutive (every decode step), else None.
    logits_rows: slice | None = None

    def sampled_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of ``hidden`` whose logits the step samples: a view when they are
        consecutive, else gathered by ``logits_indices``."""
        return hidden[self.logits_indices if self.logits_rows is None else self.logits_rows]

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return sum(_is_decode(q, s - q) for q, s in zip(self.query_lens, self.seq_lens))

    @staticmethod
    def phase_of(
        query_lens: list[int], num_computed: list[int], num_drafts: list[int] | None = None
    ) -> Phase:
        """Decode when every request adds one token to an existing KV; verify when every
        request does that or checks its drafts too, and at least one has drafts."""
        num_drafts = num_drafts or [0] * len(query_lens)
        decoding = [_is_decode(q - d, c) for q, c, d in zip(query_lens, num_computed, num_drafts)]
        if all(decoding):
            return Phase.VERIFY if any(num_drafts) else Phase.DECODE
        if any(decoding):
            return Phase.MIXED
        return Phase.PREFILL


def _is_decode(query_len: int, num_computed: int) -> bool:
    return query_len == 1 and num_computed > 0
