"""The file backends' compiled module (``_pageio``), loaded once, or why it is not used.

``_pageio`` is a small C extension, compiled from ``_pageio_src/`` with the package where
a C compiler and Python's headers are there (see ``hatch_build.py``). It is used only
when it loads, was built for the envelope layout :mod:`kvtier.core.envelope_layout`
declares, and binds xxHash (from the ``xxhash`` package or the system's libxxhash, 0.8
or later); otherwise :data:`pageio` is None and :data:`MISSING` says why. Two modules
use it: :mod:`~kvtier.backends.filestore.compiled` (the per-page loop) and
:mod:`~kvtier.backends.filestore.publish` (the publish protocol's steps); this one only
loads it, so that both can without importing each other.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvtier.core.envelope_layout import disagreement

__all__ = ["MISSING", "pageio"]

#: The compiled module, or None where it is not used (then MISSING says why).
pageio: Any = None
MISSING: str | None = None
try:
    pageio = importlib.import_module("kvtier.backends.filestore._pageio")
except ImportError as exc:  # built without a C compiler: the Python steps
    MISSING = str(exc)
else:
    # xxHash as the xxhash package carries it (SIMD dispatch), else the system's.
    import xxhash._xxhash

    MISSING = disagreement(pageio)  # built for another envelope layout: not used
    if MISSING is None and not any(
        pageio.bind(library) for library in (xxhash._xxhash.__file__, "libxxhash.so.0")
    ):
        MISSING = "no loaded xxHash library exports the XXH3 functions"
    if MISSING is not None:
        pageio = None
