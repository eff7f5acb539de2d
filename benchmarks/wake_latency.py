"""How long this machine takes to wake a waiting process or thread, at low load.

    python benchmarks/wake_latency.py [--json PATH]

Every hop of a served request (client -> HAProxy -> ingress -> engine process and
back) wakes a process or thread that was blocked. This times the round trip of one
byte between two processes over a socket pair, with both blocked in ``recv``, with
the echoing side spinning, and with both spinning, and the round trip between two
threads through ``threading.Event``; a pause before each round trip lets the CPUs
go idle, as at low load. Then once more with a busy loop at the lowest priority
(``SCHED_IDLE``) on every core, so that no core is idle: on a virtual machine a
blocked wake-up that costs much more idle than busy is the hypervisor's halt and
wake, not the software's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time

ROUND_TRIPS = 400
PAUSE_S = 0.002  # before each round trip: the CPUs go idle


def _echo(sock: socket.socket, spin: bool) -> None:
    sock.setblocking(not spin)
    while True:
        try:
            data = sock.recv(1)
        except BlockingIOError:
            continue
        if not data:
            return
        sock.send(data)


def _recv(sock: socket.socket) -> None:
    while True:
        try:
            sock.recv(1)
            return
        except BlockingIOError:
            pass


def processes(spin_echo: bool, spin_here: bool) -> list[float]:
    """Round trips (us) to another process over a socket pair."""
    here, there = socket.socketpair()
    child = mp.Process(target=_echo, args=(there, spin_echo), daemon=True)
    child.start()
    here.setblocking(not spin_here)
    times = []
    for _ in range(ROUND_TRIPS):
        time.sleep(PAUSE_S)
        start = time.perf_counter()
        here.send(b"x")
        _recv(here)
        times.append((time.perf_counter() - start) * 1e6)
    here.close()
    child.join(timeout=2)
    child.kill()
    return times


def threads() -> list[float]:
    """Round trips (us) to another thread through two ``threading.Event``s."""
    there, back = threading.Event(), threading.Event()

    def answer() -> None:
        while True:
            there.wait()
            there.clear()
            back.set()

    threading.Thread(target=answer, daemon=True).start()
    times = []
    for _ in range(ROUND_TRIPS):
        time.sleep(PAUSE_S)
        start = time.perf_counter()
        there.set()
        back.wait()
        back.clear()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def _busy_at_lowest_priority() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def measure() -> dict[str, dict[str, float]]:
    cases = {
        "processes, both blocked": lambda: processes(False, False),
        "processes, the echo spinning": lambda: processes(True, False),
        "processes, both spinning": lambda: processes(True, True),
        "threads, Event": threads,
    }
    out = {}
    for cores in ("idle", "busy"):
        busy = []
        if cores == "busy":
            for _ in range(os.cpu_count() or 1):
                p = mp.Process(target=_busy_at_lowest_priority, daemon=True)
                p.start()
                busy.append(p)
            time.sleep(0.5)
        for name, case in cases.items():
            times = sorted(case())
            out[f"{name}, cores {cores}"] = {
                "p50_us": statistics.median(times),
                "p90_us": times[int(0.9 * len(times))],
            }
        for p in busy:
            p.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    figures = measure()
    print(f"Round trips at low load ({ROUND_TRIPS}, each after {PAUSE_S * 1e3:.0f} ms idle), us:")
    print(f"{'case':<48} {'p50':>8} {'p90':>8}")
    for name, f in figures.items():
        print(f"{name:<48} {f['p50_us']:8.1f} {f['p90_us']:8.1f}")
    if args.json:
        report = {"cpus": os.cpu_count(), "round_trips": ROUND_TRIPS, "figures": figures}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
