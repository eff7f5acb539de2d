"""From the repository root, ``import kernels`` is the installed distribution (which
transformers 5.25+ imports), not the repository's ``kernels/`` folder, once splitserve is
imported (``splitserve/import_path.py``)."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHOW = "import kernels; print(kernels.__file__)"


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_repository_folder_shadows_kernels_without_splitserve():
    assert Path(_run(SHOW)) == ROOT / "kernels" / "__init__.py"  # what the fix is for


def _installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason="the kernels distribution is not installed")
def test_splitserve_imports_the_installed_kernels_first():
    shown = Path(_run("import splitserve; " + SHOW))
    assert shown != ROOT / "kernels" / "__init__.py"
    assert shown.parent.name == "kernels" and "site-packages" in shown.parts
