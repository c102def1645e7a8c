"""What one Mooncake client keeps in the store: its pages in LRU order, for capacity_bytes.

Mooncake's master knows what the whole store holds, not what one client's namespace
does. This index records the objects this client put (and has not seen removed), their
sizes and when this client last used them, so that ``capacity_bytes`` can be enforced
here and ``stats()`` can report ``pages`` / ``bytes``. It is this process's view: objects
the master evicted on its own are forgotten when a get or exists finds them gone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

__all__ = ["Occupancy"]


class Occupancy:
    """Object key -> size, least recently used first, with the total."""

    def __init__(self, capacity_bytes: int | None) -> None:
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def stored(self, key: str, size: int) -> None:
        """A put of ``key`` succeeded: it holds ``size`` bytes now and is the newest."""
        with self._lock:
            self._bytes += size - self._sizes.pop(key, 0)
            self._sizes[key] = size

    def forget(self, keys: Iterable[str]) -> None:
        """The objects are gone (deleted, evicted by the master, removed for a put)."""
        with self._lock:
            for key in keys:
                self._bytes -= self._sizes.pop(key, 0)

    def touch(self, keys: Iterable[str]) -> None:
        """The objects were just read: they are the most recently used."""
        with self._lock:
            for key in keys:
                if key in self._sizes:
                    self._sizes.move_to_end(key)

    def clear(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._bytes = 0

    def victims(self, needed: int, keep: Collection[str]) -> list[str]:
        """Least recently used keys (not in ``keep``) whose removal frees ``needed`` bytes."""
        out: list[str] = []
        freed = 0
        with self._lock:
            for key, size in self._sizes.items():
                if freed >= needed:
                    break
                if key in keep:
                    continue
                out.append(key)
                freed += size
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
