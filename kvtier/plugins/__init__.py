"""The plugin system, and the face of what a plugin author needs.

- **writing a storage backend**: declare a :class:`BackendSpec` from a
  ``kvtier_register_backends`` hook marked with :data:`hookimpl`, implement
  :class:`StorageBackend` (pages arrive as :data:`PageBuffers`, lists of :class:`Extent`;
  the backend's context is a :class:`BackendContext`), declare its :class:`Feature`\\ s;
- **writing an IO backend**: declare an :class:`IOBackendSpec` (each :class:`Capability`
  it executes), implement :class:`IOBackend` over a :class:`HostPool`;
- **writing a policy**: declare a :class:`PolicySpec` from a ``kvtier_register_policies``
  hook, implement :class:`EvictionPolicy` (which pages leave a full tier) or
  :class:`AdmissionPolicy` (which pages enter one), using what :class:`PageInfo` tells;

then prove it with the conformance kit (:mod:`kvtier.testing`). The hooks are documented
in :mod:`kvtier.plugins.hookspecs`; the manager and registries live beside it.
"""

from __future__ import annotations

from kvtier.core.extents import Extent
from kvtier.core.geometry import AttentionKind, KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.io import IOBackend, TransferPlan
from kvtier.core.layout import Layout
from kvtier.core.policy import AdmissionPolicy, EvictionPolicy, PageInfo
from kvtier.core.specs import (
    ALL_ATTENTION,
    ALL_LAYOUTS,
    ALL_OPERATIONS,
    BackendSpec,
    Capability,
    Feature,
    IOBackendSpec,
    Operation,
    PolicySpec,
)
from kvtier.core.storage import BackendContext, Counters, PageBuffers, StorageBackend
from kvtier.plugins.hookspecs import hookimpl

__all__ = [  # noqa: RUF022 - grouped by audience, as the docstring says
    "hookimpl",
    # writing a storage backend
    "BackendSpec",
    "StorageBackend",
    "BackendContext",
    "PageBuffers",
    "Extent",
    "Feature",
    "Counters",
    "ALL_ATTENTION",
    "ALL_LAYOUTS",
    "ALL_OPERATIONS",
    # writing an IO backend
    "IOBackendSpec",
    "IOBackend",
    "Capability",
    "TransferPlan",
    "HostPool",
    # writing a policy
    "PolicySpec",
    "EvictionPolicy",
    "AdmissionPolicy",
    "PageInfo",
    # what both describe
    "AttentionKind",
    "KVGeometry",
    "Layout",
    "Operation",
]
