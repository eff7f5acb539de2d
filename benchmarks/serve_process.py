"""A ``splitserve serve`` subprocess for ``serve_bench.py``, and what it asks the server.

``served(config, ...)`` starts ``splitserve serve --config`` on a free port (or the
one given), waits until ``/health`` answers 200, yields the base URL, and on exit
sends SIGINT (the server's Ctrl-C: it deletes the app and stops Ray) and waits;
SIGTERM, then SIGKILL, only if it does not stop. A SIGTERM to this process (a
``timeout`` around the benchmark) stops the server the same way before exiting: it
runs in its own session, so nothing else would, and it would keep its GPUs. The
server's output goes to ``log_path`` (kept) or a temporary file; its tail is shown
when it fails.

Also what a report says about the machine: ``CpuProbe`` (how busy the CPU was,
and how much of it other users took), ``git_commit`` and ``host_info``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from splitserve.cluster.ports import free_port

try:
    import process_cpu
except ImportError:  # imported as benchmarks.serve_process (the tests)
    from benchmarks import process_cpu


def splitserve_command() -> list[str]:
    """This Python's ``splitserve`` script, else the one on PATH, else the module."""
    script = Path(sys.executable).with_name("splitserve")
    found = str(script) if script.exists() else shutil.which("splitserve")
    return [found] if found else [sys.executable, "-m", "splitserve.cluster.cli"]


def post_json(url: str, timeout: float = 60.0):
    """A bodyless POST's JSON answer; an error status raises RuntimeError with the
    server's own message."""
    request = urllib.request.Request(url, b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url}: {e.code} {e.read().decode(errors='replace')}") from e


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def served(
    config: Path,
    host: str,
    model: str | None,
    port: int | None,
    startup_s: float,
    log_path: Path | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """``splitserve serve --config`` (and ``extra_args``) in a subprocess until the block
    ends; its base URL."""
    port = port or free_port()
    cmd = [*splitserve_command(), "serve", "--config", str(config), "--port", str(port)]
    cmd += ["--model", model] if model else []
    cmd += list(extra_args)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    log_file = open(log_path, "a+") if log_path else tempfile.TemporaryFile("w+")  # noqa: SIM115
    with log_file as log, _sigterm_exits():
        print(f"starting: {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            _wait_healthy(url, proc, startup_s, log)
            yield url
        finally:
            _stop(proc, log)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit (so ``finally`` blocks run) while the block runs; only
    the main thread may set handlers, elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_healthy(url: str, proc: subprocess.Popen, startup_s: float, log) -> None:
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"splitserve serve exited with {proc.returncode}:\n{_tail(log)}")
        with contextlib.suppress(OSError, ValueError):
            get_json(f"{url}/health", timeout=5)
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health did not answer 200 within {startup_s} s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen, log) -> None:
    """SIGINT (the server's Ctrl-C: it deletes the app and stops Ray), then wait."""
    for sig, wait_s in ((signal.SIGINT, 120), (signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
    if proc.returncode != 0:
        print(f"warning: splitserve serve exited with {proc.returncode}:\n{_tail(log)}")


def _tail(log, lines: int = 30) -> str:
    log.seek(0)
    return "".join(log.readlines()[-lines:])


def metric_values(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Every sample of the server's ``/metrics``, by its name and labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        return parse_metrics(resp.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {name with its labels: value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def route_counts_of(metrics: dict[str, float]) -> dict[str, float]:
    """``splitserve_requests_total`` of ``metric_values``, by its labels."""
    prefix = "splitserve_requests_total"
    return {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix + "{")}


class CpuProbe:
    """CPU use from its creation to ``stop()`` (Linux ``/proc``), as shares of the
    whole machine: ``busy``; ``client``, this process (the load generator, which
    competes with the server on a small machine); ``foreign``, processes outside
    this one's tree (this process, the server it started, its Ray workers): other
    users' work, which skews every figure. None values where there is no ``/proc``."""

    def __init__(self):
        self.start = _cpu_sample()

    def stop(self) -> dict:
        """The shares, and ``processes``: CPU seconds by role in this process's tree
        (``process_cpu.by_role``; the server's only when this process started it)."""
        end = _cpu_sample()
        if self.start is None or end is None or end[1] == self.start[1]:
            return {"busy": None, "client": None, "foreign": None, "processes": {}}
        (idle0, total0, tree0, self0), (idle1, total1, tree1, self1) = self.start, end
        total = total1 - total0
        busy = total - (idle1 - idle0)
        ours = sum(p.ticks for p in tree1.values()) - sum(p.ticks for p in tree0.values())
        return {
            "busy": busy / total,
            "client": (self1 - self0) * os.sysconf("SC_CLK_TCK") / total,
            "foreign": max(0, busy - ours) / total,
            "processes": process_cpu.by_role(tree0, tree1),
        }


def background_cpu(seconds: float = 2.0) -> dict[str, float | None]:
    """How busy the machine is before we load it."""
    probe = CpuProbe()
    time.sleep(seconds)
    return probe.stop()


def _cpu_sample() -> tuple[int, int, dict, float] | None:
    """(idle, total) ticks of all CPUs, this process's tree (``process_cpu.snapshot``:
    each one's ticks, with the children it has reaped, and its role), and this
    process's CPU seconds."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        tree = process_cpu.snapshot(os.getpid())
        return ticks[3] + ticks[4], sum(ticks), tree, time.process_time()
    except (OSError, ValueError):
        return None


def git_commit(repo: Path) -> dict:
    """The commit checked out in ``repo``, and whether tracked files differ from it."""

    def git(*words: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *words], capture_output=True, text=True)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "-s", "-uno"))}


def host_info() -> dict:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
