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
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from kvtier.backends.file.config import FileConfig
from kvtier.backends.filestore import compiled, paths, writes
from kvtier.backends.filestore.slices import Slices, copy_threads
from kvtier.backends.filestore.store import FileStore
from kvtier.core.envelope import BatchEnvelope
from kvtier.core.errors import StorageError
from kvtier.core.storage import BackendContext, PageBuffers, StorageBackend

__all__ = ["FileBackend"]

log = logging.getLogger(__name__)

#: A page written under its temp name, not yet published: (tmp, final, bytes, its file).
_Written = tuple[str, str, int, writes.FileId]
_T = TypeVar("_T")


#: Large pages are read in pieces of this size, each hashed while it is in cache (256 KiB
#: measured best here: 0.64 -> 0.81 of header-only verification on 8 MiB pages).
PIECE = 256 << 10


def _preadv_all(fd: int, views: list[memoryview], offset: int = 0) -> int:
    """Fill every region from ``offset`` onwards; stops early only at end of file.

    Returns the bytes read."""
    start = offset
    while views:
        batch = views[: writes.IOV_MAX]
        got = os.preadv(fd, batch, offset)
        if got == 0:
            break
        offset += got
        views = writes.advance_views(views, got)
    return offset - start


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
        self._slices = Slices(self.config.io_threads, "kvtier-file")
        self._lock = threading.Lock()
        self._closed = False
        #: Per writing thread, the file a replaced page left, kept for the next overwrite.
        self._spares = compiled.Spares()
        if self.config.compiled_io and not compiled.available():
            log.info(
                "file backend: the compiled page loop is not built (%s); using the Python "
                "loop (same files, more time per page)",
                compiled.MISSING,
            )

    @property
    def checks_envelopes(self) -> bool:
        """Whether this backend writes and checks envelopes in its compiled loop."""
        return self.config.compiled_io and compiled.available()

    # --- helpers -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("file backend is closed; build a new one", value=str(self.store))

    def _map(self, fn: Callable[[int], _T], count: int) -> list[_T]:
        """``[fn(i) for i in range(count)]``, spread over ``io_threads`` threads."""
        return self._spread(lambda lo, hi: [fn(i) for i in range(lo, hi)], count)

    def _spread(
        self, run: Callable[[int, int], list[_T]], count: int, most: int | None = None
    ) -> list[_T]:
        """``run(lo, hi)`` for consecutive slices of ``range(count)``, one per I/O thread
        (see :class:`~kvtier.backends.filestore.slices.Slices`); ``most`` caps them."""
        self._check_open()
        return self._slices.spread(run, count, most)

    # --- contract ------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        return self.index.contains_many(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        return self.get_with(keys, pages, None)

    def get_with(
        self,
        keys: Sequence[str],
        pages: Sequence[PageBuffers],
        on_filled: Callable[[int], object] | None,
        on_payload: Callable[[int, memoryview], object] | None = None,
        *,
        envelope: BatchEnvelope | None = None,
    ) -> list[bool]:
        """``get``, calling ``on_filled(i)`` in the I/O thread that just filled page ``i``.

        The core verifies a page there, while its bytes are still in that core's cache,
        so verification is spread over the I/O threads. A page larger than two
        :data:`PIECE` is read piece by piece, each handed to ``on_payload`` as it lands,
        so the core hashes it before the next piece pushes it out of cache. With
        ``envelope`` (see :class:`~kvtier.core.pagestore.EnvelopeHooks`) and the compiled
        loop, the envelopes are checked there instead.
        """
        paths.check_keys(keys)
        if len(keys) != len(pages):
            raise StorageError(f"get: {len(keys)} keys but {len(pages)} pages", value=keys)
        if envelope is not None and self.checks_envelopes:
            return self._got(keys, self._get_compiled(keys, pages, envelope, on_filled))

        def one(i: int) -> int:
            got = self._get_one(keys[i], pages[i], i, on_payload)
            if got and on_filled is not None:
                on_filled(i)
            return got

        return self._got(keys, self._map(one, len(keys)))

    def _get_compiled(
        self,
        keys: Sequence[str],
        pages: Sequence[PageBuffers],
        envelope: BatchEnvelope,
        on_filled: Callable[[int], object] | None,
    ) -> list[int]:
        """``get_with`` through the compiled loop; the bytes read per page.

        The batch is first read from the page cache alone (``nowait``), on no more
        threads than there are CPUs to copy with and than the batch has
        :data:`~kvtier.backends.filestore.slices.MIN_SLICE_BYTES` slices (a hand-off
        costs more than a small page's copy, and threads beyond the CPUs only take
        turns); only the pages that would wait for the disk then go to every I/O
        thread, where the waits overlap.
        """
        fs = self._fs
        count = len(keys)

        def blocking(which: Sequence[int]) -> list[int]:
            return self._spread(
                lambda lo, hi: compiled.read_slice(
                    fs, keys, pages, which[lo:hi], envelope, on_filled
                ),
                len(which),
            )

        if count < 2 or self.config.io_threads == 1:
            return blocking(range(count))
        sizes = compiled.read_cached(self._spread, fs, keys, pages, envelope, on_filled)
        waiting = [i for i, size in enumerate(sizes) if size == compiled.BLOCKED]
        if waiting:
            for i, size in zip(waiting, blocking(waiting), strict=True):
                sizes[i] = size
        return sizes

    def _got(self, keys: Sequence[str], sizes: list[int]) -> list[bool]:
        """Index and count what a get read (``sizes``: bytes per page, 0 for none)."""
        self._fs.record_reads([(key, got) for key, got in zip(keys, sizes, strict=True) if got])
        return [got > 0 for got in sizes]

    def _get_one(
        self,
        key: str,
        page: PageBuffers,
        index: int = 0,
        on_payload: Callable[[int, memoryview], object] | None = None,
    ) -> int:
        """Read ``key``'s page into ``page``; the bytes read, or 0 (a counted failure)."""
        final = paths.page_path_str(self._store_str, key)
        views = [e.view for e in page]
        expected = 0
        for view in views:
            expected += view.nbytes
        direct = self._fs.direct_for(page)
        fd = self._fs.open_page(key, final, expected, direct=direct, blocking=False)
        if fd is None:
            return 0
        try:
            if on_payload is None or expected <= 2 * PIECE or direct:
                got = _preadv_all(fd, views)
            else:
                got = _preadv_all(fd, views[:1])  # the header region first, unhashed
                pieces = writes.pieces(views[1:], PIECE) if got == views[0].nbytes else []
                for piece in pieces:
                    size = sum(v.nbytes for v in piece)
                    if _preadv_all(fd, piece, got) != size:
                        break  # end of file: a short read, counted below
                    got += size
                    for view in piece:
                        on_payload(index, view)
        except OSError as exc:
            self._warn_once("get_errors", "file backend: reading %s failed: %s", final, exc)
            return 0
        finally:
            os.close(fd)
        if got != expected:
            self._counters.add("get_short_reads")
            return 0
        return got

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        return self.put_with(keys, pages, None)

    def put_with(
        self,
        keys: Sequence[str],
        pages: Sequence[PageBuffers],
        before_write: Callable[[int], object] | None,
        *,
        envelope: BatchEnvelope | None = None,
    ) -> list[bool]:
        """``put``, calling ``before_write(i)`` in the I/O thread about to write page ``i``.

        The core writes the page's envelope there (its payload checksum runs in that
        thread, in parallel with the other pages', just before the same bytes are copied
        into the page cache). With ``envelope`` and the compiled loop, the envelopes are
        written there instead (``fsync`` 'none' and 'page'; 'batch' runs in Python).
        """
        paths.check_keys(keys)
        if len(keys) != len(pages):
            raise StorageError(f"put: {len(keys)} keys but {len(pages)} pages", value=keys)
        now = self.config.fsync != "batch"
        if envelope is not None and now and self.checks_envelopes:
            return self._put_compiled(keys, pages, before_write, envelope)

        def one(i: int) -> bool | _Written:
            return self._put_one(keys[i], pages[i], now, i, before_write)

        if now:
            return [r is True for r in self._map(one, len(keys))]
        # batch: write and fsync every temp file, then publish all, then sync each dir once
        outcomes = self._map(one, len(keys))
        results: list[bool] = []
        finals: list[str] = []
        for key, outcome in zip(keys, outcomes, strict=True):
            if outcome is False or outcome is True:
                results.append(False)
                continue
            tmp, final, nbytes, written = outcome
            results.append(
                self._fs.publish_page(key, tmp, final, nbytes, sync_dir=False, written=written)
            )
            finals.append(final)
        self._sync_dirs(finals)
        return results

    def _put_compiled(
        self,
        keys: Sequence[str],
        pages: Sequence[PageBuffers],
        before_write: Callable[[int], object] | None,
        envelope: BatchEnvelope,
    ) -> list[bool]:
        """``put_with`` through the compiled loop, one slice per I/O thread.

        A batch of overwrites without fsync goes in place, a copy that waits for
        nothing, so it gets no more threads than
        :func:`~kvtier.backends.filestore.slices.copy_threads` gives it.
        """
        page_sync = self.config.fsync == "page"

        def publish(i: int, tmp: str, final: str, nbytes: int) -> bool:
            return self._fs.publish_page(keys[i], tmp, final, nbytes, sync_dir=page_sync)

        def fallback(i: int) -> bool:
            return self._put_one(keys[i], pages[i], True, i, before_write) is True

        def run(lo: int, hi: int) -> list[bool]:
            done = compiled.write_slice(
                self._fs,
                keys,
                pages,
                lo,
                hi,
                envelope,
                datasync=self.config.fsync != "none",
                publish=publish,
                fallback=fallback,
                spares=self._spares,
            )
            if page_sync:
                store = self._store_str
                published = [i for i, ok in zip(range(lo, hi), done, strict=True) if ok]
                self._sync_dirs(paths.page_path_unchecked(store, keys[i]) for i in published)
            return done

        overwrites = self.config.fsync == "none" and all(self._fs.index.indexed(keys))
        return self._spread(run, len(keys), copy_threads(pages) if overwrites else None)

    def _sync_dirs(self, finals: Iterable[str]) -> None:
        """fsync each directory holding one of ``finals`` once (durable renames)."""
        for directory in {os.path.dirname(final) for final in finals}:
            try:
                writes.fsync_dir(directory)
            except OSError as exc:
                self._warn_once("fsync_errors", "file backend: fsync of %s: %s", directory, exc)

    def _put_one(
        self,
        key: str,
        page: PageBuffers,
        publish_now: bool = True,
        index: int = 0,
        before_write: Callable[[int], object] | None = None,
    ) -> bool | _Written:
        final = paths.page_path_str(self._store_str, key)
        views = [e.view for e in page]
        nbytes = 0
        for view in views:
            nbytes += view.nbytes
        refused = self.index.reserve(key, nbytes)
        if refused is not None:
            self._counters.add(f"put_failed_{refused}")
            return False
        direct = self._fs.direct_for(page)
        tmp: str | None = None
        try:
            if before_write is not None:
                before_write(index)
            fd, tmp = self._fs.open_temp(final, o_direct=direct)
            try:
                writes.pwritev_all(fd, views)
                if self.config.fsync != "none":
                    os.fdatasync(fd)
                written = writes.file_id(fd)
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
        except BaseException:
            if tmp is not None:
                writes.unlink_quietly([tmp])
            self.index.release(nbytes)
            raise
        if not publish_now:
            return tmp, final, nbytes, written
        return self._fs.publish_page(
            key, tmp, final, nbytes, sync_dir=self.config.fsync == "page", written=written
        )

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
        self._spares.close()
        self._slices.close()
