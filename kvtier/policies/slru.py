"""``slru``: segmented LRU, a scan-resistant eviction policy with a ghost of evicted keys.

A page enters *probation*; a hit there (or its key coming back while the ghost still
remembers it) moves it to *protected*. Victims come from probation first, least recently
used first, then from protected; when victims are chosen, protected holds at most
``protected_fraction`` of the resident bytes, its least recently used pages going back
to probation beyond that. So a
scan of pages used once passes through probation without displacing the pages used
twice, and a page evicted too early is protected when it returns. The ghost remembers
about ``ghost_factor`` x the resident page count of evicted keys, in two generations of
sets, the older forgotten whole when the newer fills (no trim per key).

Why SLRU among the classic scan-resistant designs: on the Mooncake trace it measured
best of the three candidates (S3-FIFO, SLRU, ARC) at every capacity; ``docs/tiers.md``
has the figures.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from kvtier.core.policy import EvictionPolicy, PageBook, PageInfo, never_pinned
from kvtier.policies.config import SLRUConfig

__all__ = ["SLRUPolicy"]


class SLRUPolicy(EvictionPolicy):
    """Probation and protected LRU segments plus a bounded ghost (see the module docstring).

    One lock per call (describing a page not resident yet takes none: see
    :meth:`~kvtier.core.policy.PageBook.hold_unlocked`). Memory: a dict entry per
    resident page in one segment, plus one per remembered evicted key (at most
    ``ghost_factor`` x the resident page count, plus 16).
    """

    def __init__(self, config: SLRUConfig | None = None) -> None:
        self.config = config or SLRUConfig()
        self._lock = threading.Lock()
        # acquire()/release() in try/finally: half what a `with` costs on each call
        self._acquire, self._release = self._lock.acquire, self._lock.release
        self._book = PageBook()
        self._probation: OrderedDict[str, None] = OrderedDict()
        self._protected: OrderedDict[str, None] = OrderedDict()
        self._protected_bytes = 0
        #: Evicted keys in two generations: keys go into the newer; when it is full it
        #: becomes the older and the older is dropped whole (no per-key trim).
        self._ghost: set[str] = set()
        self._ghost_old: set[str] = set()
        self._ghost_half = 8  # keys a generation holds; recomputed as each one closes
        self._promoted = False  # a page entered protected since the last _balance

    def describe(self, key: str, info: PageInfo) -> None:
        if self._book.hold_unlocked(key, info):
            return
        self._acquire()
        try:
            self._book.describe(key, info)
        finally:
            self._release()

    def record_insert(self, key: str, nbytes: int) -> None:
        self._acquire()
        try:
            book = self._book
            if key in book.sizes:
                old = book.sizes[key]
                book.insert(key, nbytes)
                if key in self._protected:  # (its share is a soft cap: no balance here)
                    self._protected_bytes += nbytes - old
                    self._protected.move_to_end(key)
                else:
                    self._probation.move_to_end(key)
            else:
                book.insert_new(key, nbytes)
                if key in self._ghost or key in self._ghost_old:  # evicted too soon
                    self._ghost.discard(key)
                    self._ghost_old.discard(key)
                    self._protected[key] = None
                    self._protected_bytes += nbytes
                    self._promoted = True
                else:
                    self._probation[key] = None
        finally:
            self._release()

    def record_access(self, key: str) -> None:
        self._acquire()
        try:
            if key in self._protected:
                self._protected.move_to_end(key)
            elif key in self._probation:
                del self._probation[key]
                self._protected[key] = None
                self._protected_bytes += self._book.sizes[key]
                self._promoted = True
        finally:
            self._release()

    def record_remove(self, key: str) -> None:
        self._acquire()
        try:
            size = self._book.remove(key)
            if size is None:
                return
            if key in self._protected:
                del self._protected[key]
                self._protected_bytes -= size
            else:
                del self._probation[key]
            ghost = self._ghost
            ghost.add(key)
            if len(ghost) >= self._ghost_half:
                # the full generation becomes the older; the older is forgotten whole, so
                # the ghost holds between 2/3 and 4/3 of ghost_factor x the resident pages
                self._ghost_old = ghost
                self._ghost = set()
                factor = self.config.ghost_factor
                self._ghost_half = int(factor * len(self._book.sizes) * 2 / 3) + 8
        finally:
            self._release()

    def _balance(self) -> None:
        """Hand protected's least recently used pages back to probation beyond its share.

        Done when victims are chosen after a page was promoted: the tier is full then, so
        the share is of its capacity, not of a tier still filling up.
        """
        self._promoted = False
        limit = self.config.protected_fraction * self._book.total
        sizes = self._book.sizes
        while self._protected_bytes > limit and self._protected:
            key, _ = self._protected.popitem(last=False)
            self._protected_bytes -= sizes[key]
            self._probation[key] = None

    def choose_victims(
        self,
        nbytes: int,
        *,
        pinned: Callable[[str], bool] = never_pinned,
        tenant: str | None = None,
    ) -> list[str]:
        self._acquire()
        try:
            if self._promoted:
                self._balance()
            return self._book.pick((self._probation, self._protected), nbytes, pinned, tenant)
        finally:
            self._release()

    def remembered(self) -> int:
        """How many evicted keys the ghost remembers now (its memory, for tests and stats)."""
        self._acquire()
        try:
            return len(self._ghost) + len(self._ghost_old)
        finally:
            self._release()

    def __contains__(self, key: object) -> bool:
        return key in self._book.sizes

    def __len__(self) -> int:
        return len(self._book.sizes)

    @property
    def nbytes(self) -> int:
        return self._book.total

    def tenant_bytes(self, tenant: str | None) -> int:
        self._acquire()
        try:
            return self._book.tenant_bytes(tenant)
        finally:
            self._release()

    def __repr__(self) -> str:
        return (
            f"SLRUPolicy(probation={len(self._probation)}, protected={len(self._protected)}, "
            f"ghost={len(self._ghost) + len(self._ghost_old)}, nbytes={self.nbytes})"
        )
