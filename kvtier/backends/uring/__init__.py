"""The ``uring`` backend's plugin: its spec and hook implementation.

Pages in the ``file`` backend's on-disk format (:mod:`kvtier.backends.filestore`), moved
in batches through io_uring (:mod:`kvtier.backends.uring.backend`, over the engine in
:mod:`kvtier.backends.uring.ring`). Declaring the backend imports nothing optional: only
the config model and the availability probe, which imports liburing when it runs.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.backends.uring.config import UringConfig, validate_uring_plan
from kvtier.backends.uring.probe import INSTALL_HINT, probe_io_uring
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec, Feature
from kvtier.plugins.hookspecs import hookimpl

__all__ = ["URING_SPEC", "UringConfig", "probe_io_uring", "validate_uring_plan"]

URING_SPEC = BackendSpec(
    name="uring",
    factory="kvtier.backends.uring.backend:UringBackend",
    config_model=UringConfig,
    description="Local files in the file backend's format, moved in batches through "
    "io_uring (liburing) with a configurable queue depth; optional O_DIRECT.",
    requires=("liburing",),
    install_hint=INSTALL_HINT,
    probe=probe_io_uring,
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
    validate_plan=validate_uring_plan,
)


@hookimpl
def kvtier_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Declare the ``uring`` backend (nothing optional is imported here)."""
    register(URING_SPEC)
