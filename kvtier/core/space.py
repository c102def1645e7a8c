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

The exceptions, documented: a backend that does not report space keeps evicting through
the policy it is handed (its capacity is its own; the chain learns each eviction as it
happens), and so does a backend opened bare, without a chain
(:func:`~kvtier.core.capabilities.open_page_store`: no tier, no pins, no write-back, so
the backend is the one owner of its capacity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["ReportsSpace", "SpaceReport"]


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
