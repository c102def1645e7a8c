"""The ``segment`` backend's plugin: its spec and hook implementation.

Pages appended into large segment files on local disk, an in-memory index rebuilt from
the segments at start-up, space reclaimed a whole segment at a time
(:mod:`kvtier.backends.segment.backend`; the format is
:mod:`kvtier.backends.segment.format`). Declaring it imports only the config model.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.backends.segment.config import SegmentConfig
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec, Feature
from kvtier.plugins.hookspecs import hookimpl

__all__ = ["SEGMENT_SPEC", "SegmentConfig"]

SEGMENT_SPEC = BackendSpec(
    name="segment",
    factory="kvtier.backends.segment.backend:SegmentBackend",
    config_model=SegmentConfig,
    description="Pages appended into large segment files on local disk: a batch is one "
    "vectored write and comes back in one read; whole-segment reclamation.",
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
)


@hookimpl
def kvtier_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Declare the ``segment`` backend."""
    register(SEGMENT_SPEC)
