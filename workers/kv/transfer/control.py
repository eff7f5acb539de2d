"""The control plane: one TCP connection per ordered pair of workers, its frames in order.

A sender opens a ``Peer`` to each receiver it sends to. Frames posted to it leave
in post order, written by its writer thread (a data path may write a frame from
the calling thread when nothing queued can be behind it, as NCCL's "hello",
"announce" and "done" do), and its reader thread hands back the receiver's
answers. A receiver's ``Listener`` accepts the connections, has each prove it
holds the application's key (``auth.py``) before reading anything else from it,
and hands on each frame in arrival order, from one thread per connection,
refusing a frame larger than a layer of its whole KV cache; a connection whose
frame is malformed or refused is closed. Frame kinds (a msgpack header and raw
bytes, ``framing.py``)::

    sender -> receiver   "done", "cancel"; "layer" (cpu); "hello", "announce" (nccl)
    receiver -> sender   "ack"
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from splitserve.config import env
from splitserve.workers.kv.transfer.auth import challenge, key_bytes
from splitserve.workers.kv.transfer.framing import Connection, listen

logger = logging.getLogger(__name__)

OnFrame = Callable[[Connection, dict[str, Any], bytearray], None]


class Peer:
    """A connection to one receiver, with its writer thread and its reader thread."""

    def __init__(self, address: str, conn: Connection):
        self.address = address
        self.conn = conn
        self.alive = True
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        # Fault injection (tests): hold a hand-off mid-transfer, see splitserve/config.py.
        self.layer_delay_s = float(env("SPLITSERVE_KV_LAYER_DELAY_S"))

    def post(self, header: dict[str, Any], payload: Any = b"") -> None:
        """Queue a frame; it leaves after every frame posted before it."""
        self.queue.put((header, payload))

    def start(
        self,
        on_answer: Callable[[dict[str, Any]], None],
        on_lost: Callable[[Peer, str], None],
    ) -> None:
        """Start the threads: ``on_answer(header)`` for each frame the receiver sends,
        ``on_lost(peer, error)`` when writing or reading fails."""
        threading.Thread(target=self._write_loop, args=(on_lost,), daemon=True).start()
        threading.Thread(target=self._read_loop, args=(on_answer, on_lost), daemon=True).start()

    def stop(self) -> None:
        """End the writer thread and close the connection (which ends the reader)."""
        self.queue.put((None, b""))
        self.conn.close()

    def _write_loop(self, on_lost: Callable[[Peer, str], None]) -> None:
        try:
            while self.alive:
                header, payload = self.queue.get()
                if header is None:
                    break
                self.conn.send(header, payload)
                if self.layer_delay_s and header["kind"] == "layer":
                    time.sleep(self.layer_delay_s)
        except OSError as e:
            on_lost(self, f"decode worker {self.address} went away: sending failed: {e}")

    def _read_loop(self, on_answer, on_lost: Callable[[Peer, str], None]) -> None:
        try:
            while True:
                header, _ = self.conn.recv(max_payload=0)  # acks: headers only
                on_answer(header)
        except Exception as e:  # OSError, or an answer this side cannot read
            on_lost(self, f"decode worker {self.address} went away: {e}")


class Listener:
    """The receiver's server socket: accepts senders and reads their frames."""

    def __init__(self, host: str, key: bytes, max_payload: int):
        """``key``: what a connection must prove it has; ``max_payload``: the largest
        frame payload accepted (one layer of the whole KV cache)."""
        self.key = key
        self._max_payload = max_payload
        self._server = listen(host)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._accepted: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self, on_frame: OnFrame, on_closed: Callable[[Connection, OSError], None]) -> None:
        """Accept from now on: ``on_frame(conn, header, payload)`` for each frame, in order;
        ``on_closed(conn, error)`` once the connection ends (an ``OSError`` that
        ``on_frame`` raises, such as a ``ConnectionError``, ends it too)."""
        args = (on_frame, on_closed)
        threading.Thread(target=self._accept_loop, args=args, name="kv-accept", daemon=True).start()

    def _accept_loop(self, on_frame: OnFrame, on_closed) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            conn = Connection(sock)
            with self._lock:
                self._accepted.append(conn)
            args = (conn, on_frame, on_closed)
            threading.Thread(target=self._serve, args=args, daemon=True).start()

    def _serve(self, conn: Connection, on_frame: OnFrame, on_closed) -> None:
        try:
            challenge(conn, self.key)
        except Exception as e:  # a stranger: closed before any of its frames is read
            logger.warning("refused a KV control connection: %s", e)
            self._drop(conn)
            return
        try:
            while True:
                header, payload = conn.recv(max_payload=self._max_payload)
                on_frame(conn, header, payload)
        except Exception as e:  # gone, over the cap, or a frame on_frame cannot take
            on_closed(conn, e if isinstance(e, OSError) else ConnectionError(str(e)))
            self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        with self._lock:
            if conn in self._accepted:
                self._accepted.remove(conn)
        conn.close()

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            accepted = list(self._accepted)
        for conn in accepted:
            conn.close()


def cache_listener(host: str, kv_cache, auth_key: str | bytes | None) -> Listener:
    """The listener of ``kv_cache``'s transport: no frame is larger than one layer of the
    whole cache (the CPU transport's largest, a layer of one transfer)."""
    slots = kv_cache.num_blocks * kv_cache.block_size
    return Listener(host, key_bytes(auth_key), kv_cache.layout.bytes_per_token(1) * slots)


def unknown_frame(kind: str) -> ConnectionError:
    """The error that ends a connection on which a frame of an unknown kind came."""
    return ConnectionError(f"unknown KV frame kind {kind!r}")
