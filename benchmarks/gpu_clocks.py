"""The GPU's clocks while a benchmark measures: ``nvidia-smi`` sampled on a thread.

A kernel near its bandwidth floor that also converts every element (FP8 to float16 on
the way to the tensor cores) needs the SM clock as much as the memory: a power or
thermal limit that lowers the clock slows it where a plain bf16 read stays at its
floor. So a timing that may depend on the clock records it beside the figure.

``with ClockProbe(device_index) as clocks: ...`` (torch's index, mapped through
``CUDA_VISIBLE_DEVICES`` to the GPU nvidia-smi names: ``smi_device``) samples every
``PERIOD_S`` while the block runs (and once at its start and end);
``clocks.summary()`` is the median SM and memory clock, the SM clock's maximum, the
peak power and temperature, and every clock-limit reason seen (``limit_reasons``).
Without ``nvidia-smi`` it samples nothing and ``summary()`` is ``{}``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from statistics import median

PERIOD_S = 0.1
FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "temperature.gpu")
# The reasons' field was renamed in driver 535; the older name is tried after it.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
REASONS = {  # nvmlClocksEventReasons bits
    0x1: "idle",
    0x2: "applications clocks",
    0x4: "sw power cap",
    0x8: "hw slowdown",
    0x10: "sync boost",
    0x20: "sw thermal",
    0x40: "hw thermal",
    0x80: "hw power brake",
    0x100: "display clocks",
}


def smi_device(device_index: int, environ=os.environ) -> str:
    """The ``nvidia-smi -i`` id of torch's CUDA device ``device_index``: its entry of
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID) where that is set."""
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[device_index] if device_index < len(visible) else str(device_index)


def limit_reasons(mask: int) -> list[str]:
    """The names of the clock-limit reasons in an ``nvmlClocksEventReasons`` mask."""
    return [name for bit, name in REASONS.items() if mask & bit] + (
        [f"0x{mask & ~sum(REASONS):x}"] if mask & ~sum(REASONS) else []
    )


def parse_sample(line: str) -> dict:
    """One line of ``nvidia-smi --query-gpu=FIELDS,REASON --format=csv,noheader,nounits``."""
    sm, max_sm, mem, power, temp, reasons = (v.strip() for v in line.split(","))
    return {
        "sm_mhz": float(sm),
        "max_sm_mhz": float(max_sm),
        "mem_mhz": float(mem),
        "power_w": float(power),
        "temp_c": float(temp),
        "reasons": int(reasons, 16),
    }


def summarize(samples: list[dict]) -> dict:
    if not samples:
        return {}
    mask = 0
    for s in samples:
        mask |= s["reasons"]
    return {
        "sm_mhz": median(s["sm_mhz"] for s in samples),
        "max_sm_mhz": max(s["max_sm_mhz"] for s in samples),
        "mem_mhz": median(s["mem_mhz"] for s in samples),
        "peak_power_w": max(s["power_w"] for s in samples),
        "peak_temp_c": max(s["temp_c"] for s in samples),
        "limits": limit_reasons(mask & ~0x1),  # idle: between the timed calls
        "samples": len(samples),
    }


def limits_text(summary: dict) -> str:
    """A summary's clock limits for a table cell: their names, "none", or "-" (not sampled)."""
    return ", ".join(summary.get("limits", [])) or ("none" if summary else "-")


def describe(summary: dict) -> str:
    """A summary in one line: the median SM clock against its maximum, and the limits."""
    if not summary:
        return "SM clock not sampled"
    sm, top, watts = summary["sm_mhz"], summary["max_sm_mhz"], summary["peak_power_w"]
    return f"SM {sm:.0f} MHz of {top:.0f}, peak {watts:.0f} W, limits: {limits_text(summary)}"


def clocks_now(device_index: int = 0) -> dict:
    """One sample, summarized: the clocks at this moment ({} without nvidia-smi)."""
    probe = ClockProbe(device_index)
    probe.sample()
    return probe.summary()


class ClockProbe:
    """Samples ``nvidia-smi`` while its block runs (see the module docstring)."""

    def __init__(self, device_index: int = 0):
        self.device_index = device_index
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._query = _query_command(device_index)

    def __enter__(self) -> ClockProbe:
        if self._query is not None:
            self.sample()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()

    def summary(self) -> dict:
        return summarize(self.samples)

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            self.sample()

    def sample(self) -> None:
        """One sample now; none without nvidia-smi, or where a field reads [N/A]."""
        if self._query is None:
            return
        out = subprocess.run(self._query, capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            with contextlib.suppress(ValueError):
                self.samples.append(parse_sample(out.stdout.strip().splitlines()[0]))


def _query_command(device_index: int) -> list[str] | None:
    """The ``nvidia-smi`` query this driver answers, or None (no GPU tools here)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    for reasons in REASON_FIELDS:
        cmd = [
            smi, "-i", smi_device(device_index), f"--query-gpu={','.join((*FIELDS, reasons))}",
            "--format=csv,noheader,nounits",
        ]  # fmt: skip
        if subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0:
            return cmd
    return None
