"""Where fronts (ingress replicas) connect to an engine process, one connection each.

A front's connection carries its calls in and its requests' events out, so a
token goes engine process -> ingress in one hop, batched per step, without
passing through the worker replica or Ray. ``FrontListener`` accepts on
``host`` (loopback on one node), checks the first frame is a ``Hello`` with the
application's secret, and reads each front's frames on a thread of its own,
handing ``(front, message)`` to the engine loop. Frames beyond
``MAX_FRAME_BYTES`` or a wrong secret close the connection; a closed connection
is handed on as ``FrontClosed`` so the loop aborts that front's requests
(``FrontOpened`` tells it a front is there, to send it stats).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from splitserve.workers.engine import messages
from splitserve.workers.engine.messages import MAX_FRAME_BYTES, Hello

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0


class Front:
    """One connection the engine sends events and stats to (a front, or the replica)."""

    def __init__(self, conn: Connection, name: str):
        self.conn = conn
        self.name = name
        self.closed = False
        self._lock = threading.Lock()  # the loop and transport threads both send

    def send_frame(self, frame: bytes) -> None:
        if self.closed:
            return
        try:
            with self._lock:
                self.conn.send_bytes(frame)
        except OSError:  # its reader sees the close and reports FrontClosed
            self.closed = True

    def send(self, message) -> None:
        self.send_frame(messages.encode(message))


@dataclass(frozen=True)
class FrontOpened:
    """A front connected and said hello: it gets stats from now on."""


@dataclass(frozen=True)
class FrontClosed:
    """A front's connection ended: the loop aborts the requests it owned."""


OnMessage = Callable[[Front, object], None]


class FrontListener:
    def __init__(self, host: str, secret: str, on_message: OnMessage):
        self._secret = secret.encode()
        self._on_message = on_message
        self._sock = socket.create_server((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._count = 0
        threading.Thread(target=self._accept, name="engine-fronts", daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._count += 1
            name = f"front-{self._count}@{peer[0]}:{peer[1]}"
            threading.Thread(target=self._serve, args=(sock, name), daemon=True).start()

    def _serve(self, sock: socket.socket, name: str) -> None:
        conn = Connection(sock.detach())
        front = Front(conn, name)
        if not self._greeted(conn):
            logger.warning("%s: no valid hello; closed", name)
            conn.close()
            return
        self._on_message(front, FrontOpened())
        try:
            while True:
                self._on_message(front, messages.decode(conn.recv_bytes(MAX_FRAME_BYTES)))
        except EOFError:
            pass
        except Exception as e:  # oversized or garbled: the connection goes, the engine stays
            logger.warning("%s: %s; closed", name, e)
        front.closed = True
        conn.close()
        self._on_message(front, FrontClosed())

    def _greeted(self, conn: Connection) -> bool:
        try:
            if not conn.poll(HELLO_TIMEOUT_S):
                return False
            hello = messages.decode(conn.recv_bytes(4096))
        except Exception:  # closed, oversized or garbled
            return False
        return isinstance(hello, Hello) and hmac.compare_digest(
            str(hello.secret).encode(), self._secret
        )
