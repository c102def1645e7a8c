"""The host pool as an L2 cache: a page-key index with LRU order, pins and write state.

Every host page that holds (or is being filled with) a keyed page has one :class:`Entry`.
An entry is *pinned* while anything uses its page (a transfer, a storage write, a
prefetch handle); a pinned entry is never evicted and its page never reused. Eviction
takes the least recently used unpinned, settled entries; an entry that ``write_back``
still has to write is handed to a writer first and freed when the write finishes. When
pins hold every page, allocation returns fewer pages than asked (never waits forever),
and the caller turns that into a clear failure.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Entry", "EntryState", "HostIndex", "PageAllocator"]


class PageAllocator(Protocol):
    """The allocator part of :class:`kvtier.core.host_pool.HostPool`."""

    @property
    def num_pages(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, pages: Sequence[int]) -> None: ...


class EntryState(enum.Enum):
    """PENDING: being filled; READY: holds the page; FAILED: dropped, page freed at unpin."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False, slots=True)
class Entry:
    """One keyed host page. Every field is guarded by the index lock."""

    key: str
    page: int
    state: EntryState = EntryState.PENDING
    pins: int = 0
    hits: int = 0
    #: written to host but not yet to storage, and write_back owes the write
    dirty: bool = False
    #: known to be in storage (written by us, or read from it)
    stored: bool = False
    #: a storage write of this page is queued or running
    writing: bool = False
    #: removed from the index; the page goes back to the pool at the last unpin
    detached: bool = False
    #: evict as soon as the pending write finishes (write_back)
    evict_after_write: bool = False
    #: the key of the page before it in its sequence (None: its first page, or not known),
    #: told to the storage tiers' policies when the page is written
    parent: str | None = None

    @property
    def ready(self) -> bool:
        return self.state is EntryState.READY


