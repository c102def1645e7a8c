"""The ``file`` backend: one file per page under a root directory, on local disk.

Pages are written with ``os.pwritev`` straight from the host pool's extents into a temp
file and published by an atomic rename; they are read back with ``os.preadv`` straight
into the extents. No staging copy, no bytes objects. Batches run on a small thread pool
(the calls release the GIL), so cold reads keep several requests in flight. The on-disk
scheme, index, LRU capacity and free-space guard live in :mod:`kvtier.backends.filestore`
and are shared with the io_uring backend.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.backends.file.config import FileConfig
from kvtier.backends.filestore import paths, startup, writes
from kvtier.backends.filestore.index import FileIndex
from kvtier.core.errors import StorageError
from kvtier.core.layout import ALIGNMENT
from kvtier.core.storage import BackendContext, Counters, PageBuffers, StorageBackend

__all__ = ["FileBackend"]

log = logging.getLogger(__name__)


def _preadv_all(fd: int, views: list[memoryview]) -> int:
    """Fill every region from offset 0 onwards; stops early only at end of file."""
    offset = 0
    while views:
        batch = views[: writes.IOV_MAX]
        got = os.preadv(fd, batch, offset)
        if got == 0:
            break
        offset += got
        views = writes.advance_views(views, got)
    return offset


class FileBackend(StorageBackend):
    """Pages as files under ``root/<namespace>``; see :mod:`kvtier.backends.filestore`."""

    def __init__(
        self, config: FileConfig | None = None, context: BackendContext | None = None
    ) -> None:
        self.config = config or FileConfig()
        self.context = context
        namespace = context.namespace if context is not None else "default"
        self.store = startup.prepare_store(self.config.root, namespace)
        self._store_str = os.fspath(self.store)
        if self.config.o_direct:
            writes.probe_o_direct(self.store, self.config.root)
        self.index = FileIndex(
            self.store,
            capacity_bytes=self.config.capacity_bytes,
            min_free_bytes=self.config.min_free_bytes,
            check_disk_on_miss=self.config.check_disk_on_miss,
        )
        found = self.index.rebuild()
        self._counters = Counters()
        self._counters.set("pages_found_at_start", found)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._warned: set[str] = set()

    # --- helpers -------------------------------------------------------------------------

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        self._counters.add(what)
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("file backend is closed; build a new one", value=str(self.store))

    def _map(self, fn: Callable[..., Any], *iterables: Sequence[Any]) -> list[Any]:
        """Run ``fn`` over a batch, on the thread pool when the batch has several items."""
        self._check_open()
        if len(iterables[0]) <= 1 or self.config.io_threads == 1:
            return list(map(fn, *iterables))
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.config.io_threads, thread_name_prefix="kvtier-file"
                )
        return list(self._executor.map(fn, *iterables))

    def _direct_for(self, page: PageBuffers) -> bool:
        if not self.config.o_direct:
            return False
        if writes.direct_aligned(page):
            return True
        self._warn_once(
            "o_direct_fallbacks",
            "file backend: a page's extents are not %d-byte aligned; using buffered I/O "
            "for such pages (counted as o_direct_fallbacks)",
            ALIGNMENT,
        )
        return False

    # --- contract ------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        return self.index.contains_many(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        paths.check_keys(keys)
        if len(keys) != len(pages):
            raise StorageError(f"get: {len(keys)} keys but {len(pages)} pages", value=keys)
        return self._map(self._get_one, keys, pages)

    def _get_one(self, key: str, page: PageBuffers) -> bool:
        final = paths.page_path_str(self._store_str, key)
        flags = os.O_RDONLY | os.O_CLOEXEC
        if self._direct_for(page):
            flags |= os.O_DIRECT
        try:
            fd = os.open(final, flags)
        except (FileNotFoundError, NotADirectoryError):
            self.index.forget(key)  # another process deleted or evicted it
            self._counters.add("misses")
            return False
        except OSError as exc:
            self._warn_once("get_errors", "file backend: cannot open %s: %s", final, exc)
            return False
        try:
            expected = sum(e.length for e in page)
            size = os.fstat(fd).st_size
            if size != expected:
                self._counters.add("get_size_mismatch")
                return False
            got = _preadv_all(fd, [e.view for e in page])
        except OSError as exc:
            self._warn_once("get_errors", "file backend: reading %s failed: %s", final, exc)
            return False
        finally:
            os.close(fd)
        if got != expected:
            self._counters.add("get_short_reads")
            return False
        self.index.touch(key, size)
        self._counters.add("hits")
        self._counters.add("bytes_read", got)
        return True

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        paths.check_keys(keys)
        if len(keys) != len(pages):
            raise StorageError(f"put: {len(keys)} keys but {len(pages)} pages", value=keys)
        if self.config.fsync != "batch":
            return [r is True for r in self._map(self._put_one, keys, pages)]
        # batch: write and fsync every temp file, then publish all, then sync each dir once
        written = self._map(self._put_one, keys, pages, [False] * len(keys))
        results: list[bool] = []
        directories: set[Path] = set()
        for key, outcome in zip(keys, written, strict=True):
            if outcome is False:
                results.append(False)
                continue
            tmp, final, nbytes = outcome
            results.append(self._publish(key, tmp, final, nbytes, sync_dir=False))
            directories.add(final.parent)
        for directory in directories:
            try:
                writes.fsync_dir(directory)
            except OSError as exc:
                self._warn_once("fsync_errors", "file backend: fsync of %s: %s", directory, exc)
        return results

    def _put_one(
        self, key: str, page: PageBuffers, publish_now: bool = True
    ) -> bool | tuple[Path, Path, int]:
        final = paths.page_path(self.store, key)
        nbytes = sum(e.length for e in page)
        refused = self.index.reserve(key, nbytes)
        if refused is not None:
            self._counters.add(f"put_failed_{refused}")
            return False
        direct = self._direct_for(page)
        tmp: Path | None = None
        try:
            fd, tmp = paths.open_temp(final, o_direct=direct)
            try:
                writes.pwritev_all(fd, [e.view for e in page])
                if self.config.fsync != "none":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            if tmp is not None:
                writes.unlink_quietly([tmp])
            self.index.release(nbytes)
            if writes.is_no_space(exc):
                self._warn_once(
                    "put_failed_no_space", "file backend: %s is full (%s)", self.store, exc
                )
            else:
                self._warn_once("put_failed_io", "file backend: writing %s: %s", final, exc)
            return False
        if not publish_now:
            return tmp, final, nbytes
        return self._publish(key, tmp, final, nbytes, sync_dir=self.config.fsync == "page")

    def _publish(self, key: str, tmp: Path, final: Path, nbytes: int, *, sync_dir: bool) -> bool:
        try:
            writes.publish(tmp, final)
        except OSError as exc:
            writes.unlink_quietly([tmp])
            self.index.release(nbytes)
            self._warn_once("put_failed_io", "file backend: publishing %s: %s", final, exc)
            return False
        self.index.commit(key, nbytes)
        if sync_dir:
            try:
                writes.fsync_dir(final.parent)
            except OSError as exc:
                self._warn_once("fsync_errors", "file backend: fsync of %s: %s", final, exc)
        self._counters.add("puts")
        self._counters.add("bytes_written", nbytes)
        return True

    def delete(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        paths.check_keys(keys)
        return [self.index.remove(key) for key in keys]

    def clear(self) -> None:
        self._check_open()
        self.index.remove_all()

    def rescan(self) -> int:
        """Rebuild the index from disk (pages other processes wrote); return the count."""
        return self.index.rebuild()

    def stats(self) -> dict[str, int | float]:
        return {**self._counters.snapshot(), **self.index.stats()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
