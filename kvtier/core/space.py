"""The space contract: a backend reports its space, the chain alone decides what leaves.

A backend that declares :attr:`~kvtier.core.specs.Feature.REPORTS_SPACE` implements
:class:`ReportsSpace`: :meth:`~ReportsSpace.space` says what it holds and how much more it
takes before it refuses a put, :meth:`~ReportsSpace.page_cost` what a page of a given size
takes off that room (its own overheads included). A storage chain
(:func:`kvtier.storage.open_store`) then gives the tier a space manager
(:mod:`kvtier.storage.space`), the only decider of what leaves the tier: before each put
into it the manager picks victims through the tier's eviction policy (pins respected),
hands them down to a ``write: back`` tier below, deletes them, and only then puts.

The backend learns that its space is owned through the policy it is handed
(``BackendContext.eviction``): :attr:`~kvtier.core.policy.EvictionPolicy.space_owned` is
True, and the backend then never makes room on its own: a put that does not fit is
refused (False, counted in its stats), and it never asks the policy for victims. It
still records every insert, hit and removal in the policy and deletes what it is told.

A backend that must reclaim on its own (a shared store whose master evicts under memory
pressure) reports each page it finds gone with
:meth:`~kvtier.core.policy.EvictionPolicy.record_reclaimed`; the chain counts it
(``evictions_external`` of the tier) and, above a ``write: back`` tier, as a drop there.

A backend whose space comes back a unit at a time (the segment store: a deleted page
leaves a dead hole until its whole segment goes) implements :class:`ReclaimsUnits` as
well: the manager deletes no page of it to make room, it scores the backend's units by
the bytes the policy would evict first that each holds (and its dead bytes), the live
pages the policy would keep being the cost (they are rewritten), and tells the backend
which unit to reclaim and which of its pages to keep; the others are the manager's
victims, handed down to a ``write: back`` tier below first.

The exceptions, documented: a backend that does not report space keeps evicting through
the policy it is handed (its capacity is its own; the chain learns each eviction as it
happens), and so does a backend opened bare, without a chain
(:func:`~kvtier.core.capabilities.open_page_store`: no tier, no pins, no write-back, so
the backend is the one owner of its capacity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["ReclaimUnit", "ReclaimsUnits", "ReportsSpace", "SpaceReport"]


@dataclass(frozen=True)
class SpaceReport:
    """A backend's space now, in the unit of its :meth:`ReportsSpace.page_cost`."""

    #: What the pages it holds take (committed pages; puts in flight are the caller's).
    used_bytes: int
    #: How much more it takes before it refuses a put (None: no bound it knows of).
    free_bytes: int | None
    #: Its configured bound (None: none; its room is bounded by ``free_bytes`` only).
    capacity_bytes: int | None = None


@runtime_checkable
class ReportsSpace(Protocol):
    """What a backend that declares ``Feature.REPORTS_SPACE`` implements.

    Both calls are local and cheap (no remote call, at most one ``statvfs``): the space
    manager asks them under its tier's lock before every put into the tier.
    """

    def space(self) -> SpaceReport:
        """What the backend holds and how much more it takes now."""
        ...

    def page_cost(self, nbytes: int) -> int:
        """What storing one page of ``nbytes`` (envelope included) takes off
        ``space().free_bytes``: the page and the backend's own overheads for it."""
        ...


@dataclass(frozen=True)
class ReclaimUnit:
    """One unit of a backend's space that comes back whole (a segment)."""

    #: The backend's name for it (a segment's id), passed back to :meth:`ReclaimsUnits.reclaim`.
    unit: int
    #: What reclaiming it gives back (its file's bytes).
    nbytes: int
    #: Its live pages, (key, bytes), in its order: each is dropped or kept (rewritten).
    live: tuple[tuple[str, int], ...]


@runtime_checkable
class ReclaimsUnits(Protocol):
    """A :class:`ReportsSpace` backend whose space comes back a unit at a time."""

    def reclaim_units(self) -> list[ReclaimUnit]:
        """The units it could reclaim now (none being written), oldest first."""
        ...

    def rewrite_budget(self) -> int:
        """The most bytes of kept pages one reclaim rewrites (the others are dropped)."""
        ...

    def reclaim(self, unit: int, keep: frozenset[str]) -> list[str] | None:
        """Reclaim ``unit``: its live pages in ``keep`` rewritten (those that find no
        room then are dropped, each reported with ``record_reclaimed``), the others
        dropped (removals the policy is told of). The keys dropped on the caller's
        word, or None when the unit could not be taken (gone, or another process holds
        it): nothing changed."""
        ...
