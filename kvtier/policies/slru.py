"""``slru``: segmented LRU, a scan-resistant eviction policy with a ghost of evicted keys.

A page enters *probation*; a hit there (or its key coming back while the ghost still
remembers it) moves it to *protected*. Victims come from probation first, least recently
used first, then from protected; when victims are chosen, protected holds at most
``protected_fraction`` of the resident bytes, its least recently used pages going back
to probation beyond that. So a
scan of pages used once passes through probation without displacing the pages used
twice, and a page evicted too early is protected when it returns. The ghost remembers
about ``ghost_factor`` x the resident page count of evicted keys, in two generations
(:class:`~kvtier.policies.ghost.Ghost`), the older forgotten whole when the newer fills
(no trim per key).

Why SLRU among the classic scan-resistant designs: on the Mooncake trace it measured
best of the three candidates (S3-FIFO, SLRU, ARC) at every capacity; ``docs/tiers.md``
has the figures.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvtier.core.policy import BookEviction
from kvtier.policies.config import SLRUConfig
from kvtier.policies.ghost import Ghost

__all__ = ["SLRUPolicy"]


class SLRUPolicy(BookEviction):
    """Probation and protected LRU segments plus a bounded ghost (see the module docstring).

    One lock per call (describing a page not resident yet takes none: see
    :meth:`~kvtier.core.policy.PageBook.hold_unlocked`). Memory: a dict entry per
    resident page in one segment, plus one per remembered evicted key (at most
    ``ghost_factor`` x the resident page count, plus 16).
    """

    def __init__(self, config: SLRUConfig | None = None) -> None:
        super().__init__()
        self.config = config or SLRUConfig()
        self._probation: OrderedDict[str, None] = OrderedDict()
        self._protected: OrderedDict[str, None] = OrderedDict()
        self._protected_bytes = 0
        self._ghost = Ghost(self.config)  # evicted keys (their value unused)
        self._promoted = False  # a page entered protected since the last _balance

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
                ghost = self._ghost
                if key in ghost.newer or key in ghost.older:  # evicted too soon
                    ghost.pop(key)
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
            ghost.newer[key] = 0
            if len(ghost.newer) >= ghost.half:
                ghost.close(len(self._book.sizes))
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

    def _victims(self, nbytes: int, pinned: Callable[[str], bool], tenant: str | None) -> list[str]:
        if self._promoted:
            self._balance()
        return self._book.pick((self._probation, self._protected), nbytes, pinned, tenant)

    def remembered(self) -> int:
        """How many evicted keys the ghost remembers now (its memory, for tests and stats)."""
        with self._lock:
            return len(self._ghost)

    def __repr__(self) -> str:
        return (
            f"SLRUPolicy(probation={len(self._probation)}, protected={len(self._protected)}, "
            f"ghost={len(self._ghost)}, nbytes={self.nbytes})"
        )
