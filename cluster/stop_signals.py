"""SIGINT and SIGTERM for ``splitserve serve``, from its first line to its last.

The handlers are set before Ray starts, so no stop signal is lost: a process
started in the background inherits SIGINT ignored, and one sent while the app
deploys (``/health`` answers as soon as a request can be served, before Ray
Serve calls the app running) was dropped, leaving the server up until a second
signal came. ``interrupting`` turns a signal into ``StartupInterrupted`` inside
its block (the deployment's wait), and at its start for one already received.
``wait`` blocks until a signal while the app serves; it wakes every
``POLL_S``, because the kernel may hand the signal to one of Ray's threads and
Python runs the handler only when the main thread runs again.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

POLL_S = 0.5  # how soon a signal that another thread received is handled
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StartupInterrupted(BaseException):  # as KeyboardInterrupt: no `except Exception` takes it
    """A stop signal before the app ran; ``exit_code`` is the shell's 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


class StopSignals:
    """The stop signals received so far, in order (``received``)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._event = threading.Event()
        self._raise = False
        self.install()

    def install(self) -> None:
        """Set (or set again: ``ray.init`` sets its own SIGTERM handler) the handlers."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        self.received.append(signum)
        self._event.set()
        if self._raise:
            self._raise = False
            raise StartupInterrupted(signum)

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """A stop signal, before the block or in it, raises ``StartupInterrupted``."""
        if self.received:
            raise StartupInterrupted(self.received[0])
        self._raise = True
        try:
            yield
        finally:
            self._raise = False

    def wait(self) -> list[int]:
        """Block until a stop signal; ``received`` (it grows after that)."""
        while not self._event.wait(POLL_S):
            pass
        return self.received
