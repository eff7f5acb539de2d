"""Page-locked host buffers that kernels read or write in place, handed out in turn.

A GPU maps page-locked host memory, so a kernel can store a step's tokens
straight into it, or read a step's inputs from it, without a copy launch and
the copy engine's switches around it (about 10 us of the GPU's time each, a
decode step at one request; ``docs/PERFORMANCE.md``). The host must then not
touch a buffer while a queued kernel still uses it, and must read what a kernel
wrote only after that kernel ran.

``PinnedRing.take`` hands out its slots in turn. A slot is handed out again only
after the device has run the work queued before its ``queued`` call (an event;
in a steady loop long done, so ``take`` rarely waits). A slot that the device
writes for the host to read must be read before the ring comes round to it:
``PinnedSlot.check`` says whether it was handed out again since.
"""

from __future__ import annotations

import torch

SLOTS = 4  # the engine reads a step's tokens before it queues the step after next


class PinnedSlot:
    """One hand-out of a ring's slot: ``tensor`` is its first ``numel`` elements."""

    def __init__(self, ring: PinnedRing, index: int, tensor: torch.Tensor):
        self._ring, self._index = ring, index
        self._generation = ring._generations[index]
        self.tensor = tensor

    def queued(self, event: torch.cuda.Event | None = None) -> None:
        """The device work that uses the slot is queued: the slot is not handed out again
        before ``event`` (recorded after that work; by default here, on the current
        stream) has passed."""
        if event is None:
            event = torch.cuda.Event()
            event.record()
        self._ring._events[self._index] = event

    def check(self) -> None:
        """Raise if the slot was handed out again since: what it held is gone."""
        if self._ring._generations[self._index] != self._generation:
            raise RuntimeError(
                f"a page-locked slot was read after {self._ring.slots} later hand-outs; "
                "its contents were overwritten"
            )


class PinnedRing:
    """``slots`` page-locked buffers of ``dtype``, each grown to the largest ``take``."""

    def __init__(self, dtype: torch.dtype, slots: int = SLOTS):
        if slots < 2:
            raise ValueError(f"a ring needs at least 2 slots; got {slots}")
        self.slots, self.dtype = slots, dtype
        self._buffers = [torch.empty(0, dtype=dtype) for _ in range(slots)]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._generations = [0] * slots
        self._next = 0

    def take(self, numel: int) -> PinnedSlot:
        """The next slot, once the device is done with its last use, as ``numel`` elements."""
        i = self._next
        self._next = (i + 1) % self.slots
        event, self._events[i] = self._events[i], None
        if event is not None:
            event.synchronize()
        if self._buffers[i].numel() < numel:
            size = max(numel, 2 * self._buffers[i].numel())
            self._buffers[i] = torch.empty(size, dtype=self.dtype, pin_memory=True)
        self._generations[i] += 1
        return PinnedSlot(self, i, self._buffers[i][:numel])
