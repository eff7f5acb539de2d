"""`splitserve serve` stops on the first SIGINT or SIGTERM, whichever thread the kernel
delivers it to (a Ray process has many)."""

from __future__ import annotations

import subprocess
import sys

# The signal reaches a thread other than the main one: Python runs the handler only when
# the main thread runs again, so an untimed wait would sleep through it.
SCRIPT = """
import signal, threading, time
from splitserve.cluster.serve_command import _wait_for_signal

def other_thread():
    time.sleep(1.0)  # the handlers are set by then
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=other_thread, daemon=True).start()
start = time.monotonic()
print(_wait_for_signal(), round(time.monotonic() - start, 1), flush=True)
"""


def test_a_signal_another_thread_received_ends_the_wait():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=20
    )
    assert proc.returncode == 0, proc.stderr
    received, waited = proc.stdout.split("] ")
    assert received == "[15"  # SIGTERM, once
    assert 0.9 < float(waited) < 3.0
