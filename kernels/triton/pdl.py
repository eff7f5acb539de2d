"""Programmatic dependent launch (PDL) between the Triton kernels of a step.

A decode step of a few requests is a chain of short kernels (ten a layer at
batch 1), and each one pays a launch and a ramp-up before its first byte moves.
On Hopper and later a kernel launched with PDL may be scheduled before the
kernel ahead of it on the stream has finished: its programs become resident,
wait in ``gdc_wait`` until that kernel has completed and its writes are
visible, and then run, so the launch hides behind the previous kernel. The
previous kernel decides when: at its programs' exit, or as soon as it starts
if it calls ``gdc_launch_dependents``. CUDA graph capture keeps these edges.

Every kernel here opens with ``wait_previous_kernel(PDL)``, in every program,
before it reads or writes anything. ``PDL`` holds two flags
(``launch_options``):

- ``WAIT``, for a kernel launched with PDL (``starts_early``): wait for the
  previous kernel. A kernel completes only after its wait returned, so stream
  order holds across the chain, also for a kernel that reads the output of one
  several launches back; kernels launched without PDL (cuBLAS, FlashInfer,
  torch, and ours with ``starts_early=False``) wait for the previous kernel's
  completion as usual.
- ``LAUNCH_NEXT``, for a short kernel (``lets_next_start``): then let the next
  kernel launch. Since it comes after the wait, at most one kernel waits ahead.

Programs waiting beside a kernel that streams memory slow it down (H200,
``benchmarks/decode_linears.py`` and ``engine_loop.py``): 36 layers of one-row
linears took 3.77 ms with each letting the next start at once, against 3.49 ms
without PDL. So only kernels that follow a short kernel start early: the
linears (after a norm, SiLU or attention), and split-KV attention (after the
q/k norm) and its merge up to 16 requests (at 64 they cost a step 0.19 ms).
Only short kernels let the next one start: norms, SiLU, q/k norm and rotary,
the merge, the split-K sum. The linears and split-KV attention let the next
kernel launch as their programs exit.

PDL is on for CUDA devices of compute capability 9.0 and up; off on older GPUs,
on the CPU interpreter, and with ``SPLITSERVE_PDL=0`` (or ``set_enabled(False)``,
which a benchmark uses to compare; graphs captured before keep the launches
they were captured with).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton.device import capability

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
    return _enabled and device.type == "cuda" and capability(device) >= (9, 0)


def launch_options(device: torch.device, *, starts_early: bool, lets_next_start: bool) -> dict:
    """``kernel[grid](..., **launch_options(x.device, ...))``: the ``PDL`` constexpr and,
    for ``starts_early``, Triton's ``launch_pdl`` (module docstring).

    ``starts_early``: launch with PDL; for a kernel that follows a short one.
    ``lets_next_start``: let the next kernel launch as soon as this one starts; for a
    short kernel.
    """
    if not enabled(device):
        return _OFF
    flags = (WAIT if starts_early else 0) | (LAUNCH_NEXT if lets_next_start else 0)
    return {"PDL": flags, "launch_pdl": True} if starts_early else {"PDL": flags}


# The flags of ``PDL``; ``wait_previous_kernel`` spells them as literals (Triton's
# interpreter cannot combine a launch's int with a constexpr global).
WAIT = 1  # launched with PDL: wait for the previous kernel first
LAUNCH_NEXT = 2  # let the next kernel launch now
_OFF = {"PDL": 0}


@triton.jit
def wait_previous_kernel(PDL: tl.constexpr):
    """The first statement of every kernel here (module docstring); nothing when PDL is 0."""
    if PDL & 1:  # WAIT
        gdc_wait()
    if PDL & 2:  # LAUNCH_NEXT
        gdc_launch_dependents()
