"""Ports for what a server starts beside Ray come from between Ray's worker ports and the
kernel's ephemeral range, free when chosen; a taken one is passed over."""

from __future__ import annotations

import socket

from splitserve.cluster import ports


def test_a_free_port_lies_between_rays_worker_ports_and_the_ephemeral_range():
    for _ in range(20):
        port = ports.free_port()
        assert ports.RAY_WORKER_PORTS_END < port < ports.ephemeral_start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binding it works


def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        free = ports.free_port()
        draws = iter([taken, free])
        monkeypatch.setattr(ports.random, "randint", lambda low, high: next(draws))
        assert ports.free_port() == free


def test_without_a_window_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.RAY_WORKER_PORTS_END)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path, monkeypatch):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", path)
    assert ports.ephemeral_start() == 40000
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert ports.ephemeral_start() == ports.DEFAULT_EPHEMERAL_START
