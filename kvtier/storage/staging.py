"""The storage chain's staging pages, and the quarantine of pages a late call still uses.

The chain copies pages into a small host pool of its own for every cascade, write-back
and promotion (:class:`StagingPool`). A page is *held* while anything may touch it: the
job that took it, and every backend call that timed out while using it (a call past its
bound may still read the page, or write into it, whenever it resumes). A page goes back
to the free list only when its last hold ends, so a recycled staging page never carries
another key's bytes into a call that resumes late. :class:`LateGuard` ties one bounded
call to the pages it was given: pass :meth:`LateGuard.returned` as the call's
``on_late`` and call :meth:`LateGuard.timed_out` when it reports ``TIMED_OUT``, in
either order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from kvtier.core.capabilities import ResolvedPlan, build_host_pool
from kvtier.core.host_pool import HostPool

__all__ = ["STAGING_BYTES", "STAGING_PAGES", "LateGuard", "StagingPool"]

#: Staging memory for cascades and promotions: at most this many bytes, or pages.
STAGING_BYTES = 256 << 20
STAGING_PAGES = 64


class StagingPool:
    """Staging pages with holds: a page is free again only when its last hold ends.

    Allocated on first use (:attr:`pool`): at most :data:`STAGING_PAGES` pages of
    ``page_bytes``, and at most :data:`STAGING_BYTES`, never fewer than 4.
    """

    def __init__(self, plan: ResolvedPlan, page_bytes: int) -> None:
        self._plan = plan
        self._page_bytes = page_bytes
        self._lock = threading.Lock()
        self._pool: HostPool | None = None
        self._free: list[int] = []
        self._holds: dict[int, int] = {}
        #: Pages a timed-out call holds now, by page (a page may be in several such calls).
        self._late: dict[int, int] = {}

    @property
    def pool(self) -> HostPool:
        """The staging host pool (allocated on first use)."""
        with self._lock:
            if self._pool is None:
                pages = max(4, min(STAGING_PAGES, STAGING_BYTES // max(1, self._page_bytes)))
                self._pool = build_host_pool(self._plan, num_pages=pages, pin_memory=False)
                self._free = list(range(pages))
            return self._pool

    def take(self, count: int) -> list[int]:
        """Up to ``count`` free pages, each held once by the taker."""
        self.pool  # noqa: B018 (allocates on first use)
        with self._lock:
            taken, self._free = self._free[:count], self._free[count:]
            for page in taken:
                self._holds[page] = 1
        return taken

    def release(self, pages: Iterable[int]) -> None:
        """End one hold of each page; a page with none left is free again."""
        with self._lock:
            self._release_locked(pages)

    def quarantine(self, pages: Iterable[int]) -> int:
        """Hold ``pages`` once more for a call that timed out while using them (until
        :meth:`unquarantine`); returns how many pages that is."""
        count = 0
        with self._lock:
            for page in pages:
                self._holds[page] = self._holds.get(page, 0) + 1
                self._late[page] = self._late.get(page, 0) + 1
                count += 1
        return count

    def unquarantine(self, pages: Iterable[int]) -> None:
        """The late call using ``pages`` returned: end the hold :meth:`quarantine` added."""
        pages = list(pages)
        with self._lock:
            for page in pages:
                left = self._late.get(page, 0) - 1
                if left > 0:
                    self._late[page] = left
                else:
                    self._late.pop(page, None)
            self._release_locked(pages)

    def quarantined(self) -> int:
        """Pages a call that timed out still holds now (out of reuse until it returns)."""
        with self._lock:
            return len(self._late)

    def free_pages(self) -> int:
        """Pages free now."""
        with self._lock:
            return len(self._free)

    def _release_locked(self, pages: Iterable[int]) -> None:
        for page in pages:
            left = self._holds.get(page, 0) - 1
            if left > 0:
                self._holds[page] = left
            elif page in self._holds:
                del self._holds[page]
                self._free.append(page)


class LateGuard:
    """One bounded call's pages: quarantined if the call times out, until it returns.

    ``timed_out`` and ``returned`` may come in either order (the call may return late
    before its caller saw the timeout); the pages are quarantined only while the call
    is really still running.
    """

    def __init__(self, staging: StagingPool, pages: list[int]) -> None:
        self._staging = staging
        self._pages = pages
        self._lock = threading.Lock()
        self._returned = False
        self._held = False

    def timed_out(self) -> int:
        """The call timed out: hold its pages until it returns; how many were quarantined."""
        with self._lock:
            if self._returned:
                return 0
            self._held = True
            return self._staging.quarantine(self._pages)

    def returned(self, result: Any) -> None:
        """The call's ``on_late``: it returned at last; its pages may be reused."""
        with self._lock:
            self._returned = True
            held, self._held = self._held, False
        if held:
            self._staging.unquarantine(self._pages)
