"""Kernel tests run the Triton kernels on the GPU, or on CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it
is set here, before any test module imports a kernel.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
