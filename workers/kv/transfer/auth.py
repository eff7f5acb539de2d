"""Who may speak on the KV control plane: a challenge on every connection.

The receiver's listener sends each new connection a random nonce; the sender answers
with HMAC-SHA256(key, nonce) and waits for the verdict. A wrong answer gets a
"refused" frame (so the sender can say why its hand-offs fail: the two sides hold
different keys), a missing or malformed one, or one not given within
``HANDSHAKE_TIMEOUT_S``, nothing; either way the connection closes before any frame
of it is read. The handshake's frames may be at most ``MAX_HANDSHAKE_BYTES``. The key is
``kv_transfer.auth_key`` (``splitserve serve`` draws one per application and sends it
to every worker in the config); without one, the key drawn once for this process,
which is enough for engines in one process.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

from splitserve.workers.kv.transfer.framing import Connection

NONCE_BYTES = 32
MAX_HANDSHAKE_BYTES = 1024
HANDSHAKE_TIMEOUT_S = 10.0


@functools.cache
def process_key() -> bytes:
    return secrets.token_bytes(32)


def key_bytes(auth_key: str | bytes | None) -> bytes:
    """The key a transport uses for ``kv_transfer.auth_key``."""
    if auth_key is None:
        return process_key()
    return auth_key if isinstance(auth_key, bytes) else auth_key.encode()


def challenge(conn: Connection, key: bytes) -> None:
    """The listener's side: raise ConnectionError unless the peer proves it has ``key``."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    conn.sock.settimeout(HANDSHAKE_TIMEOUT_S)
    conn.send({"kind": "challenge", "nonce": nonce})
    header, _ = conn.recv(max_header=MAX_HANDSHAKE_BYTES, max_payload=0)
    mac = header.get("mac")
    if header["kind"] != "auth" or not isinstance(mac, bytes):
        raise ConnectionError("the KV control connection did not authenticate")
    if not hmac.compare_digest(mac, _mac(key, nonce)):
        conn.send({"kind": "refused"})
        raise ConnectionError("the KV control connection gave a wrong key")
    conn.send({"kind": "admitted"})
    conn.sock.settimeout(None)


def answer(conn: Connection, key: bytes) -> None:
    """The connecting side: answer the listener's challenge; raise ConnectionError,
    saying why, unless the listener admits this side."""
    conn.sock.settimeout(HANDSHAKE_TIMEOUT_S)
    header, _ = conn.recv(max_header=MAX_HANDSHAKE_BYTES, max_payload=0)
    nonce = header.get("nonce")
    if header["kind"] != "challenge" or not isinstance(nonce, bytes):
        raise ConnectionError("the KV receiver did not send a challenge")
    conn.send({"kind": "auth", "mac": _mac(key, nonce)})
    verdict, _ = conn.recv(max_header=MAX_HANDSHAKE_BYTES, max_payload=0)
    if verdict.get("kind") == "refused":
        raise ConnectionError(
            "the KV receiver refused this sender's key: both sides need the same "
            "kv_transfer.auth_key (a process given none draws its own)"
        )
    if verdict.get("kind") != "admitted":
        raise ConnectionError("the KV receiver did not admit this sender")
    conn.sock.settimeout(None)


def _mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"splitserve-kv-control:" + nonce, hashlib.sha256).digest()
