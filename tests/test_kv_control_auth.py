"""The KV control plane admits only peers that hold the application's key, caps frame sizes
before allocating, closes a connection on a malformed frame, and ignores request ids it does
not know; strangers leave no state behind."""

from __future__ import annotations

import logging
import socket
import struct
import time
import tracemalloc

import msgpack
import pytest

from splitserve.workers.kv.transfer import auth
from splitserve.workers.kv.transfer.cpu_transport import CpuKVTransport
from splitserve.workers.kv.transfer.framing import Connection
from tests.test_kv_transfer import NUM_LAYERS, _cache, _hand_off, _wait

KEY = "application-secret"
PREFIX = struct.Struct("!II")


@pytest.fixture
def receiver():
    transport = CpuKVTransport(_cache(4), timeout_s=5.0, auth_key=KEY)
    transport.expect(transport.make_ticket("r1", [1, 2], 0, 8, NUM_LAYERS))
    yield transport
    transport.close()


def _raw(receiver) -> socket.socket:
    host, port = receiver.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5.0)
    return sock


def _frame(header, payload: bytes = b"") -> bytes:
    head = msgpack.packb(header)
    return PREFIX.pack(len(head), len(payload)) + head + payload


def _read_frame(sock: socket.socket):
    conn = Connection(sock)
    return conn.recv()


def _closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other side closed the connection (reads hit EOF) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def _still_expected(receiver, rid: str = "r1") -> bool:
    with receiver.transfers.lock:
        return rid in receiver.transfers.incoming and not receiver.transfers.take_events()


def _authenticated(receiver, key: str = KEY) -> socket.socket:
    sock = _raw(receiver)
    auth.answer(Connection(sock), auth.key_bytes(key))
    return sock


def _no_accepted_left(receiver, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while receiver.receiver.listener._accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    return not receiver.receiver.listener._accepted


def test_a_connection_without_the_key_is_refused_and_cannot_cancel(receiver):
    sock = _raw(receiver)
    header, _ = _read_frame(sock)
    assert header["kind"] == "challenge" and len(header["nonce"]) == auth.NONCE_BYTES
    sock.sendall(_frame({"kind": "cancel", "request_id": "r1"}))  # no answer: a cancel
    assert _closed(sock)
    wrong = _raw(receiver)
    with pytest.raises(ConnectionError, match="same kv_transfer.auth_key"):
        auth.answer(Connection(wrong), auth.key_bytes("a-guess"))
    wrong.sendall(_frame({"kind": "cancel", "request_id": "r1"}))
    assert _closed(wrong)
    assert _still_expected(receiver)  # neither reached the transfer
    assert _no_accepted_left(receiver)


def test_a_sender_with_another_key_cannot_hand_off_and_is_told_why(receiver):
    sender = CpuKVTransport(_cache(16), timeout_s=5.0, auth_key="other-application")
    try:
        ticket = receiver.make_ticket("r2", [3, 4], 0, 8, NUM_LAYERS)
        receiver.expect(ticket)
        deadline = time.monotonic() + 5.0
        while (state := sender.connect(ticket)) == "connecting" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state is not None and "same kv_transfer.auth_key" in state, state
        with pytest.raises(ConnectionError, match="same kv_transfer.auth_key"):
            sender.start_send(ticket, [5])
        with receiver.transfers.lock:
            assert receiver.transfers.incoming["r2"].layers_received == 0
    finally:
        sender.close()


def test_senders_with_the_key_hand_off(receiver):
    sender = CpuKVTransport(_cache(4), timeout_s=5.0, auth_key=KEY)
    try:
        _hand_off(sender, receiver, "r3", [5, 6], [7, 8], start=0, num_tokens=8)
        assert any(e.ok and e.request_id == "r3" for e in _wait(receiver, n=1))
        assert _wait(sender)[0].ok
    finally:
        sender.close()


@pytest.mark.parametrize("authenticated", [False, True])
def test_an_oversized_frame_is_refused_before_it_is_read(receiver, authenticated):
    tracemalloc.start()
    try:
        sock = _authenticated(receiver) if authenticated else _raw(receiver)
        sock.sendall(PREFIX.pack(16, 256 << 20))  # "256 MiB follow"
        assert _closed(sock)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # nothing near the announced size was allocated
    assert _still_expected(receiver)


@pytest.mark.parametrize(
    "frame",
    [
        _frame([1, 2, 3]),  # not a dict
        _frame({"no": "kind"}),
        _frame({"kind": "cancel"}),  # no request id
        PREFIX.pack(3, 0) + b"\xc1\xc1\xc1",  # not msgpack
    ],
    ids=["list", "no-kind", "no-request-id", "garbage"],
)
def test_a_malformed_frame_closes_the_connection(receiver, frame):
    sock = _authenticated(receiver)
    sock.sendall(frame)
    assert _closed(sock)
    assert _still_expected(receiver)
    assert _no_accepted_left(receiver)


def test_unknown_request_ids_are_ignored(receiver):
    sock = _authenticated(receiver)
    sock.sendall(_frame({"kind": "cancel", "request_id": "nobody"}))
    layer = {"kind": "layer", "request_id": "nobody", "layer": 0}
    sock.sendall(_frame(layer, b"\0" * 64))
    assert not _closed(sock, timeout=0.3)  # still open: nothing was wrong with the frames
    assert _still_expected(receiver)
    sock.close()


def test_strangers_leave_nothing_behind(receiver, caplog):
    caplog.set_level(logging.ERROR)  # pytest keeps every record: not the listener's memory
    tracemalloc.start()
    try:
        for _ in range(3):  # warm up
            _closed_after_garbage(receiver)
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(100):
            _closed_after_garbage(receiver)
        assert _no_accepted_left(receiver)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 256 << 10
    assert _still_expected(receiver)


def _closed_after_garbage(receiver) -> None:
    sock = _raw(receiver)
    sock.sendall(PREFIX.pack(2**31, 2**31))
    assert _closed(sock)
    sock.close()


def test_each_application_draws_its_own_key_and_sends_it_in_the_config():
    from splitserve.cluster.serve_config import ServeConfig

    config = ServeConfig()
    key = config.engine.kv_transfer.auth_key
    assert len(key) == 64 and key != ServeConfig().engine.kv_transfer.auth_key
    assert ServeConfig.from_dict(config.to_dict()).engine.kv_transfer.auth_key == key
    with pytest.raises(ValueError, match="invalid kv_transfer.auth_key"):
        ServeConfig.from_dict({"engine": {"kv_transfer": {"auth_key": ""}}})
