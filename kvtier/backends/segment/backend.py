"""The ``segment`` backend: pages appended into large segment files, read back in runs.

A put appends the batch as one record (its pages back to back after one small header)
into this backend's active segment, with one ``pwritev`` for the pages and one
``pwrite`` for the header, which publishes them; a get looks each key up in the
in-memory index and reads pages that lie next to each other in one ``preadv`` straight
into the host pool's extents, so a batch put together comes back in one read. The
core's envelope (key digest, length, checksum) travels inside every page and is
verified on every get, as with every backend.

The format is :mod:`~kvtier.backends.segment.format`, the segment table, index and
refresh :mod:`~kvtier.backends.segment.store`, appending and reclamation
:mod:`~kvtier.backends.segment.writer`. ``docs/segment-backend.md`` describes the whole.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvtier.backends.filestore.slices import CPUS, Slices
from kvtier.backends.filestore.writes import pieces
from kvtier.backends.segment import compiled
from kvtier.backends.segment import format as fmt
from kvtier.backends.segment.config import SegmentConfig
from kvtier.backends.segment.format import ERASED
from kvtier.backends.segment.store import Loc, Segment, SegmentStore
from kvtier.backends.segment.writer import Appender, Reservation, pwritev_all
from kvtier.core.envelope import BatchEnvelope
from kvtier.core.errors import StorageError
from kvtier.core.keys import validate_keys
from kvtier.core.space import ReclaimUnit, SpaceReport
from kvtier.core.storage import BackendContext, PageBuffers, StorageBackend

if TYPE_CHECKING:
    from kvtier.core.policy import EvictionPolicy

__all__ = ["SegmentBackend"]

log = logging.getLogger(__name__)

Keys = Sequence[str]
Pages = Sequence[PageBuffers]
OnFilled = Callable[[int], object] | None
OnPayload = Callable[[int, memoryview], object] | None
BeforeWrite = Callable[[int], object] | None

#: Most bytes read by one ``preadv`` of adjacent pages: the core verifies each run's
#: pages right after it lands, while they are still in this core's cache.
RUN_BYTES = 1 << 20
#: Least bytes of a batch worth another thread: the core's per-page work (the envelope,
#: in Python, under the GIL) of one share overlaps the copies of another.
SLICE_BYTES = 1 << 20
#: A page larger than twice this is read in pieces this size when the core hashes
#: pieces as they land (``on_payload``), so no second pass over memory is needed.
PIECE = 256 << 10
IOV_MAX = 1024
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _preadv_all(fd: int, views: list[memoryview], offset: int, flags: int = 0) -> int:
    """Fill every region from ``offset`` on; stops early only at end of file (or, with
    ``RWF_NOWAIT``, where the page cache ends). Bytes read."""
    start = offset
    while views:
        try:
            got = os.preadv(fd, views[:IOV_MAX], offset, flags)
        except BlockingIOError:
            break
        if got <= 0:
            break
        offset += got
        while views and got >= views[0].nbytes:
            got -= views[0].nbytes
            views = views[1:]
        if got:
            views = [views[0][got:], *views[1:]]
    return offset - start


class SegmentBackend(StorageBackend):
    """Pages in segment files under ``root/<namespace>``; see :mod:`kvtier.backends.segment`."""

    def __init__(
        self, config: SegmentConfig | None = None, context: BackendContext | None = None
    ) -> None:
        self.config = config = config or SegmentConfig()
        namespace = context.namespace if context is not None else "default"
        #: The context's eviction policy; None: the oldest segment is reclaimed first.
        self.policy: EvictionPolicy | None = context.eviction if context is not None else None
        self._store = SegmentStore(config.root, namespace, policy=self.policy, log=log)
        self.store = self._store.path
        self._appender = Appender(self._store, config, log)
        self._counters = self._store.counters
        self._slices = Slices(config.io_threads, "kvtier-segment")
        self._lock = threading.Lock()
        self._closed = False
        #: The most a page put costs (:meth:`page_cost`): the room at a segment's end
        #: that one may not fit into.
        self._page_cost = 0
        #: Whether reads try the page cache alone first (``RWF_NOWAIT``): off where the
        #: filesystem refuses it.
        self._nowait = hasattr(os, "RWF_NOWAIT")
        if self.policy is None and config.capacity_bytes is not None:
            log.info(
                "segment backend: no eviction policy in the context; beyond capacity_bytes "
                "the oldest segment is reclaimed first and its pages dropped"
            )

    @property
    def checks_envelopes(self) -> bool:
        """Whether batches move through the compiled data path (built, and
        ``compiled_io`` on), envelopes written and checked there;
        :class:`~kvtier.core.pagestore.PageStore` asks."""
        return self.config.compiled_io and compiled.available()

    # --- checks ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(
                f"the segment backend is closed; build a new one to use {self.store} again",
                value=str(self.store),
            )

    def _check_batch(self, what: str, keys: Keys, pages: Pages) -> None:
        validate_keys(keys)
        if len(keys) != len(pages):
            raise StorageError(f"{what}: {len(keys)} keys but {len(pages)} pages", value=keys)
        self._check_open()

    def _refresh(self, missed: bool) -> None:
        """Look for other processes' pages after a miss, and at least once a second."""
        if self.config.check_disk_on_miss and (missed or self._store.refresh_due()):
            self._store.refresh()

    # --- the contract ----------------------------------------------------------------

    def exists(self, keys: Keys) -> list[bool]:
        self._check_open()
        validate_keys(keys)
        found = self._store.contains(keys)
        if not all(found):
            self._refresh(True)
            found = self._store.contains(keys)
        else:
            self._refresh(False)
        return found

    def get(self, keys: Keys, pages: Pages) -> list[bool]:
        return self.get_with(keys, pages, None)

    def get_with(
        self,
        keys: Keys,
        pages: Pages,
        on_filled: OnFilled,
        on_payload: OnPayload = None,
        *,
        envelope: BatchEnvelope | None = None,
    ) -> list[bool]:
        """``get``, calling ``on_filled(i)`` in the thread that just filled page ``i``
        (the core verifies it there, while it is in cache; see
        :class:`~kvtier.core.pagestore.PerPageHooks`). With ``envelope`` and the
        compiled path, the envelopes are checked there instead
        (:class:`~kvtier.core.pagestore.EnvelopeHooks`): a valid page's index goes into
        ``envelope.valid``, any other filled page to ``on_filled``."""
        self._check_batch("get", keys, pages)
        if not keys:
            return []
        store = self._store
        locs = store.lookup(keys)
        try:
            missing = [i for i, loc in enumerate(locs) if loc is None]
            if missing and self.config.check_disk_on_miss:
                store.refresh()
                again = store.lookup([keys[i] for i in missing])
                for i, loc in zip(missing, again, strict=True):
                    locs[i] = loc
            else:
                self._refresh(False)
            if envelope is not None and self.checks_envelopes:
                filled = self._read_compiled(keys, pages, locs, envelope, on_filled)
            else:
                filled = self._read(keys, pages, locs, on_filled, on_payload)
        finally:
            store.unpin([loc[0] for loc in locs if loc is not None])
        hits = [i for i, ok in enumerate(filled) if ok]
        self._counters.add("hits", len(hits))
        self._counters.add("misses", len(keys) - len(hits))
        if self.policy is not None:
            for i in hits:
                self.policy.record_access(keys[i])
        return filled

    def _read(
        self,
        keys: Keys,
        pages: Pages,
        locs: list[Loc | None],
        on_filled: OnFilled,
        on_payload: OnPayload,
    ) -> list[bool]:
        """Read every located page, adjacent ones in one ``preadv``, on enough threads."""
        views = [[e.view for e in page] for page in pages]
        filled = [False] * len(keys)
        # runs: (segment, file offset, page indices, bytes) of adjacent pages
        runs: list[tuple[Segment, int, list[int], int]] = []
        sizes = [0] * len(keys)
        total = 0
        end = -1
        for i, loc, size in self._sized(views, locs):
            sizes[i] = size
            seg, offset = loc[0], loc[1]
            total += size
            if runs and runs[-1][0] is seg and end == offset and runs[-1][3] + size <= RUN_BYTES:
                run = runs[-1]
                run[2].append(i)
                runs[-1] = (seg, run[1], run[2], run[3] + size)
            else:
                runs.append((seg, offset, [i], size))
            end = offset + size
        if not runs:
            return filled
        self._counters.add("read_calls", len(runs))
        spread = self._slices.spread
        blocked: list[tuple[Segment, int, list[int], int]] = []
        #: bytes of a large page already read (and fed to the core) by the first pass
        progress: dict[int, int] = {}

        def work(
            batch: list[tuple[Segment, int, list[int], int]], nowait: bool
        ) -> Callable[[int, int], list[int]]:
            def run(lo: int, hi: int) -> list[int]:
                done: list[int] = []
                for item in batch[lo:hi]:
                    seg, offset, which, nbytes = item
                    got = self._read_run(
                        keys,
                        views,
                        seg,
                        offset,
                        which,
                        nbytes,
                        on_filled,
                        on_payload,
                        locs,
                        nowait,
                        progress,
                    )
                    if got is None:
                        blocked.append(item)
                    else:
                        done.extend(got)
                return done

            return run

        # first from the page cache alone, on no more threads than CPUs to copy with (and
        # than MiB of the batch); then whatever would wait for the disk on every thread,
        # where the waits overlap
        warm = min(CPUS, self.config.io_threads, len(runs), max(1, total // SLICE_BYTES))
        nowait = self._nowait and len(runs) > 1 and self.config.io_threads > 1
        done = spread(work(runs, nowait), len(runs), warm)
        if blocked:
            cold = list(blocked)
            blocked.clear()
            for seg, offset, which, nbytes in cold:
                if len(which) > 1 or nbytes <= 2 * PIECE:  # large pages: threads overlap
                    self._readahead(seg, offset, nbytes)
            done.extend(
                spread(work(cold, False), len(cold), min(self.config.io_threads, len(cold)))
            )
        nbytes = 0
        for i in done:
            filled[i] = True
            nbytes += sizes[i]
        self._counters.add("bytes_read", nbytes)
        return filled

    def _sized(
        self, views: list[list[memoryview]], locs: list[Loc | None]
    ) -> Iterator[tuple[int, Loc, int]]:
        """The located pages whose stored length is the size of their regions, with that
        size (index, location, bytes); any other is counted (``get_size_mismatch``)."""
        for i, loc in enumerate(locs):
            if loc is None:
                continue
            size = 0
            for view in views[i]:
                size += view.nbytes
            if loc[2] != size:
                self._counters.add("get_size_mismatch")
                continue
            yield i, loc, size

    def _read_compiled(
        self,
        keys: Keys,
        pages: Pages,
        locs: list[Loc | None],
        envelope: BatchEnvelope,
        on_filled: OnFilled,
    ) -> list[bool]:
        """Read every located page through the compiled path (:class:`compiled.BatchRead`):
        first from the page cache alone on no more threads than CPUs, then what would
        wait for the disk on one thread per segment; envelopes checked as each run lands."""
        store, counters = self._store, self._counters
        views = [[e.view for e in page] for page in pages]
        filled = [False] * len(keys)
        located: list[tuple[int, int, int]] = []
        fds: dict[Segment, int | None] = {}
        total = 0
        for i, loc, size in self._sized(views, locs):
            seg = loc[0]
            if seg not in fds:
                fds[seg] = store.fd_of(seg)
            fd = fds[seg]
            if fd is None:  # another process reclaimed the segment: its pages are gone
                store.forget(keys[i], loc)
                counters.add("get_gone")
                continue
            located.append((i, fd, loc[1]))
            total += size
        if not located:
            return filled
        batch = compiled.BatchRead(keys, views, located, envelope)
        io_threads = self.config.io_threads
        warm = min(CPUS, io_threads, len(located), max(1, total // SLICE_BYTES))
        nowait = self._nowait and io_threads > 1 and len(located) > 1
        batch.run(self._slices.spread, warm, nowait)
        blocked = batch.blocked()
        if nowait and batch.nowait_refused():
            self._nowait = False  # the filesystem cannot: blocking reads only from now on
            threads = warm  # nothing says the pages are not in memory
        else:
            # from the disk, one thread per segment: the kernel reads ahead of one
            # sequential reader best (several threads in one file measured 1.5-2x slower)
            threads = min(io_threads, len({batch.fds[j] for j in blocked}))
        if blocked:
            batch.run(self._slices.spread, min(threads, len(blocked)), False, blocked)
        counters.add("read_calls", batch.reads)
        nbytes = 0
        valid = envelope.valid
        for j, code in enumerate(batch.codes):
            i = batch.which[j]
            where = locs[i]
            assert where is not None
            if code == compiled.OK:
                valid.append(i)
            elif code == compiled.UNVERIFIED:
                first = views[i][0]
                if first.nbytes >= 8 and first[:8] == ERASED:  # deleted by another process
                    counters.add("get_gone")
                    store.forget(keys[i], where)
                    continue
                if on_filled is not None:
                    on_filled(i)
            elif code == compiled.SHORT_READ:  # the file ends early (truncated under us)
                counters.add("get_short_reads")
                store.forget(keys[i], where)
                continue
            else:
                store.warn_once(
                    "get_errors",
                    "segment backend: reading %s failed: %s",
                    where[0].name,
                    os.strerror(-code) if code < 0 else f"code {code}",
                )
                continue
            filled[i] = True
            nbytes += where[2]
        counters.add("bytes_read", nbytes)
        return filled

    def _read_run(
        self,
        keys: Keys,
        views: list[list[memoryview]],
        seg: Segment,
        offset: int,
        which: list[int],
        nbytes: int,
        on_filled: OnFilled,
        on_payload: OnPayload,
        locs: list[Loc | None],
        nowait: bool = False,
        progress: dict[int, int] | None = None,
    ) -> list[int] | None:
        """One run of adjacent pages: the indices of those filled; with ``nowait``, None
        when the run is not all in the page cache. A large page is read piece by piece,
        each piece handed to the core as it lands; the first pass stops at the first
        piece not in the page cache and notes in ``progress`` where the second resumes."""
        by_pieces = on_payload is not None and len(which) == 1 and nbytes > 2 * PIECE
        fd = self._store.fd_of(seg)
        if fd is None:  # another process reclaimed the segment: its pages are gone
            for i in which:
                loc = locs[i]
                assert loc is not None
                self._store.forget(keys[i], loc)
            self._counters.add("get_gone", len(which))
            return []
        try:
            if by_pieces:
                index = which[0]
                start = progress.get(index, 0) if progress is not None else 0
                flags = os.RWF_NOWAIT if nowait else 0
                try:
                    got = self._read_pieces(
                        fd, views[index], offset, index, on_payload, start, flags
                    )
                except OSError as exc:
                    if not nowait or exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    self._nowait = False  # the filesystem cannot: blocking reads only
                    return None
                if nowait and got < nbytes:
                    if progress is not None:
                        progress[index] = got
                    return None
            else:
                flat = [view for i in which for view in views[i]]
                if nowait:
                    try:
                        got = _preadv_all(fd, flat, offset, os.RWF_NOWAIT)
                    except OSError as exc:
                        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise
                        self._nowait = False  # the filesystem cannot: blocking reads only
                        return None
                    if got < nbytes:
                        return None
                else:
                    got = _preadv_all(fd, flat, offset)
        except OSError as exc:
            self._store.warn_once(
                "get_errors", "segment backend: reading %s failed: %s", seg.name, exc
            )
            return []
        done: list[int] = []
        at = 0
        for i in which:
            loc = locs[i]
            assert loc is not None
            at += loc[2]
            if at > got:  # the file ends early (truncated under us): the rest are misses
                self._counters.add("get_short_reads")
                self._store.forget(keys[i], loc)
                continue
            first = views[i][0]
            if first.nbytes >= 8 and first[:8] == ERASED:  # deleted by another process
                self._counters.add("get_gone")
                self._store.forget(keys[i], loc)
                continue
            if on_filled is not None:
                on_filled(i)
            done.append(i)
        return done

    def _readahead(self, seg: Segment, offset: int, nbytes: int) -> None:
        """Ask the kernel to start reading a run the page-cache pass left, so the device
        has the whole batch queued before the blocking reads begin."""
        fd = self._store.fd_of(seg)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)

    def _read_pieces(
        self,
        fd: int,
        page: list[memoryview],
        offset: int,
        index: int,
        on_payload: OnPayload,
        start: int = 0,
        flags: int = 0,
    ) -> int:
        """A large page: header region first, then the payload in :data:`PIECE` pieces,
        each handed to ``on_payload`` as it lands, from byte ``start`` of the page (a
        piece boundary) on. Bytes of the page read in full pieces (with ``RWF_NOWAIT``,
        up to the first piece not in the page cache)."""
        assert on_payload is not None
        got = start
        if got == 0:
            got = _preadv_all(fd, page[:1], offset, flags)
            if got != page[0].nbytes:
                return 0
        at = page[0].nbytes
        for piece in pieces(page[1:], PIECE):
            size = sum(v.nbytes for v in piece)
            if at < got:
                at += size  # read and handed over by the first pass
                continue
            if _preadv_all(fd, list(piece), offset + at, flags) != size:
                return at
            at += size
            for view in piece:
                on_payload(index, view)
        return at

    def put(self, keys: Keys, pages: Pages) -> list[bool]:
        return self.put_with(keys, pages, None)

    def put_with(
        self,
        keys: Keys,
        pages: Pages,
        before_write: BeforeWrite,
        *,
        envelope: BatchEnvelope | None = None,
    ) -> list[bool]:
        """``put``, calling ``before_write(i)`` in the thread about to write page ``i``
        (the core writes its envelope there, just before the bytes are copied). With
        ``envelope`` and the compiled path, each record's pages are written with their
        envelopes in one compiled call instead (``before_write`` is not called).

        The results are true page by page: a batch is one or more records, and a record
        that fails leaves the pages of the records before it stored (True) and its own
        and the later ones unstored (False, never served).
        """
        self._check_batch("put", keys, pages)
        count = len(keys)
        results = [False] * count
        if not count:
            return results
        views = [[e.view for e in page] for page in pages]
        sizes = []
        for page in views:
            size = 0
            for view in page:
                size += view.nbytes
            sizes.append(size)
        static = envelope.static if envelope is not None and self.checks_envelopes else None
        i = 0
        try:
            while i < count:
                reservation = self._appender.reserve(sizes, i)
                if isinstance(reservation, str):
                    self._counters.add(f"put_failed_{reservation}", count - i)
                    break
                n = reservation.count
                if self._write(reservation, keys, views, sizes, i, before_write, static):
                    results[i : i + n] = [True] * n
                i += n
        except Exception as exc:
            if not any(results):
                raise  # nothing stored: the caller's boundary counts the error
            # some records are stored and served: say so, page by page
            self._store.warn_once(
                "put_failed_errors",
                "segment backend: a put failed after %d of its %d pages were stored: %r",
                sum(results),
                count,
                exc,
                amount=count - i,
            )
            return results
        self._refresh(False)
        return results

    def _write(
        self,
        reservation: Reservation,
        keys: Keys,
        views: list[list[memoryview]],
        sizes: list[int],
        first: int,
        before_write: BeforeWrite,
        static: bytes | None = None,
    ) -> bool:
        """Write one record: its pages (envelopes first: by ``before_write``, or with
        ``static`` in the compiled call), then its header; index them.

        Whatever happens, the reservation is finished (a failed one stops appends to
        its segment, which is then sealed once its other writes are done)."""
        store = self._store
        seg, offset, count = reservation.segment, reservation.offset, reservation.count
        last = first + count
        head = fmt.header_bytes(count)
        lengths = sizes[first:last]
        data = sum(lengths)
        seq = store.clock.next(count)
        seqs = range(seq, seq + count)
        fd = seg.fd
        published = False
        try:
            try:
                if static is not None:
                    compiled.write(fd, offset + head, keys[first:last], views[first:last], static)
                else:
                    self._write_pages(fd, views, lengths, first, last, offset + head, before_write)
                if self.config.fsync == "batch":
                    os.fdatasync(fd)
                header = fmt.pack_record_header(seg.id, keys[first:last], seqs, lengths)
                os.pwrite(fd, header, offset)
                if self.config.fsync == "batch":
                    os.fdatasync(fd)
            except OSError as exc:
                self._write_failed(seg, offset, head + data, count, exc)
                return False
            locs: list[Loc] = []
            at = offset + head
            for j, length in enumerate(lengths):
                locs.append((seg, at, length, seq + j, fmt.state_offset(offset, count, j)))
                at += length
            superseded, published = store.commit(keys[first:last], locs)
            if not published:
                # the segment left the store while this record was written (another
                # instance's clear): the pages are not stored
                self._counters.add("put_failed_errors", count)
                return False
            if superseded:
                store.mark_dead(superseded)
        finally:
            self._appender.finish(seg, failed=not published)
            store.unpin([seg])
        self._counters.add("puts", count)
        self._counters.add("bytes_written", data)
        self._counters.add("write_calls")
        if self.policy is not None:
            for key, length in zip(keys[first:last], lengths, strict=True):
                self.policy.record_insert(key, length)
        return True

    def _write_pages(
        self,
        fd: int,
        views: list[list[memoryview]],
        lengths: list[int],
        first: int,
        last: int,
        at: int,
        before_write: BeforeWrite,
    ) -> None:
        """Pages ``first..last-1`` back to back from ``at``: one ``pwritev`` per thread,
        each thread writing the envelopes of its share just before copying it."""
        total = sum(lengths)
        threads = min(self.config.io_threads, CPUS, last - first, max(1, total // SLICE_BYTES))
        starts = [at]
        for length in lengths:
            starts.append(starts[-1] + length)

        def run(lo: int, hi: int) -> list[int]:
            if before_write is not None:
                for j in range(lo, hi):
                    before_write(first + j)
            flat = [view for j in range(lo, hi) for view in views[first + j]]
            pwritev_all(fd, flat, starts[lo])
            return []

        self._slices.spread(run, last - first, threads)

    def _write_failed(self, seg: Segment, offset: int, span: int, count: int, exc: OSError) -> None:
        """Count a failed record write (per page) and mark its space as a skip record, so
        scans step over it (best effort: with the disk full that write may fail too)."""
        no_space = exc.errno in _NO_SPACE
        self._store.warn_once(
            "put_failed_no_space" if no_space else "put_failed_errors",
            "segment backend: writing into %s/%s failed: %s",
            self.store,
            seg.name,
            exc,
            amount=count,
        )
        with contextlib.suppress(OSError):
            os.pwrite(seg.fd, fmt.pack_skip_record(seg.id, span), offset)

    def delete(self, keys: Keys) -> list[bool]:
        self._check_open()
        validate_keys(keys)
        store = self._store
        locs = store.remove(keys)
        if self.config.check_disk_on_miss and None in locs:
            store.refresh()
            missing = [i for i, loc in enumerate(locs) if loc is None]
            for i, loc in zip(missing, store.remove([keys[i] for i in missing]), strict=True):
                locs[i] = loc
        gone = [loc for loc in locs if loc is not None]
        if gone:
            store.mark_dead(gone, erase=True)
        self._counters.add("deletes", len(gone))
        return [loc is not None for loc in locs]

    def clear(self) -> None:
        """Remove every segment of this namespace (other processes' too)."""
        self._check_open()
        store = self._store
        self._appender.reset()
        store.drop_all()
        with os.scandir(store.dir_fd) as entries:
            names = [e.name for e in entries if fmt.segment_of_name(e.name) is not None]
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=store.dir_fd)
        store.refresh(force=True)

    def rescan(self) -> None:
        """Look for other processes' segments and records now."""
        self._store.refresh(force=True)

    # --- space (kvtier.core.space: in a chain, its space manager owns it) ---------------

    def space(self) -> SpaceReport:
        """The segments' bytes and the room left for pages before a put is refused:
        the active segment's and that of the new segments the bounds still allow."""
        used, free = self._appender.space(self._page_cost)
        capacity = self.config.capacity_bytes
        return SpaceReport(used, free, None if capacity is None else int(capacity))

    def page_cost(self, nbytes: int) -> int:
        """A page's bytes and its entry in its record's header (the header's fixed part
        and alignment are counted once per record and segment in :meth:`space`)."""
        cost = nbytes + fmt.ENTRY_BYTES + 1
        self._page_cost = max(self._page_cost, cost)
        return cost

    def reclaim_units(self) -> list[ReclaimUnit]:
        """The sealed segments no writer of ours fills, oldest first, with their pages."""
        return [
            ReclaimUnit(seg.id, seg.size, tuple((key, loc[2]) for key, loc in live))
            for seg, live in self._appender.candidates()
        ]

    def rewrite_budget(self) -> int:
        """``reclaim_rewrite_fraction`` of a segment."""
        config = self.config
        return int(config.reclaim_rewrite_fraction * int(config.segment_bytes))

    def reclaim(self, unit: int, keep: frozenset[str]) -> list[str] | None:
        """Reclaim segment ``unit``, keeping (rewriting) the pages in ``keep``."""
        self._check_open()
        return self._appender.reclaim(unit, keep)

    def stats(self) -> dict[str, int | float]:
        values = self._store.stats()
        values.update(self._counters.snapshot())
        return values

    def close(self) -> None:
        """Seal the active segment, stop the threads, close every file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._appender.close()
        self._slices.close()
        self._store.close()
