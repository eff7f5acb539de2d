"""Device tensors on their way to the host, without waiting for the device.

``HostCopy`` queues each tensor's copy to (page-locked) host memory and records an
event after them; ``wait`` waits for that event alone, not for the work queued after
it, so the host can queue more device work (the next step, the drafter's passes)
before it needs the values. On the CPU the tensors are the host's already.
"""

from __future__ import annotations

import torch


class HostCopy:
    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        """``device``: where the tensors are (an empty list still records the event on a
        CUDA device: a caller may order its own host buffers on it, ``ready``)."""
        self.ready: torch.cuda.Event | None = None
        if device.type == "cuda":
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]
            self.ready = torch.cuda.Event()
            self.ready.record()
        self._host = tensors

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once their copies are done."""
        if self.ready is not None:
            self.ready.synchronize()
        return self._host
