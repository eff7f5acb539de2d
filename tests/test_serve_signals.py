"""`splitserve serve` stops on the first SIGINT or SIGTERM, whichever thread the kernel
delivers it to (a Ray process has many)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from benchmarks.serve_process import free_port, splitserve_command

# The signal reaches a thread other than the main one: Python runs the handler only when
# the main thread runs again, so an untimed wait would sleep through it.
SCRIPT = """
import signal, threading, time
from splitserve.cluster.stop_signals import StopSignals

def other_thread():
    time.sleep(1.0)  # the handlers are set by then
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=other_thread, daemon=True).start()
start = time.monotonic()
print(StopSignals().wait(), round(time.monotonic() - start, 1), flush=True)
"""


def test_a_signal_another_thread_received_ends_the_wait():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=20
    )
    assert proc.returncode == 0, proc.stderr
    received, waited = proc.stdout.split("] ")
    assert received == "[15"  # SIGTERM, once
    assert 0.9 < float(waited) < 3.0


UNIT = """
import os, signal
from splitserve.cluster.stop_signals import StartupInterrupted, StopSignals

stop = StopSignals()
try:
    with stop.interrupting():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**6):  # the handler runs between bytecodes
            pass
    print("not interrupted")
except StartupInterrupted as e:
    print("in the block:", e, e.exit_code)
os.kill(os.getpid(), signal.SIGINT)  # outside a block: recorded only
try:
    with stop.interrupting():
        print("not interrupted")
except StartupInterrupted as e:
    print("at the start:", e, e.exit_code)
print(stop.received)
"""


def test_a_signal_interrupts_start_up_in_the_block_or_at_its_start():
    proc = subprocess.run([sys.executable, "-c", UNIT], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "in the block: SIGTERM 143",
        "at the start: SIGTERM 143",  # the first signal received
        "[15, 2]",
    ]


@pytest.mark.parametrize(
    ("sig", "inherited"),
    [(signal.SIGINT, "default"), (signal.SIGINT, "ignored"), (signal.SIGTERM, "default")],
)
def test_a_stop_signal_while_deploying_stops_cleanly(sig, inherited):
    """SIGINT while the replicas start: the app is deleted and Ray stopped, exit 130, a
    line that says so and no traceback; also where the server inherited SIGINT ignored,
    as a command started with ``&`` from a script does (the signal was dropped then, and
    the server served on); and SIGTERM, whose handler ``ray.init`` replaces (143)."""
    cmd = [*splitserve_command(), "serve", "--port", str(free_port())]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    ignore = (
        (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherited == "ignored" else None
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, preexec_fn=ignore,
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:  # Ray Serve is up; the deployment starts next
            lines.append(line)
            if "Started Serve" in line:
                break
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 128 + sig, out
    assert f"splitserve: {signal.Signals(sig).name} while deploying" in out
    assert "splitserve: shutting down" in out
    assert "Traceback" not in out
