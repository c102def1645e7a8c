"""The ``file`` backend: one file per page under a root directory, on local disk.

Pages are written with ``os.pwritev`` straight from the host pool's extents into a temp
file and published by an atomic rename; they are read back with ``os.preadv`` straight
into the extents. No staging copy, no bytes objects. Batches run on a small thread pool
(the calls release the GIL), so cold reads keep several requests in flight. The on-disk
scheme, index, LRU capacity and free-space guard live in :mod:`kvtier.backends.filestore`
and are shared with the io_uring backend, as is the shell around this loop
(:class:`~kvtier.backends.filestore.base.FileStoreBackend`: the contract, the closed
check, the compiled loop's dispatch); this module holds the thread pool's Python loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier.backends.file.config import FileConfig
from kvtier.backends.filestore import base, compiled, paths, publish, writes
from kvtier.backends.filestore.base import BeforeWrite, Keys, OnFilled, OnPayload, Pages
from kvtier.backends.filestore.slices import copy_threads
from kvtier.core.envelope import BatchEnvelope
from kvtier.core.storage import BackendContext, PageBuffers

__all__ = ["FileBackend"]

log = logging.getLogger(__name__)

#: A page written under its temp name, not yet published: (tmp, final, bytes, its file).
_Written = tuple[str, str, int, publish.FileId]
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


class FileBackend(base.FileStoreBackend[FileConfig]):
    """Pages as files under ``root/<namespace>``; see :mod:`kvtier.backends.filestore`."""

    name = "file"
    compiled_puts = frozenset({"none", "page"})  # 'batch' runs in Python

    def __init__(
        self, config: FileConfig | None = None, context: BackendContext | None = None
    ) -> None:
        config = config or FileConfig()
        super().__init__(config, context, log, threads=config.io_threads)
        if config.compiled_io and not compiled.available():
            log.info(
                "file backend: the compiled page loop is not built (%s); using the Python "
                "loop (same files, more time per page)",
                compiled.MISSING,
            )

    def _map(self, fn: Callable[[int], _T], count: int) -> list[_T]:
        """``[fn(i) for i in range(count)]``, spread over ``io_threads`` threads (one
        slice each, see :class:`~kvtier.backends.filestore.slices.Slices`)."""
        return self._slices.spread(lambda lo, hi: [fn(i) for i in range(lo, hi)], count)

    # --- gets ----------------------------------------------------------------------------

    def _get_own(
        self, keys: Keys, pages: Pages, on_filled: OnFilled, on_payload: OnPayload
    ) -> list[bool]:
        """The Python loop: each page read on one of the I/O threads, ``on_filled`` called
        there. A page larger than two :data:`PIECE` is read piece by piece, each handed
        to ``on_payload`` as it lands, so the core hashes it before the next piece pushes
        it out of cache."""

        def one(i: int) -> int:
            got = self._get_one(keys[i], pages[i], i, on_payload)
            if got and on_filled is not None:
                on_filled(i)
            return got

        return self._got(keys, self._map(one, len(keys)))

    def _get_compiled(
        self, keys: Keys, pages: Pages, envelope: BatchEnvelope, on_filled: OnFilled
    ) -> list[bool]:
        """The compiled loop, envelopes checked there.

        The batch is first read from the page cache alone (``nowait``), on no more
        threads than there are CPUs to copy with and than the batch has
        :data:`~kvtier.backends.filestore.slices.MIN_SLICE_BYTES` slices (a hand-off
        costs more than a small page's copy, and threads beyond the CPUs only take
        turns); only the pages that would wait for the disk then go to every I/O
        thread, where the waits overlap.
        """
        fs = self._fs
        count = len(keys)
        spread = self._slices.spread

        def blocking(which: Sequence[int]) -> list[int]:
            return spread(
                lambda lo, hi: compiled.read_slice(
                    fs, keys, pages, which[lo:hi], envelope, on_filled
                ),
                len(which),
            )

        if count < 2 or self.config.io_threads == 1:
            return self._got(keys, blocking(range(count)))
        sizes = compiled.read_cached(spread, fs, keys, pages, envelope, on_filled)
        waiting = [i for i, size in enumerate(sizes) if size == compiled.BLOCKED]
        if waiting:
            for i, size in zip(waiting, blocking(waiting), strict=True):
                sizes[i] = size
        return self._got(keys, sizes)

    def _got(self, keys: Keys, sizes: list[int]) -> list[bool]:
        """Index and count what a get read (``sizes``: bytes per page, 0 for none)."""
        self._fs.record_reads([(key, got) for key, got in zip(keys, sizes, strict=True) if got])
        return [got > 0 for got in sizes]

    def _get_one(
        self, key: str, page: PageBuffers, index: int = 0, on_payload: OnPayload = None
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

    # --- puts ----------------------------------------------------------------------------

    def _put_own(self, keys: Keys, pages: Pages, before_write: BeforeWrite) -> list[bool]:
        """The Python loop: each page written and published on one of the I/O threads.

        With ``fsync: "batch"`` every temp file is written and fsynced first, then all
        are published, then each touched directory is synced once.
        """
        now = self.config.fsync != "batch"

        def one(i: int) -> bool | _Written:
            return self._put_one(keys[i], pages[i], now, i, before_write)

        if now:
            return [r is True for r in self._map(one, len(keys))]
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
        self._fs.sync_dirs(finals)
        return results

    def _put_one_own(self, keys: Keys, pages: Pages, i: int, before_write: BeforeWrite) -> bool:
        return self._put_one(keys[i], pages[i], True, i, before_write) is True

    def _compiled_put_threads(self, keys: Keys, pages: Pages) -> int | None:
        """Every I/O thread, except for a batch of overwrites without fsync: that goes in
        place, a copy that waits for nothing, so it gets no more threads than
        :func:`~kvtier.backends.filestore.slices.copy_threads` gives it."""
        overwrites = self.config.fsync == "none" and all(self._fs.index.indexed(keys))
        return copy_threads(pages) if overwrites else None

    def _put_one(
        self,
        key: str,
        page: PageBuffers,
        publish_now: bool = True,
        index: int = 0,
        before_write: BeforeWrite = None,
    ) -> bool | _Written:
        """Write ``key``'s page under a temp name (step 1 of
        :mod:`~kvtier.backends.filestore.publish`) and, with ``publish_now``, publish it;
        else return what :meth:`FileStore.publish_page` needs to publish it later."""
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
                written = publish.file_id(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            if tmp is not None:
                writes.unlink_quietly([tmp])
            self.index.release(nbytes)
            self._fs.write_failed(final, exc.errno, exc)
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
