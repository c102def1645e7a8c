"""``ConformanceTests``: every mixin of the kit in one class, what a backend normally runs."""

from __future__ import annotations

from kvtier.testing.kit.concurrency import ConcurrencyTests
from kvtier.testing.kit.delete_clear import DeleteClearTests
from kvtier.testing.kit.exists import PrefixExistsTests
from kvtier.testing.kit.integrity import IntegrityTests
from kvtier.testing.kit.kill_mid_write import KillMidWriteTests
from kvtier.testing.kit.layouts import LayoutTests
from kvtier.testing.kit.misses import MissTests
from kvtier.testing.kit.overwrite import OverwriteTests
from kvtier.testing.kit.persistence import PersistenceTests
from kvtier.testing.kit.round_trip import RoundTripTests
from kvtier.testing.kit.shared_processes import SharedProcessesTests

__all__ = ["ConformanceTests"]


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
