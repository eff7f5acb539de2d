"""Kernel tests run the Triton kernels on the GPU, or on CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it
is set here, before any test module imports a kernel. Tests marked ``gpu``
(large shapes, FP8 rounding) are skipped without CUDA even when selected.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: needs CUDA (the interpreter is too slow for it)")
    for item in items:
        if "gpu" in item.keywords and HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
