"""Triton kernels of the GPU fast path; each matches a plain-torch reference in ``kernels/``.

Import submodules directly (``from splitserve.kernels.triton.rmsnorm import rms_norm``):
importing this package does not import triton, so CPU-only code never pays for it.
"""
