"""kvtier: tiered, pluggable KV-cache storage for LLM serving engines.

The names here are grouped by who needs them:

- **embedding kvtier in an engine**: open a :class:`TieredCache` from one config; an
  engine adapter that drives its own pools resolves the plan and builds from it with the
  one construction path (:func:`resolve`, then :func:`open_page_store` and friends);
- **writing a storage backend**: declare it with :data:`hookimpl` and a
  :class:`BackendSpec`, implement :class:`StorageBackend`;
- **writing an IO backend**: declare what it executes with an :class:`IOBackendSpec`,
  implement :class:`IOBackend`;
- **errors**, for everyone: one hierarchy under :class:`KvtierError`.

Everything else lives in its own module (``kvtier.core.keys``, ``kvtier.core.envelope``,
...) and is not part of this face. Importing kvtier loads no plugin: the registry is built
on first use (:func:`kvtier.plugins.manager.default_registry`, or through TieredCache).
"""

from __future__ import annotations

from kvtier._version import __version__
from kvtier.cache import BackupHandle, CacheOptions, PrefetchHandle, TieredCache, open_cache
from kvtier.core.capabilities import (
    ResolvedPlan,
    build_backend,
    build_host_pool,
    build_io_backend,
    open_page_store,
    resolve,
)
from kvtier.core.config import EngineConfig, load_engine_config
from kvtier.core.device_pool import DevicePool, MHADevicePool, MLADevicePool, TorchDevicePool
from kvtier.core.errors import (
    BackendUnavailableError,
    CacheClosedError,
    ConfigError,
    DuplicatePluginError,
    ExtentError,
    ExtraConfigSyntaxError,
    IntegrityError,
    InvalidFieldError,
    InvalidKeyError,
    KvtierError,
    MissingFieldError,
    NotAnObjectError,
    OperationNotDeclaredError,
    PageError,
    PluginError,
    PoolExhaustedError,
    PrometheusMissingError,
    StorageError,
    TransferError,
    UnknownKeyError,
    UnknownNameError,
    UnsupportedCombinationError,
)
from kvtier.core.extents import Extent
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import IOBackend, TransferPlan
from kvtier.core.layout import Layout
from kvtier.core.pagestore import PageMemory, PageStore
from kvtier.core.specs import (
    ALL_ATTENTION,
    ALL_LAYOUTS,
    ALL_OPERATIONS,
    BackendSpec,
    Capability,
    Feature,
    IOBackendSpec,
    Operation,
)
from kvtier.core.storage import BackendContext, Counters, PageBuffers, StorageBackend
from kvtier.plugins.hookspecs import hookimpl

__all__ = [  # noqa: RUF022 - grouped by audience, as the docstring says
    "__version__",
    # embedding kvtier in an engine
    "AttentionKind",
    "BackupHandle",
    "CacheOptions",
    "DevicePool",
    "EngineConfig",
    "KVGeometry",
    "Layout",
    "MHADevicePool",
    "MLADevicePool",
    "Operation",
    "PageMemory",
    "PageStore",
    "PrefetchHandle",
    "ResolvedPlan",
    "TieredCache",
    "TorchDevicePool",
    "build_backend",
    "build_host_pool",
    "build_io_backend",
    "load_engine_config",
    "open_cache",
    "open_page_store",
    "resolve",
    # writing a storage backend
    "ALL_ATTENTION",
    "ALL_LAYOUTS",
    "ALL_OPERATIONS",
    "BackendContext",
    "BackendSpec",
    "Counters",
    "Extent",
    "Feature",
    "PageBuffers",
    "StorageBackend",
    "hookimpl",
    # writing an IO backend
    "Capability",
    "HostPool",
    "IOBackend",
    "IOBackendSpec",
    "TransferPlan",
    # errors
    "BackendUnavailableError",
    "CacheClosedError",
    "ConfigError",
    "DuplicatePluginError",
    "ExtentError",
    "ExtraConfigSyntaxError",
    "IntegrityError",
    "InvalidFieldError",
    "InvalidKeyError",
    "KvtierError",
    "MissingFieldError",
    "NotAnObjectError",
    "OperationNotDeclaredError",
    "PageError",
    "PluginError",
    "PoolExhaustedError",
    "PrometheusMissingError",
    "StorageError",
    "TransferError",
    "UnknownKeyError",
    "UnknownNameError",
    "UnsupportedCombinationError",
]
