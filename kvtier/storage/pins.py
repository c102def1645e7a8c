"""Pages no storage tier may evict now: the chain's pin set.

A running load needs the pages it found in a tier until it has read them: it pins those
keys here (TieredCache's prefetch does, until its handle is released; an engine adapter
may), and every tier's eviction (the chain's own victim choices and each backend's capacity,
which go through the tier's :class:`~kvtier.storage.observed.ObservedEviction`) skips a
pinned key. Pins are counted: a key pinned twice stays pinned until unpinned twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["PinSet", "count_in", "count_out"]


def count_in(counts: dict[str, int], keys: Iterable[str]) -> None:
    """Count each key once more (the caller holds the lock guarding ``counts``)."""
    for key in keys:
        counts[key] = counts.get(key, 0) + 1


def count_out(counts: dict[str, int], keys: Iterable[str]) -> list[str]:
    """Count each key once less, dropping it at zero (a key not counted is ignored);
    the keys that left. The caller holds the lock guarding ``counts``."""
    gone: list[str] = []
    for key in keys:
        left = counts.get(key, 0) - 1
        if left > 0:
            counts[key] = left
        else:
            if counts.pop(key, None) is not None:
                gone.append(key)
    return gone


class PinSet:
    """Counted pins on page keys; thread-safe.

    A membership test takes no lock (one dict look-up), so a policy may call it from
    ``choose_victims`` while it holds its own lock.
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def pin(self, keys: Iterable[str]) -> None:
        """Pin each key once more."""
        with self._lock:
            count_in(self._counts, keys)

    def unpin(self, keys: Iterable[str]) -> None:
        """Drop one pin from each key (a key not pinned is ignored)."""
        with self._lock:
            count_out(self._counts, keys)

    @contextmanager
    def holding(self, keys: Iterable[str]) -> Iterator[list[str]]:
        """Pin ``keys`` for the ``with`` block."""
        held = list(keys)
        self.pin(held)
        try:
            yield held
        finally:
            self.unpin(held)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        return len(self._counts)
