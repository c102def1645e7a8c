"""The ``uring`` storage backend: the file backend's on-disk pages, moved by io_uring.

Pages are stored exactly as the ``file`` backend stores them (the scheme lives in
:mod:`kvtier.backends.filestore`: sharded paths, temp file + atomic rename, LRU index,
0700/0600 modes), so a root written by one backend is read by the other. What differs is
how the bytes move: a whole batch of gets or puts goes through an io_uring with up to
``queue_depth`` vectored requests in flight, straight from and into the host-pool extents,
while the calling thread waits on an eventfd with the GIL released.

This module imports the ring engine (:mod:`kvtier.backends.uring.ring`), and so liburing,
at its top: it is imported only when the backend is built. Declaring the backend imports
nothing optional: the plugin module holds the spec, the config model and the availability
probe (:mod:`kvtier.backends.uring.probe`), which imports liburing only when it runs. A
backend built directly, bypassing resolution, runs the probe too and refuses with its reason.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.backends.filestore import base, compiled, paths, publish, writes
from kvtier.backends.filestore.base import BeforeWrite, Keys, OnFilled, OnPayload, Pages
from kvtier.backends.filestore.slices import CPUS, copy_threads
from kvtier.backends.uring.config import UringConfig
from kvtier.backends.uring.probe import INSTALL_HINT, probe_io_uring
from kvtier.backends.uring.ring import IORequest, Op, RingPool
from kvtier.core.envelope import BatchEnvelope
from kvtier.core.errors import BackendUnavailableError
from kvtier.core.storage import BackendContext

__all__ = ["READ_PART", "UringBackend"]

#: A page read is cut into requests of at most this many bytes, all in flight together.
READ_PART = 1 << 20

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Put:
    """One page being written: where, how big, and which result slot it fills."""

    index: int
    key: str
    final: Path
    tmp: Path
    nbytes: int
    fd: int
    views: list[memoryview] = field(default_factory=list)
    direct: bool = False
    retried: bool = False  # a failed create was cured once (shard dirs, stale name)
    dir_fd: int = -1
    written: publish.FileId | None = None  # the temp file, once written (only it is published)
    published: bool = False
    finished: bool = False  # committed or failed: nothing left to clean up


class UringBackend(base.FileStoreBackend[UringConfig]):
    """Pages in the file backend's format, read and written in batches through io_uring."""

    name = "uring"
    #: Puts with envelopes go to the compiled loop only without fsync: a buffered write
    #: then goes to the page cache without waiting for the disk, so the ring has nothing
    #: to overlap (and it handed every write to a kernel worker).
    compiled_puts = frozenset({"none"})

    def __init__(
        self, config: UringConfig | None = None, context: BackendContext | None = None
    ) -> None:
        reason = probe_io_uring()
        if reason is not None:  # a direct construction bypasses resolution: refuse too
            raise BackendUnavailableError("backend", "uring", reason, INSTALL_HINT)
        config = config or UringConfig()
        # The compiled loop's threads: a warm copy scales with the CPUs, not the ring.
        super().__init__(config, context, log, threads=CPUS)
        self._rings = RingPool(config.queue_depth)

    def _close_own(self) -> None:
        self._rings.close()

    # --- helpers ---------------------------------------------------------------------

    def _punt(self, open_flags: int) -> bool:
        """Whether a read or write on a file opened with ``open_flags`` goes to io-wq.

        'auto' punts buffered I/O when several requests are in flight: the kernel's
        workers then copy in parallel without the GIL. At queue depth 1 there is nothing
        to overlap, and inline submission measured faster (no hand-off to a worker).
        """
        mode = self.config.submit_async
        if mode != "auto":
            return mode == "always"
        return self.config.queue_depth > 1 and not open_flags & os.O_DIRECT

    def _write_inline(self, batch: int) -> bool:
        """Whether a put's page writes are plain ``os.pwritev`` calls in this thread.

        'auto' does so when nothing can overlap (queue depth 1, or a batch of one page):
        ext4 cannot take a buffered write without blocking, so io_uring hands every
        one to a kernel worker (seen with the io_uring_queue_async_work tracepoint),
        adding a hand-off and a wake-up per page to the same copy; ``os.pwritev`` also
        releases the GIL. The rename, fsyncs and reads still go through the ring.
        """
        return self.config.submit_async == "auto" and (self.config.queue_depth == 1 or batch == 1)

    def _fail_put(self, put: _Put, cause: int) -> None:
        put.finished = True
        writes.unlink_quietly([put.tmp])
        self.index.release(put.nbytes)
        self._fs.write_failed(put.final, cause, os.strerror(cause))

    # --- gets ----------------------------------------------------------------------

    def _get_compiled(
        self, keys: Keys, pages: Pages, envelope: BatchEnvelope, on_filled: OnFilled
    ) -> list[bool]:
        """The compiled loop's page-cache pass, then the ring for the pages it left.

        The pass reads pages found in the page cache in C, their envelopes checked there
        as the bytes land (a ring request costs more than a small page's copy, and the
        kernel's workers copy a large one where this thread cannot hash it in cache), on
        up to one thread per CPU and per MiB of the batch (see
        :func:`~kvtier.backends.filestore.slices.copy_threads`); the ring gets the pages
        that would wait for the disk.
        """
        sizes = compiled.read_cached(
            self._slices.spread, self._fs, keys, pages, envelope, on_filled
        )
        results = [size > 0 for size in sizes]
        self._fs.record_reads([(keys[i], size) for i, size in enumerate(sizes) if size > 0])
        waiting = [i for i, size in enumerate(sizes) if size == compiled.BLOCKED]
        if waiting:

            def filled(j: int) -> object:
                return on_filled(waiting[j]) if on_filled is not None else None

            got = self._get_own([keys[i] for i in waiting], [pages[i] for i in waiting], filled)
            for i, ok in zip(waiting, got, strict=True):
                results[i] = ok
        return results

    def _get_own(
        self, keys: Keys, pages: Pages, on_filled: OnFilled, on_payload: OnPayload = None
    ) -> list[bool]:
        """Every page through the ring, ``on_filled(i)`` called as page ``i``'s read
        completes (completions are reaped by this thread, so the core verifies a page
        here while the ring's other reads are still in flight).

        A page larger than :data:`READ_PART` is read as several requests of that size,
        in flight together: the disk then sees them in parallel instead of one long
        request advancing by readahead steps. ``on_payload`` is not called: the kernel's
        workers copy the parts, so no thread here has them in cache (handing landed parts
        on in order measured no faster than verifying the whole page at its end).

        With the compiled loop the whole batch is opened first in one C call (GIL
        released), so the requests go into the ring back to back; otherwise each page is
        opened in Python as its requests are queued.
        """
        files = [paths.page_path_str(self._store_str, key) for key in keys]  # str: cheaper
        results = [False] * len(keys)
        open_fds: set[int] = set()
        touched: list[tuple[str, int]] = []
        #: page index -> [requests still in flight, bytes read, first error or -1 short]
        parts: dict[int, list[int]] = {}
        directs = [self._fs.direct_for(page) for page in pages]
        opened: list[int] | None = None
        if self.checks_envelopes:
            opened = compiled.open_pages(self._fs, keys, pages, directs)
            open_fds.update(fd for fd in opened if fd >= 0)

        def requests() -> Iterator[IORequest]:
            for index, (key, page) in enumerate(zip(keys, pages, strict=True)):
                direct = directs[index]
                nbytes = sum(e.length for e in page)
                if opened is not None:
                    fd: int | None = opened[index] if opened[index] >= 0 else None
                else:
                    fd = self._fs.open_page(key, files[index], nbytes, direct=direct)
                if fd is None:  # a miss, debris or a wrong size: counted
                    continue
                open_fds.add(fd)
                punt = self._punt(os.O_DIRECT if direct else 0)
                views = [e.view for e in page]
                runs = writes.pieces(views, READ_PART) if nbytes > READ_PART else [views]
                parts[index] = [len(runs), 0, 0]
                offset = 0
                for run in runs:
                    request = IORequest(Op.READ, fd, run, offset, tag=index, punt=punt)
                    offset += request.nbytes
                    yield request

        def on_done(request: IORequest) -> None:
            index: int = request.tag
            state = parts[index]
            state[0] -= 1
            state[1] += request.done
            if not request.ok and not state[2]:
                state[2] = request.error or -1
            if state[0]:
                return  # other parts of this page are still in flight
            open_fds.discard(request.fd)
            os.close(request.fd)
            if not state[2]:
                results[index] = True
                touched.append((keys[index], state[1]))
                if on_filled is not None:
                    on_filled(index)
            elif state[2] > 0:
                self._warn_once(
                    "get_errors",
                    "uring backend: reading %s failed: %s",
                    files[index],
                    os.strerror(state[2]),
                )
            else:
                self._counters.add("get_short_reads")

        try:
            self._rings.run(requests(), on_done)
        finally:
            for fd in open_fds:
                os.close(fd)
            self._fs.record_reads(touched)
        return results

    # --- puts ----------------------------------------------------------------------

    def _put_one_own(self, keys: Keys, pages: Pages, i: int, before_write: BeforeWrite) -> bool:
        before = None if before_write is None else lambda _j: before_write(i)
        return self._put_own([keys[i]], [pages[i]], before)[0]

    def _compiled_put_threads(self, keys: Keys, pages: Pages) -> int:
        """One thread per CPU and MiB of the batch
        (:func:`~kvtier.backends.filestore.slices.copy_threads`; overwrites go in place)."""
        return copy_threads(pages)

    def _put_own(self, keys: Keys, pages: Pages, before_write: BeforeWrite) -> list[bool]:
        """Write temp files and fsync as configured through the ring, then publish.

        Each page is a small chain: WRITE -> (FDATASYNC) -> publish -> (directory FSYNC
        for ``fsync='page'``); ``on_done`` queues the next link as one completes. A page
        is published inline, by the steps of :mod:`~kvtier.backends.filestore.publish`
        (:meth:`_publish`; in C where the compiled module is built): a new page by
        rename(2), a replaced one by exchanging the names, both microseconds, where a
        ring RENAME over an existing page makes ext4 start writeback of the new file.
        With ``fsync='batch'`` the pages are published once every page is synced, then
        each touched directory is synced once. ``before_write(i)`` (the core's envelope)
        runs in this thread just before page ``i``'s first request is queued.
        """
        finals = [paths.page_path(self.store, key) for key in keys]
        durability = self.config.fsync
        results = [False] * len(keys)
        inline = self._write_inline(len(keys))
        live: dict[int, _Put] = {}  # index -> page not yet finished, for cleanup after a bug
        to_publish: list[_Put] = []
        published: list[_Put] = []  # into the index in the batch's order, not completion order

        def requests() -> Iterator[IORequest]:
            for index, (key, page) in enumerate(zip(keys, pages, strict=True)):
                nbytes = sum(e.length for e in page)
                reason = self.index.reserve(key, nbytes)
                if reason is not None:
                    self._counters.add(f"put_failed_{reason}")
                    continue
                direct = self._fs.direct_for(page)
                views = [e.view for e in page]
                if before_write is not None:
                    try:
                        before_write(index)
                    except BaseException:
                        self.index.release(nbytes)
                        raise
                if not inline:  # the create goes through the ring too: ext4 creates are slow
                    try:
                        tmp = paths.temp_path(finals[index])
                    except BaseException:
                        self.index.release(nbytes)
                        raise
                    put = _Put(index, key, finals[index], tmp, nbytes, -1, views, direct)
                    live[index] = put
                    yield self._open(put)
                    continue
                try:
                    fd, tmp = self._fs.open_temp(finals[index], o_direct=direct)
                except OSError as exc:
                    self.index.release(nbytes)
                    cause = exc.errno or errno.EIO
                    self._fs.write_failed(finals[index], cause, os.strerror(cause))
                    continue
                except BaseException:
                    self.index.release(nbytes)
                    raise
                put = _Put(index, key, finals[index], tmp, nbytes, fd)
                live[index] = put
                write = IORequest(Op.WRITE, fd, views, tag=put)
                try:
                    write.done = writes.pwritev_all(fd, views)
                except OSError as exc:
                    write.error = exc.errno or errno.EIO
                follow_up = on_done(write)  # the rest of the chain as if the ring wrote it
                if follow_up is not None:
                    yield follow_up

        def on_done(request: IORequest) -> IORequest | None:
            put: _Put = request.tag
            if request.op == Op.OPEN:
                if request.error and not put.retried:
                    put.retried = True  # a new shard, or debris in the way: cure, open again
                    try:
                        retry = self._fs.retry_temp(put.final, request.error, put.tmp)
                    except OSError as exc:
                        del live[put.index]
                        self._fail_put(put, exc.errno or errno.EIO)
                        return None
                    if retry:
                        return self._open(put)
                if request.error:
                    del live[put.index]
                    self._fail_put(put, request.error)
                    return None
                put.fd = request.result
                punt = self._punt(os.O_DIRECT if put.direct else 0)
                return IORequest(Op.WRITE, put.fd, put.views, tag=put, punt=punt)
            if request.op == Op.WRITE and request.ok and durability != "none":
                return IORequest(Op.FDATASYNC, put.fd, tag=put)
            if request.op in (Op.WRITE, Op.FDATASYNC):
                try:
                    put.written = publish.file_id(put.fd)  # (step 1 of the protocol)
                finally:
                    os.close(put.fd)
                    put.fd = -1
                if not request.ok:
                    del live[put.index]
                    self._fail_put(put, request.error or errno.EIO)
                    return None
                if durability == "batch":
                    del live[put.index]
                    to_publish.append(put)
                    return None
                # Published inline (steps 2-5 of the protocol): a new page by rename(2), a
                # replaced one by exchanging the names and unlinking the old page. Both
                # cost microseconds; a plain rename over an existing page (what the ring's
                # RENAME does) makes ext4 start writeback of the new file, measured at
                # 0.02-0.05 x a raw in-place overwrite on 16-128 KiB pages.
                if not self._publish(put):
                    del live[put.index]
                    return None
                published.append(put)
                if durability != "page":
                    del live[put.index]
                    return None
                try:
                    put.dir_fd = os.open(put.final.parent, os.O_RDONLY | os.O_DIRECTORY)
                except OSError as exc:
                    del live[put.index]
                    self._warn_once("fsync_errors", "uring backend: %s: %s", put.final, exc)
                    return None
                return IORequest(Op.FSYNC, put.dir_fd, tag=put)
            # the directory fsync of fsync='page'
            del live[put.index]
            os.close(put.dir_fd)
            put.dir_fd = -1
            if request.error:
                self._warn_once(
                    "fsync_errors",
                    "uring backend: fsync of %s: %s",
                    put.final.parent,
                    os.strerror(request.error),
                )
            return None

        try:
            self._rings.run(requests(), on_done)
            for put in to_publish:  # fsync 'batch': every page synced, now each published
                if self._publish(put):
                    published.append(put)
            self._fs.sync_dirs(put.final for put in to_publish if put.published)
        finally:  # after an unexpected exception: close, remove and release what is left
            self._committed(published, results)
            for put in [*live.values(), *to_publish]:
                for fd in (put.fd, put.dir_fd):
                    if fd >= 0:
                        os.close(fd)
                put.fd = put.dir_fd = -1
                if not put.published and not put.finished:
                    put.finished = True
                    writes.unlink_quietly([put.tmp])
                    self.index.release(put.nbytes)
        return results

    @staticmethod
    def _open(put: _Put) -> IORequest:
        """Create ``put``'s temp file (0600, O_EXCL) through the ring."""
        tmp = str(put.tmp)
        flags = paths.temp_flags(o_direct=put.direct)
        return IORequest(
            Op.OPEN, -1, paths=(tmp, tmp), open_flags=flags, mode=paths.FILE_MODE, tag=put
        )

    def _publish(self, put: _Put) -> bool:
        """Steps 2-5 of the protocol for ``put``'s written temp file (in C where the
        compiled module is built: :meth:`FileStore.publish
        <kvtier.backends.filestore.store.FileStore.publish>`); False, counted, when
        nothing was published."""
        try:
            self._fs.publish(put.tmp, put.final, written=put.written)
        except publish.TempTaken:
            self._temp_taken(put)
            return False
        except OSError as exc:
            self._fail_put(put, exc.errno or errno.EIO)
            return False
        put.published = True
        return True

    def _temp_taken(self, put: _Put) -> None:
        """Nothing published: another entry took ``put``'s temp name (left to the sweep)."""
        put.finished = True
        self._fs.temp_taken(put.nbytes)

    def _committed(self, published: list[_Put], results: list[bool]) -> None:
        """The batch's published pages: into the index in the batch's order (the ring
        completes them in any order, and the eviction policy ranks by insertion), counted,
        reported."""
        for put in sorted(published, key=lambda put: put.index):
            put.finished = True
            self._fs.committed(put.key, put.nbytes)
            results[put.index] = True
