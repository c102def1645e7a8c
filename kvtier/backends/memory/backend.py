"""The in-process reference backend: a bounded dict of pages, evicted through a policy.

It implements the whole storage contract in the plainest way, so it is the backend that
shows what every other one must do. Pages live in this process only; a put copies the
page's regions into one ``bytearray`` (the stored object), a get copies it back in place.
Beyond ``capacity_bytes`` pages leave through the context's eviction policy
(``BackendContext.eviction``), least recently used first when none is given; in a storage
chain the tier's space manager owns that room instead (the backend reports its space,
:class:`~kvtier.core.space.ReportsSpace`, and refuses a put that does not fit).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.backends.memory.config import MemoryConfig
from kvtier.core.policy import EvictionPolicy, LRUPolicy
from kvtier.core.space import SpaceReport
from kvtier.core.storage import BackendContext, Counters, PageBuffers, StorageBackend

__all__ = ["MemoryBackend"]


class MemoryBackend(StorageBackend):
    """Pages in a dict, evicted through the context's policy (LRU by default) beyond
    ``capacity_bytes``; none evicted here when the policy's space is owned (a chain)."""

    def __init__(
        self, config: MemoryConfig | None = None, context: BackendContext | None = None
    ) -> None:
        self.config = config or MemoryConfig()
        self.context = context
        given = context.eviction if context is not None else None
        #: What chooses the pages that leave when the store is full.
        self.eviction: EvictionPolicy = given if given is not None else LRUPolicy()
        self._pages: dict[str, bytearray] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._counters = Counters()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._pages for key in keys]

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        results = []
        for key, page in zip(keys, pages, strict=True):
            with self._lock:
                stored = self._pages.get(key)
                if stored is not None:
                    self.eviction.record_access(key)
            results.append(stored is not None and self._fill(stored, page))
            self._counters.add("hits" if results[-1] else "misses")
        return results

    @staticmethod
    def _fill(stored: bytearray, page: PageBuffers) -> bool:
        if len(stored) < sum(extent.length for extent in page):
            return False
        source = memoryview(stored)
        offset = 0
        for extent in page:
            extent.view[:] = source[offset : offset + extent.length]
            offset += extent.length
        return True

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        results = []
        for key, page in zip(keys, pages, strict=True):
            blob = bytearray(b"".join(extent.view for extent in page))
            if len(blob) > self.config.capacity_bytes:
                self._counters.add("put_failed_too_large")
                results.append(False)
                continue
            with self._lock:
                old = self._pages.get(key)
                grow = len(blob) - (len(old) if old is not None else 0)
                if self.eviction.space_owned and self._bytes + grow > self.config.capacity_bytes:
                    # the chain's space manager decides what leaves, not this: refused
                    self._counters.add("put_failed_capacity")
                    results.append(False)
                    continue
                self._bytes += grow
                self._pages[key] = blob  # swapped in whole: a reader sees old or new
                self.eviction.record_insert(key, len(blob))
                if self._bytes > self.config.capacity_bytes and not self._make_room(key):
                    self._drop(key)  # the policy found too little to evict: refused
                    self._counters.add("put_failed_capacity")
                    results.append(False)
                    continue
            self._counters.add("puts")
            self._counters.add("bytes_written", len(blob))
            results.append(True)
        return results

    def _make_room(self, keep: str) -> bool:
        """Evict the policy's victims (never ``keep``) until the pages fit; whether they do.

        Called under the lock.
        """
        capacity = self.config.capacity_bytes
        while self._bytes > capacity:
            victims = self.eviction.choose_victims(
                self._bytes - capacity, pinned=lambda candidate: candidate == keep
            )
            dropped = sum(self._drop(victim) for victim in victims)
            if not dropped:  # nothing (more) the policy would give up
                return False
            self._counters.add("evictions", dropped)
        return True

    def _drop(self, key: str) -> bool:
        """Remove ``key``'s page (under the lock) and tell the policy; whether it was here."""
        old = self._pages.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        self.eviction.record_remove(key)
        return old is not None

    def delete(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [self._drop(key) for key in keys]

    def clear(self) -> None:
        with self._lock:
            for key in list(self._pages):
                self._drop(key)

    def space(self) -> SpaceReport:
        """The bytes held and the room left within ``capacity_bytes``."""
        capacity = int(self.config.capacity_bytes)
        with self._lock:
            used = self._bytes
        return SpaceReport(used, max(0, capacity - used), capacity)

    def page_cost(self, nbytes: int) -> int:
        """A page costs its bytes (one ``bytearray``; Python's object header is not
        counted against ``capacity_bytes``)."""
        return nbytes

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            held = {"pages": len(self._pages), "bytes": self._bytes}
        return {**self._counters.snapshot(), **held}

    def close(self) -> None:
        self.clear()
