"""Free TCP ports for what a server starts beside Ray, drawn where Ray and the kernel do
not draw.

The port the kernel gives a socket bound to port 0 comes from its ephemeral range, the
range every outgoing connection and every port-0 listener (Ray's own servers among
them) also takes from; between choosing such a port and binding it, a starting Ray may
take it (seen in CI: HAProxy exited with "Address already in use"). So a port here is
drawn at random between Ray's worker ports and the ephemeral range, and checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 19999  # Ray's default max_worker_port
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_START = 32768  # Linux's default
TRIES = 100


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now, above Ray's worker ports and below the kernel's
    ephemeral range (any free port if that window is closed or every try is taken)."""
    low, high = RAY_WORKER_PORTS_END + 1, ephemeral_start() - 1
    for _ in range(TRIES if high > low else 0):
        port = random.randint(low, high)
        if _bindable(host, port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def in_use(host: str, port: int) -> bool:
    """Whether a socket listens on ``host:port`` now. Bound as a server binds (with
    ``SO_REUSEADDR``), so the connections a stopped server left in TIME_WAIT do not count."""
    return not _bindable(host, port, reuse_address=True)


def _bindable(host: str, port: int, reuse_address: bool = False) -> bool:
    with socket.socket() as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
