"""An engine's ``torch.profiler`` window, started and stopped on request.

With ``torch_profiler_dir`` set in the engine's config, ``start`` begins recording
the host's operators and, on a GPU, the device's kernels (those replayed from CUDA
graphs included), and ``stop`` writes the window as a Chrome trace,
``<dir>/<role>-<pid>-<n>.trace.json.gz`` (open it in Perfetto or
``chrome://tracing``; ``benchmarks/trace_steps.py`` reads the engine's steps out of
it). The server's ``POST /start_profile`` and ``POST /stop_profile`` reach every
engine this way, as vLLM's and SGLang's do; ``LLM.start_profile`` the offline one.

Each engine step is one range in the trace, ``engine_step[<kind> b<requests>]``
(``step_range``), so a step's kernels and the host's work around them can be told
apart by the batch they served.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import logging
import os
import time
from pathlib import Path

import torch

from splitserve.errors import InvalidRequestError
from splitserve.workers.engine.step_times import step_kind

logger = logging.getLogger(__name__)

STEP_RANGE = "engine_step"


class ProfilerOff(InvalidRequestError):
    """Profiling was asked of an engine without ``torch_profiler_dir``."""


class TorchProfiler:
    def __init__(self, directory: str | None, role: str, device: torch.device):
        self.directory = directory
        self.role = role
        self.device = device
        self._profile: torch.profiler.profile | None = None
        self._windows = itertools.count(1)

    def start(self) -> None:
        self._check_on()
        if self._profile is not None:
            raise InvalidRequestError(f"the {self.role} engine's profile is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()

    def stop(self) -> str:
        """End the window and write its trace; returns the trace's path."""
        self._check_on()
        profile, self._profile = self._profile, None
        if profile is None:
            raise InvalidRequestError(f"the {self.role} engine has no profile running")
        started = time.perf_counter()
        profile.__exit__(None, None, None)
        stopped = time.perf_counter()
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        name = f"{self.role}-{os.getpid()}-{next(self._windows)}.trace.json.gz"
        path = str(Path(self.directory) / name)
        profile.export_chrome_trace(path)
        logger.info(
            "profile: stopped in %.1f s, trace written in %.1f s: %s",
            stopped - started, time.perf_counter() - stopped, path,
        )  # fmt: skip
        return path

    def close(self) -> None:
        """Drop a window still open (the engine is closing): nothing is written."""
        if self._profile is not None:
            with contextlib.suppress(Exception):
                self._profile.__exit__(None, None, None)
            self._profile = None

    def step_range(self, num_requests: int, num_prompt_requests: int):
        """The range one engine step's host work runs in, while a window is open (named
        by the step's kind, ``step_times.step_kind``, and its requests)."""
        if self._profile is None:
            return contextlib.nullcontext()
        kind = step_kind(num_requests, num_prompt_requests)
        return torch.profiler.record_function(f"{STEP_RANGE}[{kind} b{num_requests}]")

    def _check_on(self) -> None:
        if self.directory is None:
            raise ProfilerOff(
                f"profiling is off on the {self.role} engine: set the engine's "
                "torch_profiler_dir (`splitserve serve --torch-profiler-dir DIR`)"
            )


def read_trace(path: str | Path) -> list[dict]:
    """The events of a trace ``stop`` wrote."""
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def step_names(events: list[dict]) -> list[str]:
    """The engine steps' range names, in the trace's order (the host's ranges: on a GPU
    Kineto repeats each on the device's row)."""
    return [
        e["name"]
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith(STEP_RANGE + "[")
    ]
