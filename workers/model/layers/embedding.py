"""Token embedding and LM head; a tied head shares the embedding's weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels.ops import linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tie_to: VocabEmbedding | None = None):
        super().__init__()
        self.weight = (
            tie_to.weight if tie_to is not None else nn.Parameter(torch.empty(vocab_size, hidden))
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_rows, vocab]`` in the model's dtype: the sampler casts them to
        float32 where it edits or reads them, and a plain greedy batch takes their argmax
        as they are (``sampler.py``)."""
        return linear(hidden, self.weight)
