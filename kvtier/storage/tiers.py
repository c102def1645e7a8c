"""What every part of the chain shares: its tiers, their tenants, and its events.

A :class:`Tier` is one storage tier (its plan, page store, policies, counters);
:class:`Tenants` maps a key to the configured tenant of its namespace; a
:class:`ChainParts` holds what the chain's parts (routing, cascade, placement) all use.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.capabilities import ResolvedPlan, TierPlan
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.keys import NAMESPACE_ID_CHARS
from kvtier.core.metrics import counter_names, registered_counters
from kvtier.core.pagestore import PageMemory, PageStore
from kvtier.core.storage import Counters
from kvtier.storage.events import Event, EventKind, EventStream
from kvtier.storage.fences import KeyFences
from kvtier.storage.observed import ObservedEviction
from kvtier.storage.pins import PinSet
from kvtier.storage.staging import StagingPool

__all__ = ["TIER_COUNTERS", "ChainParts", "Tenants", "Tier"]

#: A tier's chain counters (kvtier.core.metrics.COUNTERS), reported as 0 until they move.
TIER_COUNTERS = tuple(counter_names("storage_tier"))


@dataclass(eq=False)
class Tier:
    """One tier of a chain: its plan, its page store, its policies and counters."""

    plan: TierPlan
    store: PageStore
    eviction: ObservedEviction | None
    admission: Any  # AdmissionPolicy | None
    #: The chain's counters of this tier (``storage_tier`` in kvtier.core.metrics.COUNTERS).
    counters: Counters = field(default_factory=lambda: registered_counters("storage_tier"))

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def name(self) -> str:
        return self.plan.name


class Tenants:
    """The configured tenants (``tenants`` in the config), found by a key's namespace."""

    def __init__(self, plan: ResolvedPlan) -> None:
        self._by_namespace = dict(plan.tenants)

    def __bool__(self) -> bool:
        return bool(self._by_namespace)

    def of(self, key: str) -> str | None:
        """The configured tenant whose namespace the key is in (None: no configured one)."""
        entry = self._by_namespace.get(key[:NAMESPACE_ID_CHARS])
        return entry[0] if entry is not None else None

    def quota_of(self, key: str) -> tuple[str, int] | None:
        """The key's tenant and its ``quota_bytes``, if it has a quota."""
        entry = self._by_namespace.get(key[:NAMESPACE_ID_CHARS])
        if entry is None or entry[1] is None:
            return None
        return entry[0], entry[1]

    def quotas(self) -> list[tuple[str, int | None]]:
        """Every configured tenant and its quota (None: none)."""
        return list(self._by_namespace.values())


@dataclass(eq=False)
class ChainParts:
    """What the chain's parts share: the tiers over one page memory, the tenants, the
    staging pool, the key fences, the pins, the events and one lock for their tables."""

    plan: ResolvedPlan
    tiers: list[Tier]
    pool: PageMemory
    events: EventStream
    pins: PinSet
    tenants: Tenants = field(init=False)
    #: What one page takes in a tier: its envelope slot and its payload.
    page_bytes: int = field(init=False)
    #: Staging pages of cascades, write-backs and promotions; a page a timed-out call
    #: still uses stays quarantined there until the call returns.
    staging: StagingPool = field(init=False)
    #: Keys with writes in flight, and those deleted or tainted meanwhile.
    fences: KeyFences = field(default_factory=KeyFences)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.tenants = Tenants(self.plan)
        self.page_bytes = self.plan.geometry.bytes_per_page + ENVELOPE_BYTES
        self.staging = StagingPool(self.plan, self.page_bytes)

    def emit(self, kind: EventKind, tier: Tier, keys: Iterable[str]) -> None:
        """One event per key entering or leaving ``tier``."""
        tenant_of, nbytes = self.tenants.of, self.page_bytes
        self.events.emit(
            Event(kind, tier.index, tier.name, key, tenant_of(key), nbytes) for key in keys
        )

    def back_below(self, tier: Tier) -> Tier | None:
        """The tier below ``tier`` when it is ``write: back`` (its evictions go there)."""
        below = tier.index + 1
        if below < len(self.tiers) and self.tiers[below].plan.write == "back":
            return self.tiers[below]
        return None

    def through_below(self, index: int) -> list[int]:
        """The write-through tiers a page stored in tier ``index`` cascades into."""
        out = []
        for tier in self.tiers[index + 1 :]:
            if tier.plan.write != "through":
                break
            out.append(tier.index)
        return out

    def drop(self, target: int, count: int) -> None:
        """``count`` pages owed to tier ``target`` were not written (counted ``drops``)."""
        if count:
            self.tiers[target].counters.add("drops", count)


def keys_where(
    keys: Sequence[str], results: Sequence[bool], *, but: Iterable[str] = ()
) -> list[str]:
    """The keys whose result is True (but those in ``but``)."""
    skip = set(but)
    return [key for key, ok in zip(keys, results, strict=True) if ok and key not in skip]
