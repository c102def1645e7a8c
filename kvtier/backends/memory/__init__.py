"""The ``memory`` backend's plugin: its spec and hook implementation.

The in-process reference backend, a bounded dict of pages with LRU eviction
(:mod:`kvtier.backends.memory.backend`). Declaring it imports only the config model.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.backends.memory.config import MemoryConfig
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec, Feature
from kvtier.plugins.hookspecs import hookimpl

__all__ = ["MEMORY_SPEC", "MemoryConfig"]

MEMORY_SPEC = BackendSpec(
    name="memory",
    factory="kvtier.backends.memory.backend:MemoryBackend",
    config_model=MemoryConfig,
    description="In-process pages with LRU eviction; the reference implementation.",
    layouts=ALL_LAYOUTS,
    attention=ALL_ATTENTION,
    operations=ALL_OPERATIONS,
    features=frozenset({Feature.EXACT_EVICTION, Feature.REPORTS_SPACE}),
)


@hookimpl
def kvtier_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Declare the ``memory`` backend."""
    register(MEMORY_SPEC)
