"""A worker replica's handle on its engine process (``core_process.py``).

``EngineClient`` starts the process and waits for it to be ready (a failed start
raises the engine's own error), then keeps a control socket to it: load
(``stats``, every stats period), the NCCL rendezvous in both directions, and
shutdown. Requests do not pass through here: fronts connect to the engine's
``address`` (``EngineConnection``) and stream from it directly.

If the process dies, ``alive`` turns False and ``error`` says why (the
replica's health check reports it); ``stalled`` says when it looks hung (no stats,
or no step while it holds requests), the replica's watchdog. ``drain`` makes the
engine take no new requests and finish what it holds; ``shutdown`` stops the
process (requests still open end with "shutting down"), and kills it if it does
not stop in time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from splitserve.config import EngineConfig
from splitserve.workers.engine import messages
from splitserve.workers.engine.core_process import (
    Drain,
    EngineDied,
    Heartbeat,
    JoinPair,
    Ready,
    Rendezvous,
    RendezvousDone,
    Shutdown,
    Start,
    StartFailed,
)
from splitserve.workers.engine.engine_connection import holds_requests
from splitserve.workers.engine.messages import WorkerStats

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0

# The replica's side of the NCCL rendezvous: (decode replica id, pair key, unique id).
RendezvousCall = Callable[[str, str, bytes], None]


class EngineStartError(RuntimeError):
    """The engine process could not start; the message holds its own traceback."""


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        owner: str = "",
        rendezvous: RendezvousCall | None = None,
        front_host: str = "127.0.0.1",
        secret: str = "",
        max_requests: int | None = None,
    ):
        """``front_host``: where fronts connect; ``secret``: what their hello must carry;
        ``max_requests``: open requests beyond this are answered ``Overloaded``."""
        self._rendezvous = rendezvous
        self.secret = secret
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "splitserve.workers.engine.core_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        start = Start(
            dataclasses.asdict(config),
            owner,
            rendezvous is not None,
            front_host,
            secret,
            max_requests,
        )
        self._send(start)
        self.stats: WorkerStats = self._wait_ready()
        self.stats.pid = os.getpid()
        self.stats_at = self.progress_at = time.monotonic()  # as EngineConnection's
        self.beat_at, self.in_step_s = self.stats_at, 0.0  # the last Heartbeat
        self.address = self.stats.address
        self._error: str | None = None  # why the process is gone, as the reader learnt it
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="engine-control", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.error is None

    @property
    def error(self) -> str | None:
        """Why the process is gone; None while it runs. Set from the moment it has exited,
        not only once the reader thread has seen its pipe close."""
        if self._error is None and (code := self.process.poll()) is not None:
            return f"the engine process exited with code {code}"
        return self._error

    @property
    def pid(self) -> int:
        return self.process.pid

    def join(self, pair_key: str, unique_id: bytes, rank: int = 0) -> None:
        """NCCL, decode side: join a prefill worker's pair as rank 1 (returns at once);
        ``rank``: which rank of an expert-parallel group joins."""
        self._send(JoinPair(pair_key, unique_id, rank))

    @property
    def holds_requests(self) -> bool:
        return holds_requests(self.stats)

    def stalled(self, timeout_s: float, step_timeout_s: float | None = None) -> str | None:
        """Why the engine looks hung (None: it does not): no stats for ``timeout_s``, or
        no step in ``timeout_s`` while it holds requests; but while its heartbeats say the
        loop is inside one step, only once that step has run ``step_timeout_s`` (None:
        ``timeout_s`` too). A frozen process (SIGSTOP) sends no heartbeat either."""
        now = time.monotonic()
        if now - self.stats_at > timeout_s:
            why = f"sent no stats for {now - self.stats_at:.1f} s"
        elif now - self.progress_at > timeout_s:
            why = f"made no step in {now - self.progress_at:.1f} s while holding requests"
        else:
            return None
        beating = now - self.beat_at <= timeout_s and self.in_step_s > 0
        if not beating or step_timeout_s is None:
            return why
        in_step = self.in_step_s + (now - self.beat_at)
        if in_step <= step_timeout_s:
            return None  # a long step (a kernel build, a long prompt): not hung yet
        return f"{why}: one step has run for {in_step:.1f} s"

    def drain(self) -> None:
        """Take no new requests (the stats say ``draining``); finish those held."""
        with contextlib.suppress(OSError):
            self._send(Drain())

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the process; kill it if it has not stopped within ``timeout_s`` (0 for a
        hung one)."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._send(Shutdown())
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop; killing it", self.process.pid)
            self.process.kill()
            self.process.wait()
        self.conn.close()

    # ---- the process's side ------------------------------------------------------------

    def _send(self, message) -> None:
        frame = messages.encode(message)
        with self._send_lock:
            self.conn.send_bytes(frame)

    def _wait_ready(self) -> WorkerStats:
        try:
            message = messages.decode(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            code = self.process.wait()
            raise EngineStartError(f"the engine process exited with code {code}") from e
        if isinstance(message, StartFailed):
            self.process.wait()
            raise EngineStartError(f"the engine could not start:\n{message.error}")
        assert isinstance(message, Ready), message
        return message.stats

    def _read(self) -> None:
        """The reader thread: stats, rendezvous requests, and the process's end."""
        try:
            while True:
                message = messages.decode(self.conn.recv_bytes())
                if isinstance(message, WorkerStats):
                    message.pid = os.getpid()
                    now = time.monotonic()
                    if message.num_steps != self.stats.num_steps or not holds_requests(message):
                        self.progress_at = now
                    self.stats, self.stats_at = message, now
                elif isinstance(message, Heartbeat):
                    self.beat_at, self.in_step_s = time.monotonic(), message.in_step_s
                elif isinstance(message, Rendezvous):
                    threading.Thread(target=self._answer_rendezvous, args=(message,)).start()
                elif isinstance(message, EngineDied):
                    self._error = f"the engine loop died:\n{message.error}"
        except (EOFError, OSError):
            code = self.process.wait()
            self._error = self._error or f"the engine process exited with code {code}"
        if not self._closing:
            logger.error("engine process %d is gone: %s", self.process.pid, self.error)

    def _answer_rendezvous(self, call: Rendezvous) -> None:
        error = None
        try:
            self._rendezvous(call.owner, call.pair_key, call.unique_id)
        except Exception as e:  # the engine's transport raises it for the transfer
            error = f"{type(e).__name__}: {e}"
        with contextlib.suppress(OSError):
            self._send(RendezvousDone(call.call_id, error))
