"""``benchmarks/process_cpu.py``: CPU time by role over a real process tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks import process_cpu, serve_process
from benchmarks.process_cpu import CLIENT, HAPROXY, OTHERS, Proc, by_role, role_of

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def test_roles_come_from_titles_and_parents():
    assert role_of("ray::ServeReplica:splitserve:ingress", OTHERS) == "ingress replica"
    assert role_of("ray::ServeReplica:app:decode ", OTHERS) == "decode replica"
    engine = "/usr/bin/python -m splitserve.workers.engine.core_process 66"
    assert role_of(engine, "decode replica") == "decode engine"
    assert role_of("python -m splitserve.workers.parallel.rank_process", "mixed engine") == (
        "mixed engine"
    )
    assert role_of("/opt/x/bin/haproxy -db -f /tmp/h.cfg", OTHERS) == HAPROXY
    assert role_of("ray::ServeController", OTHERS) == OTHERS
    assert role_of("/usr/bin/gcs_server --log_dir=x", CLIENT) == OTHERS


def test_seconds_by_role_between_snapshots():
    hz = os.sysconf("SC_CLK_TCK")
    before = {1: Proc(10, CLIENT), 2: Proc(5, "ingress replica"), 3: Proc(7, OTHERS)}
    after = {
        1: Proc(10 + hz, CLIENT),
        2: Proc(5 + 2 * hz, "ingress replica"),
        4: Proc(hz // 2, "decode engine"),  # new since: counted from 0
    }  # 3 ended: nothing
    assert by_role(before, after) == {
        "ingress replica": pytest.approx(2.0),
        CLIENT: pytest.approx(1.0),
        "decode engine": pytest.approx((hz // 2) / hz),
    }


def test_a_real_tree_is_counted_by_role():
    """A child titled as a Serve replica that starts a busy grandchild (its engine)."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8: pass"
    spawner = f"import subprocess; subprocess.run([{sys.executable!r}, '-c', {busy!r}])"
    title = "ray::ServeReplica:app:decode"
    before = process_cpu.snapshot(os.getpid())
    shell = ["bash", "-c", f'exec -a "{title}" "$0" -c "$1"', sys.executable, spawner]
    replica = subprocess.Popen(shell)
    try:
        time.sleep(0.5)  # the grandchild is busy now
        during = process_cpu.snapshot(os.getpid())
    finally:
        replica.wait(timeout=30)
    roles = {p.role for pid, p in during.items() if pid != os.getpid()}
    assert roles >= {"decode replica", "decode engine"}, roles
    seconds = by_role(before, during)
    assert seconds["decode engine"] > 0.2, seconds
    # both ended and were reaped: their CPU now counts in this process, the client
    assert by_role(before, process_cpu.snapshot(os.getpid()))[CLIENT] > 0.6


def test_the_cpu_probe_splits_its_tree_by_role():
    """``serve_process.CpuProbe``: a busy child titled as an ingress replica, alive at stop."""
    busy = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass"
    title = "ray::ServeReplica:app:ingress"
    probe = serve_process.CpuProbe()
    replica = subprocess.Popen(
        ["bash", "-c", f'exec -a "{title}" "$0" -c "$1"', sys.executable, busy]
    )
    try:
        time.sleep(0.6)
        cpu = probe.stop()
    finally:
        replica.kill()
        replica.wait(timeout=30)
    assert cpu["processes"]["ingress replica"] > 0.2, cpu
    assert cpu["busy"] > 0 and 0 <= cpu["foreign"] <= 1
