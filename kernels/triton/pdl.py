"""Programmatic dependent launch (PDL) between the Triton kernels of a step.

A decode step of a few requests is a chain of short kernels (ten a layer at
batch 1), and each one pays a launch and a ramp-up before its first byte moves.
On Hopper and later a kernel launched with PDL is scheduled while the kernel
before it on the stream is still running: its programs become resident, wait in
``gdc_wait`` until that kernel has completed and its writes are visible, and
then run, so the launch is hidden behind the previous kernel's tail. Launches
captured into a CUDA graph keep this (programmatic edges).

Every kernel launched with PDL here opens with ``wait_previous_kernel(PDL)``, in
every program, before it reads or writes anything:

- it waits for the previous kernel on the stream, then, in a short kernel, lets
  the next kernel launch (``gdc_launch_dependents``). So at most one kernel
  waits ahead. A kernel that streams memory at full rate (``streaming``: the
  linears, split-KV attention, the KV store) does not: the next kernel then
  launches as its programs exit. Programs waiting beside such a kernel slow it
  down: 36 layers of one-row linears took 3.77 ms so against 3.49 ms without
  PDL and 3.51 ms launching at exit (``benchmarks/decode_linears.py``, H200);
- a kernel completes only after its wait returned, so it completes after the
  kernel before it, and stream order holds across the whole chain, also for a
  kernel that reads the output of one several launches back. Kernels that are
  not launched with PDL (cuBLAS, FlashInfer, torch) wait for the previous
  kernel's completion as usual.

``launch_options(device)`` gives a launch's ``PDL`` constexpr and Triton's
``launch_pdl`` flag: on for CUDA devices of compute capability 9.0 and up, off
on older GPUs, on the CPU interpreter, and with ``SPLITSERVE_PDL=0`` (or
``set_enabled(False)``, which a benchmark uses to compare; graphs captured
before keep the launches they were captured with).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None

_enabled = os.environ.get("SPLITSERVE_PDL", "1") != "0" and gdc_wait is not None


def set_enabled(enabled: bool) -> None:
    """Turn PDL on or off for launches from now on (where the device supports it)."""
    global _enabled
    _enabled = enabled and gdc_wait is not None


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` now use PDL."""
    return _enabled and device.type == "cuda" and _supports_pdl(device.index)


def launch_options(device: torch.device, streaming: bool = False) -> dict:
    """``kernel[grid](..., **launch_options(x.device))``: the ``PDL`` constexpr and,
    when on, Triton's ``launch_pdl``. ``streaming``: the kernel streams memory at full
    rate, so the next kernel launches only as its programs exit (module docstring)."""
    if not enabled(device):
        return _OFF
    return _AT_EXIT if streaming else _EARLY


_OFF = {"PDL": 0}
_EARLY = {"PDL": 1, "launch_pdl": True}  # wait, then let the next kernel launch
_AT_EXIT = {"PDL": 2, "launch_pdl": True}  # wait; the next launches as programs exit


@functools.cache
def _supports_pdl(index: int | None) -> bool:
    if index is None:
        index = torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def wait_previous_kernel(PDL: tl.constexpr):
    """The first statement of a PDL kernel (module docstring); nothing when PDL is 0."""
    if PDL:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()
