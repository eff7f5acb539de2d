"""Programmatic dependent launch (PDL) between the Triton kernels of a step.

A decode step of a few requests is a chain of short kernels (six a layer at
batch 1), and each one pays a launch and a ramp-up before its first byte moves.
On Hopper and later a kernel launched with PDL may be scheduled before the
kernel ahead of it on the stream has finished: its programs become resident,
wait in ``gdc_wait`` until that kernel has completed and its writes are
visible, and then run, so the launch hides behind the previous kernel. The
previous kernel decides when: at its programs' exit, or as soon as it starts
if it calls ``gdc_launch_dependents``. CUDA graph capture keeps these edges.

Every kernel here opens with ``wait_previous_kernel(PDL)``, in every program,
before it reads or writes anything. ``PDL`` holds three flags
(``launch_options``):

- ``WAIT``, for a kernel launched with PDL (``starts_early``): wait for the
  previous kernel. A kernel completes only after its wait returned, so stream
  order holds across the chain, also for a kernel that reads the output of one
  several launches back; kernels launched without PDL (cuBLAS, FlashInfer,
  torch, and ours with ``starts_early=False``) wait for the previous kernel's
  completion as usual.
- ``LAUNCH_NEXT``, for a short kernel (``lets_next_start``): then let the next
  kernel launch. Since it comes after the wait, at most one kernel waits ahead.
- ``AFTER_LOOP``, for a long kernel (``after_loop``): ``loop_done(PDL)``, after
  its main loop, lets the next kernel launch. Its last programs are resident by
  then, so the next kernel's take no slot from them; the launch overlaps their
  reductions, stores and exit. The linears and split-KV attention (up to 16
  requests) do so: a small decode step was faster so than with the launch at
  their exit.

Programs waiting beside a kernel that streams memory slow it down: a chain of
one-row linears each letting the next start at once was slower than without
PDL. So only kernels that follow a short kernel start early: the linears (after
a norm, SiLU or attention), and split-KV attention (after the qkv linear or the
q/k norm) and its merge up to 16 requests (at 64 they made a step slower).
Only short kernels let the next one start at once: norms, SiLU, q/k norm and
rotary, the merge, the split-K sum; the linears and split-KV attention do after
their main loop. One exception: the one-row qkv projection lets split-KV
attention launch at once, since that kernel then loads its first KV tile before
its wait (``decode_attention.py``). An L2 prefetch of a linear's first weight
tiles before its wait, or of the next linear's first tiles after its own loop,
did not help. Figures: ``docs/perf/TUNING.md``.

PDL is on for CUDA devices of compute capability 9.0 and up; off on older GPUs,
on the CPU interpreter, and with ``SPLITSERVE_PDL=0`` (``splitserve/config.py``;
or ``set_enabled(False)``, which a benchmark uses to compare; graphs captured
before keep the launches they were captured with).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.config import env
from splitserve.kernels.triton.device import capability

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a Triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None

_enabled = env("SPLITSERVE_PDL") != "0" and gdc_wait is not None


def set_enabled(enabled: bool) -> None:
    """Turn PDL on or off for launches from now on (where the device supports it)."""
    global _enabled
    _enabled = enabled and gdc_wait is not None


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` now use PDL."""
    return _enabled and device.type == "cuda" and capability(device) >= (9, 0)


def launch_options(
    device: torch.device, *, starts_early: bool, lets_next_start: bool, after_loop: bool = False
) -> dict:
    """``kernel[grid](..., **launch_options(x.device, ...))``: the ``PDL`` constexpr and,
    for ``starts_early``, Triton's ``launch_pdl`` (module docstring).

    ``starts_early``: launch with PDL; for a kernel that follows a short one.
    ``lets_next_start``: let the next kernel launch as soon as this one starts; for a
    short kernel.
    ``after_loop``: let it launch at this kernel's ``loop_done``; for a long kernel.
    """
    if not enabled(device):
        return _OFF
    flags = (WAIT if starts_early else 0) | (LAUNCH_NEXT if lets_next_start else 0)
    flags |= AFTER_LOOP if after_loop else 0
    return {"PDL": flags, "launch_pdl": True} if starts_early else {"PDL": flags}


# The flags of ``PDL``; ``wait_previous_kernel`` spells them as literals (Triton's
# interpreter cannot combine a launch's int with a constexpr global).
WAIT = 1  # launched with PDL: wait for the previous kernel first
LAUNCH_NEXT = 2  # let the next kernel launch now
AFTER_LOOP = 4  # let the next kernel launch once this one's main loop is done
_OFF = {"PDL": 0}


@triton.jit
def wait_previous_kernel(PDL: tl.constexpr):
    """The first statement of every kernel here (module docstring); nothing when PDL is 0."""
    if PDL & 1:  # WAIT
        gdc_wait()
    if PDL & 2:  # LAUNCH_NEXT
        gdc_launch_dependents()


@triton.jit
def loop_done(PDL: tl.constexpr):
    """Called by a long kernel after its main loop: with ``AFTER_LOOP``, let the next
    kernel launch now (its programs take no slot from this one's, all resident by now)."""
    if PDL & 4:  # AFTER_LOOP
        gdc_launch_dependents()
