"""The ``file`` backend's plugin: its spec and hook implementation.

One file per page under a root directory, on local disk (:mod:`kvtier.backends.file.backend`;
the on-disk scheme is :mod:`kvtier.backends.filestore`). Declaring it imports only the
config model.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.backends.file.config import FileConfig, validate_file_plan
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec, Feature
from kvtier.plugins.hookspecs import hookimpl

__all__ = ["FILE_SPEC", "FileConfig", "validate_file_plan"]

FILE_SPEC = BackendSpec(
    name="file",
    factory="kvtier.backends.file.backend:FileBackend",
    config_model=FileConfig,
    description="One file per page on local disk: atomic publish, LRU capacity, "
    "vectored I/O straight from host-pool extents.",
    layouts=ALL_LAYOUTS,
    attention=ALL_ATTENTION,
    operations=ALL_OPERATIONS,
    features=frozenset(
        {
            Feature.PERSISTENT,
            Feature.SHARED_PROCESSES,
            Feature.ZERO_COPY,
            Feature.EXACT_EVICTION,
            Feature.REPORTS_SPACE,
        }
    ),
    validate_plan=validate_file_plan,
)


@hookimpl
def kvtier_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Declare the ``file`` backend."""
    register(FILE_SPEC)
