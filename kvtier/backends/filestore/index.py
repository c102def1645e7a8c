"""The in-memory index of a store: sizes, capacity through a policy, the free-space guard.

In a storage chain the policy's space is owned (:attr:`EvictionPolicy.space_owned`): the
tier's space manager reads :meth:`FileIndex.space` and decides what leaves; ``reserve``
then refuses a page that does not fit (``capacity``, ``min_free_space``) and evicts nothing.
Opened bare (no chain), the index evicts through its policy itself.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvtier.backends.filestore.debris import Debris, discard
from kvtier.backends.filestore.paths import page_path_str, page_path_unchecked
from kvtier.core.keys import validate_keys
from kvtier.core.policy import EvictionPolicy, LRUPolicy
from kvtier.core.space import SpaceReport

__all__ = ["FileIndex"]

log = logging.getLogger(__name__)


class FileIndex:
    """The in-memory index of one store: key -> size, capacity and free space.

    Thread-safe. ``reserve`` makes room before a write (evicting the pages ``eviction``
    chooses: least recently used first when it is None, the built-in ``lru`` policy;
    none when the policy's space is owned by a chain, see the module docstring),
    ``commit`` records a published page, ``release`` undoes a reservation whose write
    failed. Every page's arrival, read and departure is recorded in the policy.
    """

    def __init__(
        self,
        store: Path,
        *,
        capacity_bytes: int | None = None,
        min_free_bytes: int = 0,
        check_disk_on_miss: bool = True,
        debris: Debris | None = None,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        self.store = store
        self.debris = debris if debris is not None else Debris("file")
        self._store_str = os.fspath(store)
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = min_free_bytes
        self.check_disk_on_miss = check_disk_on_miss
        self._lock = threading.Lock()
        #: Chooses the pages that leave; told of every page, under this index's lock.
        self.eviction: EvictionPolicy = eviction if eviction is not None else LRUPolicy()
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self._pending = 0
        self.evictions = 0
        self.evicted_bytes = 0

    # --- start-up ----------------------------------------------------------------------

    def load(self, pages: Iterable[tuple[str, int, float]]) -> int:
        """Replace the index with ``pages`` (key, size, mtime), oldest first; their count."""
        with self._lock:
            self._forget_all_locked()
            for key, size, _mtime in pages:
                self._sizes[key] = size
                self.eviction.record_insert(key, size)
            self._bytes = sum(self._sizes.values())
            return len(self._sizes)

    # --- lookups -----------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the pages in this index."""
        with self._lock:
            return self._bytes

    def stats(self) -> dict[str, int | float]:
        """The index's part of a backend's ``stats()``: pages, bytes and evictions."""
        return {
            "pages": len(self),
            "bytes": self.stored_bytes,
            "evictions": self.evictions,
            "evicted_bytes": self.evicted_bytes,
        }

    def space(self) -> SpaceReport:
        """The bytes of the published pages, and the room left before ``reserve`` refuses
        one: within ``capacity_bytes`` and above ``min_free_bytes`` of the disk (None:
        neither is set). Reservations in flight are not subtracted (the caller's)."""
        with self._lock:
            used = self._bytes
        room: list[int] = []
        if self.capacity_bytes is not None:
            room.append(self.capacity_bytes - used)
        if self.min_free_bytes > 0:
            room.append(self._free_bytes() - self.min_free_bytes)
        return SpaceReport(used, max(0, min(room)) if room else None, self.capacity_bytes)

    @staticmethod
    def page_cost(nbytes: int) -> int:
        """A page costs its file's size, as ``capacity_bytes`` and the free-space guard
        count it (the file system's block rounding and inode are not counted)."""
        return nbytes

    def keys(self) -> list[str]:
        """The indexed keys: least recently used first under the default LRU policy,
        in the order they were indexed under another."""
        with self._lock:
            if isinstance(self.eviction, LRUPolicy):
                return [key for key in self.eviction.order() if key in self._sizes]
            return list(self._sizes)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored: the index, then (optionally) one stat on a miss."""
        return self.contains_many([key])[0]

    def indexed(self, keys: Sequence[str]) -> list[bool]:
        """Whether each (already checked) key is in the index now; no disk look-up."""
        with self._lock:
            sizes = self._sizes
            return [key in sizes for key in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`contains` for a batch: one lock for the index lookups, then the misses.

        A key found in the index was checked when it got there; the other keys are checked
        together (one pass; a bad one raises) before their files are looked up, each with
        one ``access`` (no exception raised for a missing file: a cold lookup's keys are
        mostly missing) and an ``lstat`` only for a file that is there.
        """
        found = self.indexed(keys)
        misses = [i for i, hit in enumerate(found) if not hit]
        if not misses:
            return found
        validate_keys([keys[i] for i in misses])
        if self.check_disk_on_miss:
            store, access, exists = self._store_str, os.access, os.F_OK
            for i in misses:
                path = page_path_unchecked(store, keys[i])
                found[i] = access(path, exists, follow_symlinks=False) and self._adopt(
                    keys[i], path
                )
        return found

    def adopt(self, key: str) -> bool:
        """Add ``key`` to the index if its file exists (another process wrote it)."""
        return self._adopt(key, page_path_str(self._store_str, key))

    def _adopt(self, key: str, path: str) -> bool:
        """:meth:`adopt` of a checked ``key`` whose page name is ``path``."""
        try:
            info = os.stat(path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not stat.S_ISREG(info.st_mode):
            return False
        with self._lock:
            if key not in self._sizes:
                self._sizes[key] = info.st_size
                self._bytes += info.st_size
                self.eviction.record_insert(key, info.st_size)
        return True

    def touch(self, key: str, size: int | None = None) -> None:
        """Mark ``key`` as just used (adding it with ``size`` if it was not indexed)."""
        with self._lock:
            if key in self._sizes:
                self.eviction.record_access(key)
            elif size is not None:
                self._sizes[key] = size
                self._bytes += size
                self.eviction.record_insert(key, size)

    def touch_many(self, pages: Sequence[tuple[str, int]]) -> None:
        """:meth:`touch` for a batch of (key, size), under one lock."""
        if not pages:
            return
        with self._lock:
            sizes, eviction = self._sizes, self.eviction
            for key, size in pages:
                if key in sizes:
                    eviction.record_access(key)
                else:
                    sizes[key] = size
                    self._bytes += size
                    eviction.record_insert(key, size)

    def forget(self, key: str) -> int | None:
        """Drop ``key`` from the index (its file is gone); return its size if it was there."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._bytes -= size
                self.eviction.record_remove(key)
            return size

    # --- writes ------------------------------------------------------------------------

    def _free_bytes(self) -> int:
        info = os.statvfs(self.store)
        return info.f_bavail * info.f_frsize

    def reserve(self, key: str, nbytes: int) -> str | None:
        """Make room for a page of ``nbytes``; None when it fits, else why it cannot."""
        return self.reserve_many([(key, nbytes)])[0]

    def reserve_many(self, pages: Sequence[tuple[str, int]]) -> list[str | None]:
        """:meth:`reserve` for a batch of ``(key, nbytes)``: one lock and one ``statvfs``.

        The free space is looked up once and each reserved page counted off it, so the
        batch as a whole leaves ``min_free_bytes`` free.
        """
        refused: list[str | None] = []
        with self._lock:
            free = self._free_bytes() if self.min_free_bytes > 0 and pages else 0
            for key, nbytes in pages:
                reason, free = self._reserve_locked(key, nbytes, free)
                refused.append(reason)
                if reason is None:
                    free -= nbytes
                    self._pending += nbytes
        return refused

    def _reserve_locked(self, key: str, nbytes: int, free: int) -> tuple[str | None, int]:
        """Evict until ``key``'s page of ``nbytes`` fits; why not (or None), and the bytes
        free on disk after the evictions (``free``: before them)."""
        owned = self.eviction.space_owned  # the chain's space manager makes the room
        if self.capacity_bytes is not None:
            if nbytes > self.capacity_bytes:
                return "page_larger_than_capacity", free
            replaced = self._sizes.get(key, 0)  # (``key`` itself is never a victim)
            while (over := self._bytes - replaced + self._pending + nbytes) > self.capacity_bytes:
                freed = 0 if owned else self._evict_locked(over - self.capacity_bytes, protect=key)
                if not freed:
                    return "capacity", free
                free += freed
        if self.min_free_bytes > 0:
            while free - nbytes < self.min_free_bytes:
                needed = self.min_free_bytes + nbytes - free
                freed = 0 if owned else self._evict_locked(needed, protect=key)
                if not freed:
                    return "min_free_space", free
                free += freed
        return None, free

    def release(self, nbytes: int) -> None:
        """Undo a reservation whose write failed."""
        with self._lock:
            self._pending -= nbytes

    def commit(self, key: str, nbytes: int) -> None:
        """Record a published page (replacing any older size) as most recently used."""
        self.commit_many([(key, nbytes)])

    def commit_many(self, pages: Sequence[tuple[str, int]]) -> None:
        """:meth:`commit` for a batch of ``(key, nbytes)`` under one lock."""
        with self._lock:
            sizes, eviction = self._sizes, self.eviction
            for key, nbytes in pages:
                self._pending -= nbytes
                old = sizes.pop(key, None)
                if old is not None:
                    self._bytes -= old
                sizes[key] = nbytes
                self._bytes += nbytes
                eviction.record_insert(key, nbytes)  # new, or re-written: just used

    def _evict_locked(self, needed: int, *, protect: str) -> int:
        """Unlink the policy's victims (never ``protect``) for ``needed`` bytes; the bytes
        freed (a page of 0 bytes counts 1), or 0 when the policy gives up nothing more."""
        victims = self.eviction.choose_victims(
            needed, pinned=lambda candidate: candidate == protect
        )
        freed = 0
        for victim in victims:
            size = self._sizes.pop(victim, None)
            self.eviction.record_remove(victim)
            if size is None:  # the policy named a page this index does not hold
                continue
            self._bytes -= size
            try:
                self.unlink_page(victim)
            except OSError as exc:
                log.warning("could not evict page %s: %s", victim, exc)
            self.evictions += 1
            self.evicted_bytes += size
            freed += max(size, 1)
        return freed

    # --- removal -----------------------------------------------------------------------

    def unlink_page(self, key: str) -> bool:
        """Unlink ``key``'s page file; True if one was removed.

        Missing is fine (another process evicted or deleted it). Anything else under the
        page's name (a directory, a symlink...) is debris: removed, logged and counted,
        never followed, and no page was removed.
        """
        path = page_path_str(self._store_str, key)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                discard(path, self.debris, where="a page")
                return False
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def remove(self, key: str) -> bool:
        """Unlink ``key``'s page and drop it from the index; True if a file was removed."""
        self.forget(key)
        return self.unlink_page(key)

    def drop_all(self) -> None:
        """Forget every page (``clear`` then unlinks what a sweep finds)."""
        with self._lock:
            self._forget_all_locked()

    def _forget_all_locked(self) -> None:
        for key in self._sizes:
            self.eviction.record_remove(key)
        self._sizes.clear()
        self._bytes = 0
