"""Length-prefixed frames over a TCP socket: a msgpack header, then raw bytes.

Frame: ``!II`` (header length, payload length), the msgpack header (a dict
with a ``kind``), the payload. One ``Connection`` serialises writers with a
lock, so frames from several threads never interleave.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Any

import msgpack

_PREFIX = struct.Struct("!II")


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

    def recv(self) -> tuple[dict[str, Any], bytearray]:
        """Block for the next frame; raise ConnectionError when the peer is gone."""
        head_len, payload_len = _PREFIX.unpack(self._recv_exact(_PREFIX.size))
        header = msgpack.unpackb(bytes(self._recv_exact(head_len)))
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
