"""Test helpers and the conformance kit that third-party backends import and run."""

from __future__ import annotations

import pytest

# Plain ``assert`` in the kit's mixins gets pytest's detailed failure messages.
pytest.register_assert_rewrite("kvtier.testing.kit")

from kvtier.testing.faults import FaultyBackend, InjectedFault  # noqa: E402
from kvtier.testing.kit import (  # noqa: E402
    BackendKit,
    ConcurrencyTests,
    ConformanceTests,
    DeleteClearTests,
    Harness,
    IntegrityTests,
    KitEnv,
    LayoutTests,
    MissTests,
    OverwriteTests,
    PersistenceTests,
    PrefixExistsTests,
    RoundTripTests,
    SharedProcessesTests,
)

__all__ = [
    "BackendKit",
    "ConcurrencyTests",
    "ConformanceTests",
    "DeleteClearTests",
    "FaultyBackend",
    "Harness",
    "InjectedFault",
    "IntegrityTests",
    "KitEnv",
    "LayoutTests",
    "MissTests",
    "OverwriteTests",
    "PersistenceTests",
    "PrefixExistsTests",
    "RoundTripTests",
    "SharedProcessesTests",
]
