"""Tokens per expert, read without making a step wait for the device.

Every ``Experts`` module counts on the device, inside its forward (graphs included),
the (token, expert) pairs each of the rank's experts computed. ``read`` is called at
stats time, between steps: on a GPU it returns the counts of the last snapshot the
device has finished and queues the next one (a sum and a copy into pinned memory,
after the work already queued), so it never waits; with ``wait`` (an idle engine) it
takes a fresh snapshot and waits for it. On CPU the copy is the read.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.workers.model.layers.moe import Experts


class ExpertLoad:
    def __init__(self, model: nn.Module):
        self.counters = [m.tokens_per_expert for m in model.modules() if isinstance(m, Experts)]
        self.on_gpu = bool(self.counters) and self.counters[0].is_cuda
        size = len(self.counters[0]) if self.counters else 0
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=self.on_gpu)
        self.latest: list[int] = [0] * size
        self.copied: torch.cuda.Event | None = None  # the snapshot in flight

    def read(self, wait: bool = False) -> list[int]:
        """Each local expert's (token, expert) pairs over the MoE layers, so far."""
        if not self.counters:
            return []
        if not self.on_gpu:
            return torch.stack(self.counters).sum(dim=0).tolist()
        if self.copied is not None and (wait or self.copied.query()):
            self.copied.synchronize()
            self.latest, self.copied = self.host.tolist(), None
        if self.copied is None:
            self.host.copy_(torch.stack(self.counters).sum(dim=0), non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
            if wait:
                self.copied.synchronize()
                self.latest, self.copied = self.host.tolist(), None
        return self.latest