class HostIndex:
    """Key -> host page map with LRU eviction, reference counts and write bookkeeping."""

    def __init__(
        self,
        pool: PageAllocator,
        *,
        write_back: bool = False,
        on_evicted: Callable[[int], None] | None = None,
    ) -> None:
        self.pool = pool
        self.write_back = write_back
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._settled = threading.Condition(self._lock)
        #: dirty pages handed to writers for eviction, whose pages are not free yet
        self._promised = 0
        self._on_evicted = on_evicted

    # --- lookups --------------------------------------------------------------------

    def acquire_prefix(self, keys: Sequence[str]) -> list[Entry]:
        """Pin the entries of the leading keys that are present (ready or being filled)."""
        out: list[Entry] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                entry.pins += 1
                entry.hits += 1
                self._entries.move_to_end(key)
                out.append(entry)
        return out

    def contains(self, key: str) -> bool:
        """Whether the key has a ready or pending entry."""
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def discard(self, keys: Sequence[str]) -> int:
        """Drop ``keys``' entries whatever their state: never found again, never claimed
        for a storage write (one already running finishes); a page in use is freed at its
        last unpin. Returns how many entries were present."""
        free: list[int] = []
        present = 0
        with self._lock:
            for key in dict.fromkeys(keys):
                entry = self._entries.pop(key, None)
                if entry is None:
                    continue
                present += 1
                entry.detached = True
                entry.dirty = False
                if entry.pins == 0:
                    free.append(entry.page)
            self._free_locked(free)
        return present

    # --- insertion ------------------------------------------------------------------

    def insert(
        self,
        keys: Sequence[str],
        *,
        pins: int = 1,
        pin_existing: bool = False,
        wait_s: float = 0.0,
        wait_on_pins: bool = True,
        on_victims: Callable[[list[Entry]], None],
        parents: Sequence[str | None] | None = None,
    ) -> list[tuple[Entry, bool]]:
        """Make pending entries for ``keys``, allocating (and evicting) host pages.

        Returns ``(entry, is_new)`` aligned with ``keys``: a fresh pending entry pinned
        ``pins`` times, or the entry the key already had (its hit count bumped; pinned once
        if ``pin_existing``). It stops at the first key no page could be found for, so it
        may be shorter than ``keys``. Dirty pages that eviction picks (write_back) go to
        ``on_victims``, outside the lock, each pinned once; the writer hands them back
        through :meth:`finish_write`. Waits at most ``wait_s`` for pages that in-flight
        writes (and, with ``wait_on_pins``, other pins) will release; never longer.
        ``parents`` (aligned with ``keys``) is each fresh entry's :attr:`Entry.parent`.
        """
        deadline = time.monotonic() + wait_s
        out: list[tuple[Entry, bool]] = []
        victims: list[Entry] = []
        with self._lock:
            wanted = 0
            for key in dict.fromkeys(keys):
                if key in self._entries:
                    self._entries.move_to_end(key)  # present pages are not eviction fodder
                else:
                    wanted += 1
            pages = self._allocate_locked(wanted, victims)
            while len(pages) < wanted and wait_s > 0:
                if victims:  # hand them to a writer now: their pages are what we wait for
                    batch, victims = victims, []
                    self._lock.release()
                    try:
                        on_victims(batch)
                    finally:
                        self._lock.acquire()
                    pages += self._allocate_locked(wanted - len(pages), victims)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._waitable_locked(wait_on_pins):
                    break
                self._freed.wait(remaining)
                pages += self._allocate_locked(wanted - len(pages), victims)
            supply = iter(pages)
            for at, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None:
                    entry.hits += 1
                    if pin_existing:
                        entry.pins += 1
                    out.append((entry, False))
                    continue
                page = next(supply, None)
                if page is None:
                    break
                entry = Entry(key=key, page=page, pins=pins)
                if parents is not None:
                    entry.parent = parents[at]
                self._entries[key] = entry
                out.append((entry, True))
            leftover = list(supply)
            if leftover:
                self._free_locked(leftover)
        if victims:
            on_victims(victims)
        return out

    def _waitable_locked(self, on_pins: bool) -> bool:
        """Whether a page may be freed soon: a write-back in flight, or (``on_pins``) a pin."""
        return any(
            (e.writing and e.evict_after_write) or (on_pins and e.pins)
            for e in self._entries.values()
        )

    def _allocate_locked(self, n: int, victims: list[Entry]) -> list[int]:
        """Up to ``n`` pages: free ones first, then LRU evictions of unpinned, settled pages."""
        if n <= 0:
            return []
        shortfall = n - self.pool.num_free - self._promised
        if shortfall > 0:
            self._evict_locked(shortfall, victims)
        return self.pool.allocate(min(n, self.pool.num_free))

    def _evict_locked(self, needed: int, victims: list[Entry]) -> None:
        """Evict up to ``needed`` LRU pages; dirty ones (write_back) go to ``victims`` first.

        A dirty victim counts toward ``needed``: its page comes free once written.
        """
        chosen: list[Entry] = []
        promised = 0
        for entry in self._entries.values():  # LRU first; stops early, no copy of the map
            if len(chosen) + promised >= needed:
                break
            if entry.pins or entry.state is not EntryState.READY or entry.writing:
                continue
            if self.write_back and entry.dirty:
                entry.writing = True
                entry.evict_after_write = True
                entry.pins += 1
                victims.append(entry)
                promised += 1
                self._promised += 1
                continue
            chosen.append(entry)
        for entry in chosen:
            del self._entries[entry.key]
            entry.detached = True
        if chosen:
            self.pool.free([entry.page for entry in chosen])
            if self._on_evicted is not None:
                self._on_evicted(len(chosen))

    # --- state changes ---------------------------------------------------------------

    def mark_ready(self, entries: Sequence[Entry], *, stored: bool = False) -> None:
        """The pages are filled: readers may use them."""
        with self._lock:
            for entry in entries:
                if entry.state is EntryState.PENDING:
                    entry.state = EntryState.READY
                    entry.stored = entry.stored or stored
            self._settled.notify_all()

    def mark_dirty(self, entries: Sequence[Entry]) -> None:
        """write_back owes these pages a storage write (at eviction or close)."""
        with self._lock:
            for entry in entries:
                if not entry.stored:
                    entry.dirty = True

    def mark_failed(self, entries: Sequence[Entry]) -> None:
        """The pages could not be filled: drop them from the index; free at the last unpin."""
        free: list[int] = []
        with self._lock:
            for entry in entries:
                if entry.state is EntryState.READY:
                    continue
                entry.state = EntryState.FAILED
                if not entry.detached:
                    if self._entries.get(entry.key) is entry:
                        del self._entries[entry.key]
                    entry.detached = True
                if entry.pins == 0:
                    free.append(entry.page)
            self._free_locked(free)
            self._settled.notify_all()

    def wait_settled(self, entries: Sequence[Entry], timeout: float | None) -> None:
        """Wait until the leading entries are filled, up to the first that failed.

        Returns when every entry is READY, at the first FAILED one, or after ``timeout``
        seconds (None: no limit), whichever comes first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._settled:
            for entry in entries:
                while entry.state is EntryState.PENDING:
                    if deadline is None:
                        self._settled.wait()
                        continue
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._settled.wait(remaining)
                if entry.state is not EntryState.READY:
                    return

    def release(self, entries: Sequence[Entry]) -> None:
        """Drop one pin from each entry; a detached entry's page is freed at its last pin."""
        free: list[int] = []
        with self._lock:
            for entry in entries:
                if entry.pins <= 0:
                    raise RuntimeError(f"entry {entry.key!r} released more often than pinned")
                entry.pins -= 1
                if entry.pins == 0 and entry.detached:
                    free.append(entry.page)
            self._free_locked(free)
            self._freed.notify_all()  # an unpinned page may now be evicted by a waiter

    def claim_writes(self, entries: Sequence[Entry]) -> list[Entry]:
        """Pin and mark for writing the ready entries not yet stored nor being written."""
        out: list[Entry] = []
        with self._lock:
            for entry in entries:
                if (
                    entry.state is EntryState.READY
                    and not entry.stored
                    and not entry.writing
                    and not entry.detached
                ):
                    entry.writing = True
                    entry.pins += 1
                    out.append(entry)
        return out

    def claim_dirty(self) -> list[Entry]:
        """Claim every dirty, ready entry for writing (write_back's flush at close)."""
        with self._lock:
            dirty = [e for e in self._entries.values() if e.dirty and e.ready and not e.writing]
            for entry in dirty:
                entry.writing = True
                entry.pins += 1
        return dirty

    def finish_write(self, entries: Sequence[Entry], results: Sequence[bool]) -> None:
        """A claimed write ended: record it, unpin, and evict if eviction was waiting on it."""
        free: list[int] = []
        evicted = 0
        with self._lock:
            for entry, ok in zip(entries, results, strict=True):
                entry.writing = False
                if ok:
                    entry.stored = True
                entry.dirty = False  # written or given up: never retried forever
                entry.pins -= 1
                if entry.evict_after_write:
                    entry.evict_after_write = False
                    self._promised -= 1
                    if not entry.detached and entry.pins == 0:
                        if self._entries.get(entry.key) is entry:
                            del self._entries[entry.key]
                        entry.detached = True
                        free.append(entry.page)
                        evicted += 1
                        continue
                if entry.pins == 0 and entry.detached:
                    free.append(entry.page)
            self._free_locked(free)
        if evicted and self._on_evicted is not None:
            self._on_evicted(evicted)

    def _free_locked(self, pages: list[int]) -> None:
        if pages:
            self.pool.free(pages)
            self._freed.notify_all()

    # --- introspection --------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Pages by state, for stats and gauges."""
        with self._lock:
            entries = list(self._entries.values())
            free = self.pool.num_free
        pinned = sum(1 for e in entries if e.pins)
        return {
            "total": self.pool.num_pages,
            "free": free,
            "cached": len(entries),
            "pinned": pinned,
            "pending": sum(1 for e in entries if e.state is EntryState.PENDING),
            "dirty": sum(1 for e in entries if e.dirty),
        }

    def drop_all(self) -> None:
        """Forget every unpinned entry and free its page (close, after workers stopped)."""
        with self._lock:
            free = []
            for key, entry in list(self._entries.items()):
                del self._entries[key]
                entry.detached = True
                if entry.pins == 0:
                    free.append(entry.page)
            self._free_locked(free)
