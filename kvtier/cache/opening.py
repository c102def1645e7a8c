"""Open: resolve a config into a plan, check the engine's device pool, build the cache's parts.

Everything is checked before anything is allocated, and built through the one
construction path (:mod:`kvtier.core.capabilities`), as every kvtier consumer builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.cache.options import CacheOptions
from kvtier.core.capabilities import ResolvedPlan, build_host_pool, build_io_backend, resolve
from kvtier.core.config import EngineConfig, load_engine_config
from kvtier.core.errors import InvalidFieldError
from kvtier.core.host_pool import HostPool
from kvtier.core.io import IOBackend
from kvtier.storage import StorageChain, open_store

if TYPE_CHECKING:
    from kvtier.plugins.registry import Registry

__all__ = ["OpenedParts", "open_parts"]


@dataclass(frozen=True)
class OpenedParts:
    """A resolved plan and the parts built from it, ready to become a TieredCache."""

    plan: ResolvedPlan
    io_backend: IOBackend
    host_pool: HostPool
    page_store: StorageChain


def open_parts(
    config: ResolvedPlan | EngineConfig | Mapping[str, Any] | str,
    device_pool: Any,
    options: CacheOptions,
    registry: Registry | None,
) -> OpenedParts:
    """Resolve ``config`` (unless it is a plan), check ``device_pool``, build the parts."""
    if isinstance(config, ResolvedPlan):
        plan = config
    else:
        cfg = config if isinstance(config, EngineConfig) else load_engine_config(config)
        if registry is None:
            from kvtier.plugins.manager import default_registry

            registry = default_registry()
        plan = resolve(cfg, registry.backends, registry.io_backends, policies=registry.policies)
    check_device_pool(device_pool, plan)
    io_backend = build_io_backend(plan)
    host_pool = build_host_pool(plan)
    store = open_store(
        plan,
        host_pool,
        backend_call_timeout_s=options.backend_call_timeout_s,
        max_abandoned_calls=options.max_abandoned_calls,
        queue_pages=options.tier_queue_pages,
    )
    return OpenedParts(plan, io_backend, host_pool, store)


def check_device_pool(device_pool: Any, plan: ResolvedPlan) -> None:
    """The engine's device pool must match the configured geometry (before allocation)."""
    geometry = getattr(device_pool, "geometry", None)
    if geometry is None or not hasattr(device_pool, "num_slots"):
        raise InvalidFieldError(
            "device_pool",
            f"{type(device_pool).__name__} is not a device pool: it needs geometry, num_slots "
            "and device (see kvtier.core.device_pool.DevicePool)",
            value=device_pool,
        )
    if geometry != plan.geometry:
        raise InvalidFieldError(
            "device_pool",
            f"the device pool's geometry ({geometry.describe()}) differs from the config's "
            f"({plan.geometry.describe()})",
            value=geometry,
        )
