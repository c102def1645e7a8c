"""kvtier: tiered, pluggable KV-cache storage for LLM serving engines.

Importing kvtier loads no plugin: the registry is built on first use
(:func:`kvtier.plugins.manager.default_registry`, or through :class:`TieredCache`).
"""

from __future__ import annotations

from kvtier._version import __version__
from kvtier.cache import (
    BackupHandle,
    CacheOptions,
    PrefetchHandle,
    TieredCache,
    open_cache,
)
from kvtier.core.capabilities import ResolvedPlan, resolve
from kvtier.core.config import (
    DEFAULT_BACKEND,
    EngineConfig,
    load_engine_config,
    parse_extra_config,
    validate_model,
)
from kvtier.core.device_pool import DevicePool, MHADevicePool, MLADevicePool, TorchDevicePool
from kvtier.core.envelope import ENVELOPE_BYTES, Rejection
from kvtier.core.errors import (
    BackendUnavailableError,
    CacheClosedError,
    ConfigError,
    DuplicatePluginError,
    ExtraConfigSyntaxError,
    IntegrityError,
    InvalidFieldError,
    InvalidKeyError,
    KvtierError,
    MissingFieldError,
    NotAnObjectError,
    PageError,
    PluginError,
    PoolExhaustedError,
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
from kvtier.core.keys import Namespace, PageKeyer, external_key, validate_key
from kvtier.core.layout import Layout
from kvtier.core.pagestore import PageStore
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
from kvtier.core.storage import BackendContext, PageBuffers, StorageBackend
from kvtier.plugins.hookspecs import hookimpl, hookspec

__all__ = [
    "ALL_ATTENTION",
    "ALL_LAYOUTS",
    "ALL_OPERATIONS",
    "DEFAULT_BACKEND",
    "ENVELOPE_BYTES",
    "AttentionKind",
    "BackendContext",
    "BackendSpec",
    "BackendUnavailableError",
    "BackupHandle",
    "CacheClosedError",
    "CacheOptions",
    "Capability",
    "ConfigError",
    "DevicePool",
    "DuplicatePluginError",
    "EngineConfig",
    "Extent",
    "ExtraConfigSyntaxError",
    "Feature",
    "HostPool",
    "IOBackend",
    "IOBackendSpec",
    "IntegrityError",
    "InvalidFieldError",
    "InvalidKeyError",
    "KVGeometry",
    "KvtierError",
    "Layout",
    "MHADevicePool",
    "MLADevicePool",
    "MissingFieldError",
    "Namespace",
    "NotAnObjectError",
    "Operation",
    "PageBuffers",
    "PageError",
    "PageKeyer",
    "PageStore",
    "PluginError",
    "PoolExhaustedError",
    "PrefetchHandle",
    "Rejection",
    "ResolvedPlan",
    "StorageBackend",
    "StorageError",
    "TieredCache",
    "TorchDevicePool",
    "TransferError",
    "TransferPlan",
    "UnknownKeyError",
    "UnknownNameError",
    "UnsupportedCombinationError",
    "__version__",
    "external_key",
    "hookimpl",
    "hookspec",
    "load_engine_config",
    "open_cache",
    "parse_extra_config",
    "resolve",
    "validate_key",
    "validate_model",
]
