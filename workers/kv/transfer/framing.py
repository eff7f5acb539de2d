"""Length-prefixed frames over a TCP socket: a msgpack header, then raw bytes.

Frame: ``!II`` (header length, payload length), the msgpack header (a dict
with a ``kind``), the payload. One ``Connection`` serialises writers with a
lock, so frames from several threads never interleave. A reader caps both
lengths (``recv``'s ``max_header``, ``max_payload``) before it allocates
anything, and a header that is not a dict with a string ``kind`` ends the
connection.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Any

import msgpack

_PREFIX = struct.Struct("!II")
MAX_HEADER_BYTES = 64 << 10


class Connection:
    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._write_lock = threading.Lock()

    @classmethod
    def connect(cls, address: str, timeout_s: float) -> Connection:
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        sock.settimeout(None)
        return cls(sock)

    def send(self, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
        head = msgpack.packb(header)
        with self._write_lock:
            self.sock.sendall(_PREFIX.pack(len(head), len(payload)) + head)
            if len(payload):
                self.sock.sendall(payload)

    def recv(
        self, max_header: int = MAX_HEADER_BYTES, max_payload: int | None = None
    ) -> tuple[dict[str, Any], bytearray]:
        """Block for the next frame; raise ConnectionError when the peer is gone, or when
        the frame is over the caps (``max_payload`` None: no cap) or malformed."""
        head_len, payload_len = _PREFIX.unpack(self._recv_exact(_PREFIX.size))
        if head_len > max_header or (max_payload is not None and payload_len > max_payload):
            raise ConnectionError(
                f"KV frame of {head_len} + {payload_len} bytes is over the cap "
                f"({max_header} + {max_payload})"
            )
        try:
            header = msgpack.unpackb(bytes(self._recv_exact(head_len)))
        except Exception as e:  # msgpack's errors, unhashable keys, ...
            raise ConnectionError(f"malformed KV frame header: {e}") from None
        if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
            raise ConnectionError("malformed KV frame header: no kind")
        return header, self._recv_exact(payload_len)

    def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            got += k
        return buf

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def listen(host: str) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, 0))
    server.listen()
    return server
