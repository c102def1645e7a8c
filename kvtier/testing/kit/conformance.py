"""``ConformanceTests``: every mixin of the kit in one class, what a backend normally runs;
``FaultCampaignTests``: the fault mixins in one class, run beside it;
``ChainFaultCampaignTests``: those and the chain's own, for a chain of tiers."""

from __future__ import annotations

from kvtier.testing.kit.concurrency import ConcurrencyTests
from kvtier.testing.kit.delete_clear import DeleteClearTests
from kvtier.testing.kit.exists import PrefixExistsTests
from kvtier.testing.kit.faults_cascade import CascadeCancelTests
from kvtier.testing.kit.faults_full_disk import FullDiskTests
from kvtier.testing.kit.faults_kill import KillInFlightTests
from kvtier.testing.kit.faults_late_calls import LateCallTests, LateCascadeReadTests
from kvtier.testing.kit.faults_second_instance import SecondInstanceTests
from kvtier.testing.kit.integrity import IntegrityTests
from kvtier.testing.kit.kill_mid_write import KillMidWriteTests
from kvtier.testing.kit.layouts import LayoutTests
from kvtier.testing.kit.misses import MissTests
from kvtier.testing.kit.overwrite import OverwriteTests
from kvtier.testing.kit.persistence import PersistenceTests
from kvtier.testing.kit.round_trip import RoundTripTests
from kvtier.testing.kit.shared_processes import SharedProcessesTests

__all__ = ["ChainFaultCampaignTests", "ConformanceTests", "FaultCampaignTests"]


class ConformanceTests(
    RoundTripTests,
    PrefixExistsTests,
    MissTests,
    OverwriteTests,
    DeleteClearTests,
    ConcurrencyTests,
    IntegrityTests,
    LayoutTests,
    PersistenceTests,
    SharedProcessesTests,
    KillMidWriteTests,
):
    """Every mixin of the kit; what a backend's test class normally inherits."""


class FaultCampaignTests(
    LateCallTests,
    FullDiskTests,
    KillInFlightTests,
    SecondInstanceTests,
):
    """Every fault mixin a store runs: a call stalled past the bound, ENOSPC/EIO at every
    step of a put, kill -9 with puts in flight under every ``fsync`` mode, a second
    instance that clears and writes. Each checks every byte read back and that the store
    keeps working; each runs where the spec declares what it needs. A backend's test
    class inherits it beside ``ConformanceTests``."""


class ChainFaultCampaignTests(FaultCampaignTests, LateCascadeReadTests, CascadeCancelTests):
    """The campaign of a chain of tiers (``ChainKit``): every store fault, plus the
    worker's late read of the tier above and cascades or promotions of deleted or
    tainted keys."""
