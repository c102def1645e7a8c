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
from kvtier.backends.filestore import paths, writes
from kvtier.backends.filestore.store import FileStore
from kvtier.core.errors import StorageError
from kvtier.core.layout import ALIGNMENT
from kvtier.core.storage import BackendContext, PageBuffers, StorageBackend

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
        self._fs = FileStore(self.config, namespace, "file", log)  # opened, swept, indexed
        self.store = self._fs.path
        self._store_str = self._fs.path_str
        self.index = self._fs.index
        self._counters = self._fs.counters
        self._warn_once = self._fs.warn_once
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    # --- helpers -------------------------------------------------------------------------

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
        expected = sum(e.length for e in page)
        direct = self._direct_for(page)
        fd = self._fs.open_page(key, final, expected, direct=direct, blocking=False)
        if fd is None:
            return False
        try:
            got = _preadv_all(fd, [e.view for e in page])
        except OSError as exc:
            self._warn_once("get_errors", "file backend: reading %s failed: %s", final, exc)
            return False
        finally:
            os.close(fd)
        if got != expected:
            self._counters.add("get_short_reads")
            return False
        self.index.touch(key, expected)
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
            fd, tmp = self._fs.open_temp(final, o_direct=direct)
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
            self._fs.publish(tmp, final)
        except OSError as exc:  # nothing was published: the temp file is still ours
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
        return self._fs.delete(keys)

    def clear(self) -> None:
        self._check_open()
        self._fs.clear()

    def rescan(self) -> int:
        """Sweep the store and rebuild the index from disk (pages other processes wrote)."""
        return self._fs.rescan()

    def stats(self) -> dict[str, int | float]:
        return self._fs.stats()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
