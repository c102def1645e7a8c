"""What one Mooncake client keeps in the store: its pages and their sizes, for capacity_bytes.

Mooncake's master knows what the whole store holds, not what one client's namespace
does. This index records the objects this client put (and has not seen removed) and
their sizes, so that ``capacity_bytes`` can be enforced here and ``stats()`` can report
``pages`` / ``bytes``; which pages leave when it is full is the eviction policy's choice
(``BackendContext.eviction``; least recently used first when none is given), told of
every put, read and removal. It is this process's view: objects the master evicted on
its own are forgotten when a get or exists finds them gone, and reported to the policy
as reclaimed (:meth:`~kvtier.core.policy.EvictionPolicy.record_reclaimed`: a storage
chain counts them as the tier's external evictions). In a chain the policy's space is
owned: the tier's space manager reads :meth:`Occupancy.space` and picks the victims.

Objects are named by their Mooncake key (``<key_prefix>/<namespace>/<page key>``); the
policy sees the page keys, as every other backend's does, so that what a tier describes
of a page (:meth:`~kvtier.core.policy.EvictionPolicy.describe`) reaches it.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Sequence

from kvtier.core.policy import EvictionPolicy, LRUPolicy
from kvtier.core.space import SpaceReport

__all__ = ["Occupancy"]


class Occupancy:
    """Object key -> size, with the total, and the policy that picks victims among them."""

    def __init__(
        self,
        capacity_bytes: int | None,
        *,
        eviction: EvictionPolicy | None = None,
        prefix: str = "",
    ) -> None:
        self.capacity_bytes = capacity_bytes
        #: Chooses the pages that leave (page keys: object keys without ``prefix``).
        self.eviction: EvictionPolicy = eviction if eviction is not None else LRUPolicy()
        self._prefix = prefix
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def _page(self, okey: str) -> str:
        """The page key of object key ``okey``."""
        return okey[len(self._prefix) :] if okey.startswith(self._prefix) else okey

    def stored(self, key: str, size: int) -> None:
        """A put of ``key`` succeeded: it holds ``size`` bytes now and is the newest."""
        with self._lock:
            self._bytes += size - self._sizes.pop(key, 0)
            self._sizes[key] = size
            self.eviction.record_insert(self._page(key), size)

    def forget(self, keys: Iterable[str]) -> None:
        """The objects are gone (deleted, evicted by the master, removed for a put)."""
        with self._lock:
            for key in keys:
                size = self._sizes.pop(key, None)
                if size is not None:
                    self._bytes -= size
                    self.eviction.record_remove(self._page(key))

    def reclaimed(self, keys: Iterable[str]) -> None:
        """The objects were found gone without this client removing them (the master
        evicted them): forgotten, and told to the policy as reclaimed."""
        with self._lock:
            for key in keys:
                size = self._sizes.pop(key, None)
                if size is not None:
                    self._bytes -= size
                    self.eviction.record_reclaimed(self._page(key))

    def space(self) -> SpaceReport:
        """This client's bytes and the room left within ``capacity_bytes`` (None: no
        bound here; the master's memory is its own)."""
        capacity = self.capacity_bytes
        with self._lock:
            used = self._bytes
        free = None if capacity is None else max(0, capacity - used)
        return SpaceReport(used, free, capacity)

    def touch(self, keys: Iterable[str]) -> None:
        """The objects were just read: a hit for the policy."""
        with self._lock:
            for key in keys:
                if key in self._sizes:
                    self.eviction.record_access(self._page(key))

    def clear(self) -> None:
        with self._lock:
            for key in self._sizes:
                self.eviction.record_remove(self._page(key))
            self._sizes.clear()
            self._bytes = 0

    def victims(self, needed: int, keep: Collection[str]) -> list[str]:
        """Object keys (not in ``keep``) the policy would remove to free ``needed`` bytes."""
        prefix = self._prefix
        with self._lock:
            chosen = self.eviction.choose_victims(needed, pinned=lambda page: prefix + page in keep)
            out = []
            for page in chosen:
                okey = prefix + page
                if okey in self._sizes:
                    out.append(okey)
                else:  # a page this client does not hold: the policy forgets it
                    self.eviction.record_remove(page)
            return out

    def excess(self, incoming: Sequence[tuple[str, int]]) -> int:
        """Bytes over capacity if every ``(key, size)`` were stored now (0: it fits)."""
        if self.capacity_bytes is None:
            return 0
        with self._lock:
            total = self._bytes + sum(size - self._sizes.get(key, 0) for key, size in incoming)
        return max(0, total - self.capacity_bytes)

    def snapshot(self) -> tuple[int, int]:
        """(pages, bytes) held now."""
        with self._lock:
            return len(self._sizes), self._bytes
