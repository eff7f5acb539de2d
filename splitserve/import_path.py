"""The ``kernels`` distribution ahead of the repository's ``kernels/`` folder.

Run from the repository root (``python -m pytest``, ``python -m splitserve...``), the
working directory comes first on ``sys.path``, and its top-level ``kernels/`` folder
(installed as ``splitserve.kernels``) shadows the ``kernels`` distribution, which
transformers 5.25+ depends on and imports with its models: each such import would fail.
``unshadow_kernels`` imports that distribution first, with the root off the path for
the moment, so ``import kernels`` means it from then on. Nothing of the project imports
a bare ``kernels``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def unshadow_kernels() -> None:
    if "kernels" in sys.modules or not _shadowed():
        return
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != ROOT]
    try:
        importlib.import_module("kernels")
    except ImportError:  # not installed: transformers does not import it then
        pass
    finally:
        sys.path[:] = saved


def _shadowed() -> bool:
    """Whether ``import kernels`` would find the repository's folder."""
    try:
        spec = importlib.util.find_spec("kernels")
    except (ImportError, ValueError):
        return False
    return (
        spec is not None
        and spec.origin is not None
        and (Path(spec.origin).resolve().parent == ROOT / "kernels")
    )
