"""Greedy tokens reference: the argmax of each row of logits.

``argmax(logits [rows, vocab]) -> [rows]`` int64: the index of each row's
largest value, the first one on ties, a NaN counted larger than any number
(as ``torch.argmax``). ``host_out`` (``[rows]`` int64 on the host), when
given, receives the same tokens: the Triton kernel writes them there itself,
into page-locked memory the GPU maps, so a step's tokens reach the host
without a copy of their own.
"""

from __future__ import annotations

import torch


def argmax(logits: torch.Tensor, host_out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's first largest index; also into ``host_out`` where given."""
    tokens = logits.argmax(dim=-1)
    if host_out is not None:
        host_out.copy_(tokens)
    return tokens
