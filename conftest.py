"""Before any test imports transformers: the ``kernels`` distribution it imports, not the
repository's ``kernels/`` folder (``splitserve/import_path.py``)."""

import splitserve  # noqa: F401
