"""Test helpers and the conformance kit that third-party backends import and run.

- :mod:`kvtier.testing.kit`: the conformance kit (``BackendKit`` and the mixins, one module
  per concern, and ``PolicyKit`` with ``PolicyConformanceTests`` for eviction and
  admission policies; needs pytest, the ``testing`` extra).
- :func:`require`: skip a test whose optional component cannot run here, or fail it where
  ``KVTIER_REQUIRE_<COMPONENT>=1`` (CI) says the component must be there.
- :mod:`kvtier.testing.faults`: :class:`FaultyBackend`, fault injection around any backend;
  :class:`CallGate`, a backend call held past the bound that then completes;
  :class:`OSFaults`, ENOSPC or EIO (or a stall) at the Nth ``os`` write call.
- :mod:`kvtier.testing.content`: deterministic KV content per page key, for simulated
  engines (the multiturn bench, the cache tests).
- :mod:`kvtier.testing.mooncake`: a Mooncake master started on loopback for tests.
- :mod:`kvtier.testing.engine_loop`: an engine-like forward loop (real matmuls, a KV
  cache in vLLM's accelerator layout) that calls the vLLM device worker's hooks in
  vLLM's order, for ``benchmarks/engine_loop.py`` and the GPU check.

Names of the kit are imported on first use, so ``kvtier.testing.content``,
``kvtier.testing.faults`` and :func:`require` import where pytest is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

try:
    import pytest
except ImportError:  # the kit needs pytest; the other helpers do not
    pass
else:
    # Plain ``assert`` in the kit's mixins gets pytest's detailed failure messages. The
    # package name covers every module of the kit; it must be registered before any of
    # them is imported, which this package's import guarantees.
    pytest.register_assert_rewrite("kvtier.testing.kit")

from kvtier.testing.faults import CallGate, FaultyBackend, InjectedFault, OSFaults
from kvtier.testing.optional import require

if TYPE_CHECKING:
    from kvtier.testing.kit import (
        AdmissionPolicyTests,
        BackendKit,
        CascadeCancelTests,
        ChainFaultCampaignTests,
        ChainKit,
        ChainKitEnv,
        ConcurrencyTests,
        ConformanceTests,
        DeleteClearTests,
        EvictionPolicyTests,
        FaultCampaignTests,
        FullDiskTests,
        Harness,
        IntegrityTests,
        KillInFlightTests,
        KillMidWriteTests,
        KitEnv,
        LateCallTests,
        LateCascadeReadTests,
        LayoutTests,
        MissTests,
        OverwriteTests,
        PersistenceTests,
        PolicyConformanceTests,
        PolicyEnv,
        PolicyKit,
        PrefixExistsTests,
        RoundTripTests,
        SecondInstanceTests,
        SharedProcessesTests,
    )

__all__ = [
    "AdmissionPolicyTests",
    "BackendKit",
    "CallGate",
    "CascadeCancelTests",
    "ChainFaultCampaignTests",
    "ChainKit",
    "ChainKitEnv",
    "ConcurrencyTests",
    "ConformanceTests",
    "DeleteClearTests",
    "EvictionPolicyTests",
    "FaultCampaignTests",
    "FaultyBackend",
    "FullDiskTests",
    "Harness",
    "InjectedFault",
    "IntegrityTests",
    "KillInFlightTests",
    "KillMidWriteTests",
    "KitEnv",
    "LateCallTests",
    "LateCascadeReadTests",
    "LayoutTests",
    "MissTests",
    "OSFaults",
    "OverwriteTests",
    "PersistenceTests",
    "PolicyConformanceTests",
    "PolicyEnv",
    "PolicyKit",
    "PrefixExistsTests",
    "RoundTripTests",
    "SecondInstanceTests",
    "SharedProcessesTests",
    "require",
]

#: The kit's names: imported from kvtier.testing.kit (and so pytest) on first use.
_KIT_NAMES = frozenset(__all__) - {
    "CallGate",
    "FaultyBackend",
    "InjectedFault",
    "OSFaults",
    "require",
}


def __getattr__(name: str) -> Any:
    """Import a kit name from :mod:`kvtier.testing.kit` on first use."""
    if name not in _KIT_NAMES:
        raise AttributeError(f"module 'kvtier.testing' has no attribute {name!r}")
    return getattr(importlib.import_module("kvtier.testing.kit"), name)
