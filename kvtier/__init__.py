"""kvtier: tiered, pluggable KV-cache storage for LLM serving engines."""

from __future__ import annotations

from kvtier.core.errors import (
    BackendUnavailableError,
    ConfigError,
    IntegrityError,
    KvtierError,
    PluginError,
    StorageError,
    UnsupportedCombinationError,
)
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.layout import Layout
from kvtier.core.specs import BackendSpec, Capability, Feature, IOBackendSpec, Operation
from kvtier.core.storage import BackendContext, PageBuffers, StorageBackend
from kvtier.plugins.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = [
    "AttentionKind",
    "BackendContext",
    "BackendSpec",
    "BackendUnavailableError",
    "Capability",
    "ConfigError",
    "Feature",
    "IOBackendSpec",
    "IntegrityError",
    "KVGeometry",
    "KvtierError",
    "Layout",
    "Operation",
    "PageBuffers",
    "PluginError",
    "StorageBackend",
    "StorageError",
    "UnsupportedCombinationError",
    "__version__",
    "hookimpl",
    "hookspec",
]
