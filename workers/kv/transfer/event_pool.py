"""CUDA events for a KV hand-off's hot path: made ahead, recorded through their handles.

A hand-off records and waits on a few events per message. An event made on the
spot pays for its creation at its first record, and ``torch.cuda.Event.record`` or
``Stream.wait_event`` costs the host several times the CUDA runtime's own call
(more still on a host that was idle until the hand-off began; figures in
``docs/perf/HISTORY.md``). The pool hands out events that exist already, and
``record`` / ``wait`` call the CUDA runtime with the handles. The caller makes the
events' device current (``Pair.on_device``): the runtime acts on the current device.
"""

from __future__ import annotations

import threading

import torch

try:
    from cupy.cuda import runtime as _runtime
except ImportError:  # machines without cupy: the nccl transport, the only user, says why
    _runtime = None

_KEEP = 512  # free events kept; more are left to the garbage collector


class EventPool:
    """Events of one device, made on ``stream`` (an idle one) and reused."""

    def __init__(self, stream: torch.cuda.Stream, ready: int = 0):
        self._stream = stream
        self._free: list[torch.cuda.Event] = []
        self._lock = threading.Lock()
        self.give(self._make(ready))

    @property
    def free(self) -> int:
        """How many events wait in the pool."""
        return len(self._free)

    def take(self, n: int) -> list[torch.cuda.Event]:
        """``n`` events, each recorded at least once (so each has a handle)."""
        with self._lock:
            cut = max(len(self._free) - n, 0)
            taken, self._free = self._free[cut:], self._free[:cut]
        return taken + self._make(n - len(taken))

    def give(self, events: list[torch.cuda.Event]) -> None:
        """Return events that nothing will query again; waits already queued on them
        keep the record they were queued after."""
        with self._lock:
            self._free.extend(events[: max(_KEEP - len(self._free), 0)])

    def _make(self, n: int) -> list[torch.cuda.Event]:
        events = [torch.cuda.Event() for _ in range(n)]
        for event in events:
            event.record(self._stream)  # creates it
        return events


def record(event: torch.cuda.Event, stream: int) -> None:
    """``event`` marks what is queued on ``stream`` (a handle) now."""
    _runtime.eventRecord(event.cuda_event, stream)


def wait(stream: int, event: torch.cuda.Event) -> None:
    """Work queued on ``stream`` (a handle) from now on waits for ``event``'s last record."""
    _runtime.streamWaitEvent(stream, event.cuda_event, 0)
