"""A test eviction policy that remembers what a tier's chain tells it of each page.

``recording`` is LRU that keeps every :class:`~kvtier.core.policy.PageInfo` it is given
(``describe``), so a test can read the parents a real chain passed to a tier's policy:
the policy of tier ``i`` is ``chain.tiers[i].eviction.inner``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from test_cache import TestPlugin

from kvtier import hookimpl
from kvtier.core.policy import LRUPolicy, PageInfo
from kvtier.core.specs import PolicySpec
from kvtier.plugins.manager import load_registry
from kvtier.plugins.registry import Registry


class RecordingPolicy(LRUPolicy):
    """LRU that remembers each description: ``told`` in order, ``parent_of`` the last."""

    def __init__(self, config: BaseModel | None = None) -> None:
        super().__init__(config)
        self.told: list[tuple[str, PageInfo]] = []

    def describe(self, key: str, info: PageInfo) -> None:
        self.told.append((key, info))
        super().describe(key, info)

    def parent_of(self, key: str) -> str | None:
        """The parent ``key`` was last described with (KeyError if it never was)."""
        for told, info in reversed(self.told):
            if told == key:
                return info.parent
        raise KeyError(key)


RECORDING = PolicySpec(
    name="recording", kind="eviction", factory=RecordingPolicy, description="LRU that records"
)


class RecordingPlugin:
    """Declares the ``recording`` eviction policy."""

    @staticmethod
    @hookimpl
    def kvtier_register_policies(register: Any) -> None:
        register(RECORDING)


def recording_registry() -> Registry:
    """The built-ins, the ``shared`` test backend (tests/test_cache.py) and ``recording``."""
    return load_registry(
        autoload=False, plugins=[("cache-test", TestPlugin), ("recording", RecordingPlugin)]
    )


def recorder(store: Any, tier: int = 0) -> RecordingPolicy:
    """The recording policy of a chain's tier ``tier``."""
    policy = store.tiers[tier].eviction.inner
    assert isinstance(policy, RecordingPolicy)
    return policy
