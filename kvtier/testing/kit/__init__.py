"""The conformance kit: test mixins any storage backend runs to prove it keeps the contract.

A backend author writes one test module::

    from kvtier.testing import BackendKit, ConformanceTests

    class TestMyBackend(BackendKit, ConformanceTests):
        backend_name = "my_backend"
        extra_config = {"path": "{tmp}/pages.db"}   # "{tmp}": a fresh directory per test

The kit builds the backend the way kvtier does, through the one construction path
(registry -> :func:`~kvtier.core.capabilities.resolve`, which validates the config and runs
``validate_plan`` -> :func:`~kvtier.core.capabilities.open_page_store`, which calls the
factory), puts a small host pool and a :class:`PageStore` in front of it and checks:
round trips, prefix ``exists``, misses, overwrites, delete and clear, concurrent puts,
corrupt / truncated / foreign pages (through :class:`FaultyBackend`), every declared
layout and attention kind, and, when the spec declares them, persistence across reopen,
sharing between processes, and a writer process killed mid-put tearing no page. A test
is skipped only when the backend's spec says it lacks what the test needs.

This package is the kit's face; each concern lives in its own module, and a mixin uses
only the harness:

- :mod:`~kvtier.testing.kit.harness`: ``BackendKit`` (the fixture class), ``KitEnv``,
  ``Harness``, the registry and the feature checks;
- :mod:`~kvtier.testing.kit.round_trip`, :mod:`~kvtier.testing.kit.exists`,
  :mod:`~kvtier.testing.kit.misses`, :mod:`~kvtier.testing.kit.overwrite`,
  :mod:`~kvtier.testing.kit.delete_clear`: the storage contract call by call;
- :mod:`~kvtier.testing.kit.concurrency`, :mod:`~kvtier.testing.kit.integrity`,
  :mod:`~kvtier.testing.kit.layouts`: threads, damaged pages, every declared layout;
- :mod:`~kvtier.testing.kit.persistence`, :mod:`~kvtier.testing.kit.shared_processes`,
  :mod:`~kvtier.testing.kit.kill_mid_write`: what a declared feature promises (the last
  two start child processes through :mod:`~kvtier.testing.kit.children`);
- the fault campaign, one fault a module: :mod:`~kvtier.testing.kit.faults_late_calls`
  (a call stalled past the bound completes late), :mod:`~kvtier.testing.kit.faults_full_disk`
  (ENOSPC and EIO at every step of a put), :mod:`~kvtier.testing.kit.faults_kill` (kill -9
  with puts in flight, every ``fsync`` mode), :mod:`~kvtier.testing.kit.faults_second_instance`
  (another instance clears and writes), :mod:`~kvtier.testing.kit.faults_cascade` (a
  chain's cascade or promotion of a deleted or tainted key);
  :mod:`~kvtier.testing.kit.faults_ledger` holds what they share, and
  :mod:`~kvtier.testing.kit.faults_chain` ``ChainKit``, the fixture class that runs the
  kit over a chain of tiers;
- :mod:`~kvtier.testing.kit.conformance`: ``ConformanceTests``, all of the contract's
  mixins; ``FaultCampaignTests``, the fault mixins a store runs; and
  ``ChainFaultCampaignTests``, those and the chain's own (``LateCascadeReadTests``,
  ``CascadeCancelTests``);
- :mod:`~kvtier.testing.kit.policies`: the policies' kit, ``PolicyKit`` and
  ``PolicyConformanceTests`` (eviction and admission policies, driven as a tier does).

:mod:`kvtier.testing` registers this package for pytest's assertion rewriting before it is
imported, so every module here reports failed ``assert`` statements in full.
"""

from __future__ import annotations

from kvtier.testing.kit.concurrency import ConcurrencyTests
from kvtier.testing.kit.conformance import (
    ChainFaultCampaignTests,
    ConformanceTests,
    FaultCampaignTests,
)
from kvtier.testing.kit.delete_clear import DeleteClearTests
from kvtier.testing.kit.exists import PrefixExistsTests
from kvtier.testing.kit.faults_cascade import CascadeCancelTests
from kvtier.testing.kit.faults_chain import ChainKit, ChainKitEnv
from kvtier.testing.kit.faults_full_disk import FullDiskTests
from kvtier.testing.kit.faults_kill import KillInFlightTests
from kvtier.testing.kit.faults_late_calls import LateCallTests, LateCascadeReadTests
from kvtier.testing.kit.faults_second_instance import SecondInstanceTests
from kvtier.testing.kit.harness import BackendKit, Harness, KitEnv, default_geometry
from kvtier.testing.kit.integrity import IntegrityTests
from kvtier.testing.kit.kill_mid_write import KillMidWriteTests
from kvtier.testing.kit.layouts import LayoutTests
from kvtier.testing.kit.misses import MissTests
from kvtier.testing.kit.overwrite import OverwriteTests
from kvtier.testing.kit.persistence import PersistenceTests
from kvtier.testing.kit.policies import (
    AdmissionPolicyTests,
    EvictionPolicyTests,
    PolicyConformanceTests,
    PolicyEnv,
    PolicyKit,
)
from kvtier.testing.kit.round_trip import RoundTripTests
from kvtier.testing.kit.shared_processes import SharedProcessesTests

__all__ = [
    "AdmissionPolicyTests",
    "BackendKit",
    "CascadeCancelTests",
    "ChainFaultCampaignTests",
    "ChainKit",
    "ChainKitEnv",
    "ConcurrencyTests",
    "ConformanceTests",
    "DeleteClearTests",
    "EvictionPolicyTests",
    "FaultCampaignTests",
    "FullDiskTests",
    "Harness",
    "IntegrityTests",
    "KillInFlightTests",
    "KillMidWriteTests",
    "KitEnv",
    "LateCallTests",
    "LateCascadeReadTests",
    "LayoutTests",
    "MissTests",
    "OverwriteTests",
    "PersistenceTests",
    "PolicyConformanceTests",
    "PolicyEnv",
    "PolicyKit",
    "PrefixExistsTests",
    "RoundTripTests",
    "SecondInstanceTests",
    "SharedProcessesTests",
    "default_geometry",
]
