"""kvtier: tiered, pluggable KV-cache storage for LLM serving engines.

This face is for **embedding kvtier in an engine**: open a :class:`TieredCache` from one
config over the engine's device pool, back pages up, prefetch and load them, read its
stats. The other audiences have faces of their own:

- **engine-adapter authors** who drive their own pools build from a resolved plan with
  the one construction path: :mod:`kvtier.adapters` (``resolve``, ``open_store``,
  ``PageStore``, the builders);
- **writing a storage backend**, **writing an IO backend** or a policy: declare it with
  :data:`hookimpl` and a spec, implement the contract: :mod:`kvtier.plugins` (specs,
  contracts, features), proved by the conformance kit in :mod:`kvtier.testing`;
- **errors**, for everyone: one hierarchy under :class:`KvtierError`, every class in
  :mod:`kvtier.errors`.

Importing kvtier loads no plugin: the registry is built on first use.
"""

from __future__ import annotations

from kvtier._version import __version__
from kvtier.cache import BackupHandle, CacheOptions, PrefetchHandle, TieredCache, open_cache
from kvtier.core.config import EngineConfig, load_engine_config
from kvtier.core.device_pool import DevicePool, MHADevicePool, MLADevicePool, TorchDevicePool
from kvtier.core.errors import ConfigError, KvtierError, StorageError
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.layout import Layout
from kvtier.core.specs import Operation
from kvtier.plugins.hookspecs import hookimpl

__all__ = [  # noqa: RUF022 - grouped by audience, as the docstring says
    "__version__",
    # embedding kvtier in an engine: the cache and its handles
    "TieredCache",
    "open_cache",
    "CacheOptions",
    "BackupHandle",
    "PrefetchHandle",
    # its config and what it describes
    "EngineConfig",
    "load_engine_config",
    "KVGeometry",
    "AttentionKind",
    "Layout",
    "Operation",
    # the engine's device pool
    "DevicePool",
    "MHADevicePool",
    "MLADevicePool",
    "TorchDevicePool",
    # declaring a plugin (its contracts: kvtier.plugins)
    "hookimpl",
    # errors (all of them: kvtier.errors)
    "KvtierError",
    "ConfigError",
    "StorageError",
]
