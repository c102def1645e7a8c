"""The handles a TieredCache returns: the state of one backup, a prefetch in flight.

A prefetch handle holds only what it needs to wait for and release its pages (the host
index's :class:`HostPins` operations) and the options that say how long to wait, never
the cache itself. The methods under "recorded by the cache" are the cache's side:
package-internal, named plainly so no module reaches into another's private state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier.cache.index import Entry, EntryState
from kvtier.cache.options import CacheOptions
from kvtier.core.errors import InvalidFieldError
from kvtier.core.streams import Fence

__all__ = ["BackupHandle", "HostPins", "PrefetchHandle"]


class HostPins(Protocol):
    """What a prefetch handle needs of the host index: wait for its pages, unpin them."""

    def wait_settled(self, entries: Sequence[Entry], timeout: float | None) -> None: ...

    def release(self, entries: Sequence[Entry]) -> None: ...


class BackupHandle:
    """The state of one ``backup``: host copy done, storage write done, failures."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        #: Set once the device slots may be reused (the pages are in the host pool or failed).
        self.host_done = threading.Event()
        #: Set once nothing more will happen (storage write finished where the policy writes).
        self.finished = threading.Event()
        self.pages_copied = 0
        self.pages_cached = 0
        self.pages_written = 0
        self.pages_failed = 0
        #: Pages this backup owed storage that were not stored (refused, failed, timed out
        #: or cancelled): in the host pool, not in storage.
        self.pages_unwritten = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._writes_pending = 0

    @property
    def ok(self) -> bool:
        """True when every page reached the host pool (or was there already)."""
        return self.finished.is_set() and self.pages_failed == 0

    def wait_host(self, timeout: float | None = None) -> bool:
        """Wait until the device slots may be reused; False on timeout."""
        return self.host_done.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the backup (and any storage write it owes) has finished."""
        return self.finished.wait(timeout)

    # --- recorded by the cache (package-internal) --------------------------------------

    def record_failure(self, pages: int, error: BaseException) -> None:
        """``pages`` failed; the first error is kept as :attr:`error`."""
        with self._lock:
            self.pages_failed += pages
            if self.error is None:
                self.error = error

    def finish(self) -> None:
        """Nothing more will happen (the backup failed or was cancelled before writes)."""
        self.host_done.set()
        self.finished.set()

    def write_started(self) -> None:
        """A storage write this backup owes was queued."""
        with self._lock:
            self._writes_pending += 1

    def write_ended(self, written: int, unwritten: int) -> None:
        """One owed storage write ended: ``written`` pages stored, ``unwritten`` not."""
        with self._lock:
            self.pages_written += written
            self.pages_unwritten += unwritten
            self._writes_pending -= 1
            done = self._writes_pending == 0 and self.host_done.is_set()
        if done:
            self.finished.set()

    def host_ended(self) -> None:
        """The device -> host part is over; finished once the owed writes are too."""
        with self._lock:
            self.host_done.set()
            done = self._writes_pending == 0
        if done:
            self.finished.set()

    def __repr__(self) -> str:
        return (
            f"BackupHandle(pages={len(self.keys)}, copied={self.pages_copied}, "
            f"cached={self.pages_cached}, written={self.pages_written}, "
            f"failed={self.pages_failed}, unwritten={self.pages_unwritten}, "
            f"finished={self.finished.is_set()})"
        )


class PrefetchHandle:
    """A prefetch in flight: the leading pages ready so far, cancel, wait, release.

    The handle pins its host pages until it is loaded (all layers) or released, so they
    cannot be evicted in between. Use it as a context manager, or call :meth:`release`.
    ``pins`` is the host index that pinned them; ``options`` the cache's, for its policy;
    ``on_release`` runs once at release (the cache drops its storage pins there).
    """

    def __init__(
        self,
        pins: HostPins,
        options: CacheOptions,
        keys: Sequence[str],
        entries: list[Entry],
        host_hits: int,
        started: float,
        *,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._pins = pins
        self._on_release = on_release
        self._options = options
        self.keys = list(keys)
        self._entries = entries
        #: Pages found in the host pool when the prefetch started.
        self.host_hits = host_hits
        #: Pages the prefetch reads (or waits for) beyond the host hits.
        self.storage_hits = len(entries) - host_hits
        self.started = started
        self.cancelled = False
        self._released = False
        self._usable: int | None = None
        self._layers_loaded: set[int] = set()
        #: Copies out of the handle's host pages still running (CUDA), by layer (None: all).
        self._fences: dict[int | None, Fence] = {}
        self._lock = threading.Lock()
        self.finished = threading.Event()  # set by the fetch job (or at once if none)

    @property
    def pins(self) -> HostPins:
        """The host index holding this handle's pins (a cache loads only its own handles)."""
        return self._pins

    @property
    def planned_pages(self) -> int:
        """Leading pages the prefetch found (host plus storage) and is bringing in."""
        return len(self._entries)

    @property
    def ready_pages(self) -> int:
        """Leading pages whose data is in the host pool now."""
        count = 0
        for entry in self._entries:
            if entry.state is not EntryState.READY:
                break
            count += 1
        return count

    @property
    def done(self) -> bool:
        """Whether every planned page is ready or has failed (nothing still in flight)."""
        return all(e.state is not EntryState.PENDING for e in self._entries)

    def budget_s(self) -> float:
        """The ``timeout`` policy's budget: a base plus a slice per page read from storage."""
        opts = self._options
        return opts.timeout_base_s + opts.timeout_per_page_s * self.storage_hits

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the prefetch is done or ``timeout`` passes; return the ready pages."""
        self._pins.wait_settled(list(self._entries), timeout)
        return self.ready_pages

    def cancel(self) -> int:
        """Stop reading pages that have not started; return the pages ready now."""
        self.cancelled = True
        return self.ready_pages

    def settle(self) -> int:
        """Fix the usable prefix per the cache's prefetch policy (first call decides)."""
        with self._lock:
            if self._released:
                raise InvalidFieldError(
                    "handle",
                    "this prefetch handle was already loaded (all layers) or released; "
                    "prefetch the keys again",
                    value=self,
                )
            if self._usable is not None:
                return self._usable
        opts = self._options
        if opts.prefetch_policy == "wait_complete":
            self.wait(opts.max_load_wait_s)
        elif opts.prefetch_policy == "timeout":
            budget = self.started + self.budget_s() - time.monotonic()
            self.wait(min(max(0.0, budget), opts.max_load_wait_s))
        with self._lock:
            if self._usable is None:
                self._usable = self.ready_pages
                spare = self._entries[self._usable :]
                self._entries = self._entries[: self._usable]
                if spare:
                    self._pins.release(spare)
            return self._usable

    def host_pages(self) -> list[int]:
        """The host pages of the settled prefix (for engines that drive the IO backend)."""
        usable = self.settle()
        return [entry.page for entry in self._entries[:usable]]

    def order(self, layer: int | None = None) -> None:
        """Make the caller's current stream wait for the loads of ``layer`` (None: every
        load so far): what a caller of ``load(..., ordered=False)`` does before it uses a
        layer. The host does not wait; off CUDA there is nothing to wait for."""
        fences: list[Fence | None]
        with self._lock:
            if layer is None:
                fences = list(self._fences.values())
            else:  # that layer's load, or a load of every layer
                fences = [self._fences.get(layer), self._fences.get(None)]
        for fence in fences:
            if fence is not None:
                fence.order()

    @property
    def copies_done(self) -> bool:
        """Whether every load from the handle's pages has reached the device (never blocks;
        always true off CUDA): a caller polls it before it uses the pages or releases."""
        with self._lock:
            fences = list(self._fences.values())
        return all(fence.passed for fence in fences)

    def release(self) -> None:
        """Unpin the handle's host pages; idempotent. Loading all layers does it for you.

        Copies still reading the pages (CUDA loads) are waited for first: an unpinned
        page may be evicted and overwritten at once."""
        with self._lock:
            if self._released:
                return
            self._released = True
            fences, self._fences = list(self._fences.values()), {}
        for fence in fences:
            fence.synchronize()
        with self._lock:
            entries, self._entries = self._entries, []
            self._usable = 0 if self._usable is None else self._usable
            on_release, self._on_release = self._on_release, None
        if entries:
            self._pins.release(entries)
        if on_release is not None:
            on_release()

    # --- recorded by the cache's load (package-internal) --------------------------------

    @property
    def layers_loaded(self) -> int:
        """How many distinct layers of the settled prefix were loaded (per-layer loads)."""
        return len(self._layers_loaded)

    def add_fence(self, layer: int | None, fence: Fence) -> None:
        """A load of ``layer`` (None: all layers) from these pages was queued up to ``fence``."""
        if fence.passed:
            return
        with self._lock:
            self._fences[layer] = fence

    def layer_loaded(self, layer: int) -> int:
        """Record that ``layer`` was loaded; return :attr:`layers_loaded`."""
        self._layers_loaded.add(layer)
        return len(self._layers_loaded)

    def __enter__(self) -> PrefetchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"PrefetchHandle(keys={len(self.keys)}, host_hits={self.host_hits}, "
            f"storage_hits={self.storage_hits}, ready={self.ready_pages}, "
            f"cancelled={self.cancelled}, released={self._released})"
        )
