"""The in-process reference backend: a bounded dict of pages with LRU eviction.

It implements the whole storage contract in the plainest way, so it is the backend that
shows what every other one must do. Pages live in this process only; a put copies the
page's regions into one ``bytearray`` (the stored object), a get copies it back in place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.backends.memory.config import MemoryConfig
from kvtier.core.storage import BackendContext, Counters, PageBuffers, StorageBackend

__all__ = ["MemoryBackend"]


class MemoryBackend(StorageBackend):
    """Pages in a dict, evicted least-recently-used first beyond ``capacity_bytes``."""

    def __init__(
        self, config: MemoryConfig | None = None, context: BackendContext | None = None
    ) -> None:
        self.config = config or MemoryConfig()
        self.context = context
        self._pages: OrderedDict[str, bytearray] = OrderedDict()
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
                    self._pages.move_to_end(key)
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
                old = self._pages.pop(key, None)
                self._bytes += len(blob) - (len(old) if old is not None else 0)
                self._pages[key] = blob  # swapped in whole: a reader sees old or new
                while self._bytes > self.config.capacity_bytes:
                    _, evicted = self._pages.popitem(last=False)
                    self._bytes -= len(evicted)
                    self._counters.add("evictions")
            self._counters.add("puts")
            self._counters.add("bytes_written", len(blob))
            results.append(True)
        return results

    def delete(self, keys: Sequence[str]) -> list[bool]:
        results = []
        with self._lock:
            for key in keys:
                old = self._pages.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                results.append(old is not None)
        return results

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            held = {"pages": len(self._pages), "bytes": self._bytes}
        return {**self._counters.snapshot(), **held}

    def close(self) -> None:
        self.clear()
