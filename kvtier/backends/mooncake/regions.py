"""Memory registered with Mooncake, and a page as Mooncake sees it (merged runs, registered or not).

A page whose runs all lie inside registered memory moves zero-copy; any other page goes
through the staging buffer (:mod:`kvtier.backends.mooncake.staging`).
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from kvtier.core.storage import PageBuffers

__all__ = ["Plan", "Regions"]


class Plan(NamedTuple):
    """One page as Mooncake sees it: merged (pointer, size) runs and their total."""

    ptrs: list[int]
    sizes: list[int]
    total: int
    registered: bool


class Regions:
    """Registered memory, sorted, for an O(log n) 'is this run inside one region' check.

    Copy-on-write: ``add`` (under the caller's lock) swaps in new tuples, so readers on
    other threads never see a half-updated list.
    """

    def __init__(self) -> None:
        self._spans: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    def covers(self, ptr: int, size: int) -> bool:
        starts, ends = self._spans
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr + size <= ends[i]

    def add(self, ptr: int, size: int) -> None:
        starts, ends = self._spans
        i = bisect.bisect_right(starts, ptr)
        self._spans = (
            (*starts[:i], ptr, *starts[i:]),
            (*ends[:i], ptr + size, *ends[i:]),
        )

    def __len__(self) -> int:
        return len(self._spans[0])

    def plan(self, page: PageBuffers) -> Plan:
        """``page``'s extents with adjacent ones merged, and whether all lie in this memory."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for extent in page:
            if extent.length <= 0:
                continue
            if ptrs and ptrs[-1] + sizes[-1] == extent.ptr:
                sizes[-1] += extent.length
            else:
                ptrs.append(extent.ptr)
                sizes.append(extent.length)
        registered = all(self.covers(p, n) for p, n in zip(ptrs, sizes, strict=True))
        return Plan(ptrs, sizes, sum(sizes), registered)
