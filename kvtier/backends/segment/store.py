"""One opened segment store: the segment table, the index, scans and the refresh.

:class:`SegmentStore` knows every segment file of its namespace directory (its own and
other processes'), and where the newest version of each key lives (:data:`Loc`). It is
rebuilt at start-up by scanning every segment's record headers (data is never read
then), and kept current afterwards: this process's puts commit into it, and
:meth:`SegmentStore.refresh` picks up what other processes appended (new segments from
the directory, new records from the segments they are still writing), what they
reclaimed (segments gone from the directory) and which of their segments they sealed.

Which process may append to a segment is settled by ``flock``: a writer creates its
segment under a temp name, takes an exclusive lock on it, writes the header, and only
then renames it in, so a published segment that is not locked has no writer, now or
ever (it is *sealed*: only deletes touch it again, in place). Locks die with their
process, so a crashed writer's segment is sealed too. A reclaimer takes the same
exclusive lock before removing a segment.

Readers never lock: a record is immutable once published, a segment is never reused,
and a segment is removed by ``unlink`` only, so a reader holding its descriptor reads
the old page; one that opens it after the unlink finds no file (a miss).

Nothing is ever written into a segment that another name can reach (a hard link made
from outside the store) or that its name no longer reaches (removed by another
instance's ``clear``): :meth:`SegmentStore.alone` checks before each write; a linked
segment leaves the store instead (:meth:`SegmentStore.disown`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from kvtier.backends.filestore.debris import Debris, describe, kind_of, remove_entry
from kvtier.backends.filestore.startup import pid_alive, prepare_store
from kvtier.backends.segment import format as fmt
from kvtier.core.storage import Counters

if TYPE_CHECKING:
    from kvtier.core.policy import EvictionPolicy

__all__ = ["ALONE", "COUNTERS", "GONE", "LINKED", "Loc", "Segment", "SegmentStore"]

#: What :meth:`SegmentStore.alone` finds: only the store's name reaches the file; the
#: name is gone (removed, or now another file); another name reaches it (a hard link).
ALONE, GONE, LINKED = "alone", "gone", "linked"

#: Every counter ``stats()`` reports, present (zero) from the start so names are stable.
COUNTERS = (
    "hits",
    "misses",
    "puts",
    "deletes",
    "bytes_read",
    "bytes_written",
    "read_calls",
    "write_calls",
    "evictions",
    "evicted_bytes",
    "segments_created",
    "segments_reclaimed",
    "segments_compacted",
    "segments_reused",
    "pages_rewritten",
    "bytes_rewritten",
    "refreshes",
    "pages_found_at_start",
    "segments_found_at_start",
    "segments_torn",
    "holes_skipped",
    "segments_bad",
    "segments_linked",
    "segments_removed_by_others",
    "get_size_mismatch",
    "get_short_reads",
    "get_gone",
    "get_errors",
    "put_failed_capacity",
    "put_failed_min_free_space",
    "put_failed_page_larger_than_capacity",
    "put_failed_no_space",
    "put_failed_errors",
    "segment_create_errors",
    "fsync_errors",
    "rewrite_errors",
    "dead_mark_errors",
    "refresh_errors",
)

#: A temp segment older than this (seconds) is stale even if its writer's pid is alive.
STALE_AGE = 600.0
#: When this module was loaded: a temp segment with this process's pid but older was left
#: by an earlier process that had the same pid (a restarted container).
STARTED = time.time()
#: Bytes read at a record header in one call: a record of up to 43 pages; a larger one
#: (up to 512 pages, ~95 KiB) takes a second read.
HEADER_READ = 8 << 10
#: Bytes read at a time while a scan looks past a hole for the next record header.
HUNT_READ = 1 << 20
#: Most segment descriptors kept open; the least recently used idle ones are closed.
MAX_OPEN = 512
#: A directory listed less than this long after its last change may change again within
#: the same timestamp tick (a coarse clock), so the next refresh lists it again.
RACY_S = 0.05
#: At most this long between refreshes while calls come in (segments other processes
#: removed are noticed, and their descriptors closed, within it).
REFRESH_PERIOD_S = 1.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(eq=False)
class Segment:
    """One segment file, as this process knows it."""

    name: str
    id: int
    ino: int
    fd: int = -1
    #: Written by this backend (its active segment, or one it sealed).
    own: bool = False
    #: No writer will append to it again.
    sealed: bool = False
    #: Where the next record header is looked for (segments others still write).
    cursor: int = fmt.SEGMENT_HEADER_BYTES
    #: Bytes of the file (what capacity counts).
    size: int = fmt.SEGMENT_HEADER_BYTES
    #: Most bytes an own segment may grow to.
    limit: int = 0
    live_bytes: int = 0
    #: Keys whose newest version is here.
    keys: set[str] = field(default_factory=set)
    #: Calls reading from (or reclaiming) it right now: its descriptor stays open.
    pins: int = 0
    #: Removed from the table (reclaimed, cleared, or gone from the directory).
    retired: bool = False
    #: A sealed segment whose scan stopped before its end (a torn tail).
    torn: bool = False
    #: An own segment written into the file of a dead one (see the writer's spare): its
    #: bytes past ``written`` are the old segment's, cut off when it is sealed.
    reused: bool = False
    #: Where an own segment's reserved records end.
    written: int = fmt.SEGMENT_HEADER_BYTES


#: Where a key's newest version lives: (segment, data offset, length, seq, state offset).
Loc: TypeAlias = tuple[Segment, int, int, int, int]


#: ``struct flock`` of Linux (type, whence, start, len, pid; 32 bytes on 64-bit ABIs).
_FLOCK = struct.Struct("hhqqi4x")


def _instances_lock(fd: int, kind: int, *, wait: bool) -> None:
    """Set an open-file-description lock of ``kind`` (``F_RDLCK``, ``F_WRLCK``) on the
    instances file's first byte: held per open file (each instance its own, threads
    and forks share it), converted in place (a refused upgrade keeps the read lock);
    ``OSError`` when refused (``wait=False``) or not supported."""
    command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    fcntl.fcntl(fd, command, _FLOCK.pack(kind, os.SEEK_SET, 0, 1, 0))


def try_lock(fd: int, kind: int) -> bool:
    """``flock(fd, kind | LOCK_NB)``; False when another open file holds a conflicting lock."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


class SegmentStore:
    """The segments and index of one namespace directory; thread-safe.

    ``policy`` (the context's eviction policy, or None) is told of every page that
    enters or leaves the index.
    """

    def __init__(
        self,
        root: Path,
        namespace: str,
        *,
        policy: EvictionPolicy | None,
        log: logging.Logger,
    ) -> None:
        self.log = log
        self.policy = policy
        self.counters = Counters()
        self.debris = Debris("segment", log=log)
        self.path = prepare_store(root, namespace, self.debris)
        self.dir_fd = os.open(self.path, _DIR_FLAGS)
        #: Held with a shared lock while this instance is open (see :meth:`exclusive`).
        self._instances = self._join()
        self.clock = fmt.Clock()
        self.lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._where: dict[str, Loc] = {}
        self._live_bytes = 0
        self._open: collections.OrderedDict[Segment, None] = collections.OrderedDict()
        self._dir_mtime = -1
        self._dir_racy = True
        self._last_refresh = 0.0
        self._warned: set[str] = set()
        self._closed = False
        found = self._load()
        self.counters.add("pages_found_at_start", found)
        self.counters.add("segments_found_at_start", len(self._segments))

    # --- the instances of this namespace ---------------------------------------------

    def _join(self) -> int | None:
        """Open :data:`~kvtier.backends.segment.format.INSTANCES` and take a read lock
        on it (an open-file-description lock: every instance holds its own, in this
        process too), waiting out an instance that holds it exclusively for a moment.
        None where the filesystem has no such locks: :meth:`exclusive` is then never
        true."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._pid = os.getpid()
        try:
            fd = os.open(fmt.INSTANCES, flags, 0o600, dir_fd=self.dir_fd)
        except OSError:
            os.close(self.dir_fd)
            raise
        try:
            _instances_lock(fd, fcntl.F_RDLCK, wait=True)
        except OSError:
            os.close(fd)
            return None
        return fd

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Whether this is the only instance of the namespace open (no other process,
        no other instance in this one), held so while the block runs: no instance opens
        the namespace (and sees its files) until the block ends.

        False at once when another instance holds its lock (or this is a forked child
        of the process that opened the store, which shares its lock). The lock goes
        from shared to exclusive and back without ever being let go.
        """
        fd = self._instances
        if fd is None or self._closed or self._pid != os.getpid():
            yield False
            return
        try:
            _instances_lock(fd, fcntl.F_WRLCK, wait=False)
        except OSError:
            yield False  # another instance holds it: our shared lock stays as it was
            return
        try:
            yield True
        finally:
            _instances_lock(fd, fcntl.F_RDLCK, wait=True)

    # --- start-up and refresh ------------------------------------------------------

    def _load(self) -> int:
        """Sweep the directory, scan every segment, build the index; pages found."""
        segments = self._list(startup=True)
        self._last_refresh = time.monotonic()
        before = len(self._where)
        for seg in sorted(segments, key=lambda s: s.id):
            self._adopt_segment(seg)
        return len(self._where) - before

    def _list(self, *, startup: bool) -> list[Segment]:
        """The segments in the directory this store does not know yet, opened and checked.

        Everything that is neither a segment nor a live writer's temp segment is debris:
        removed (never followed), logged and counted. Segments gone from the directory
        are retired.
        """
        st = os.fstat(self.dir_fd)
        listed_at = time.time()
        uid = os.geteuid()
        new: list[Segment] = []
        seen: set[str] = set()
        with os.scandir(self.dir_fd) as entries:
            children = list(entries)
        for child in children:
            name = child.name
            try:
                info = child.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            path = f"{self.path}/{name}"
            regular = stat.S_ISREG(info.st_mode)
            if fmt.segment_of_name(name) is not None and regular:
                seen.add(name)
                if name in self._segments:
                    continue
                if info.st_uid != uid:
                    what = f"a segment owned by uid {info.st_uid}"
                    remove_entry(
                        self.dir_fd, name, info, self.debris, path, kind="foreign_owner", what=what
                    )
                    continue
                seg = self._open_new(name, info, startup=startup)
                if seg is not None:
                    new.append(seg)
            elif fmt.temp_writer(name) is not None and regular:
                self._temp(name, info, path)
            elif name == fmt.INSTANCES and regular:
                continue
            else:
                where = "only segments belong in a segment store"
                if fmt.segment_of_name(name) is not None:
                    where = "a segment should be"
                what = f"{describe(info.st_mode)} where {where}"
                remove_entry(
                    self.dir_fd,
                    name,
                    info,
                    self.debris,
                    path,
                    kind=kind_of(info.st_mode),
                    what=what,
                )
        gone = [seg for name, seg in self._segments.items() if name not in seen]
        for seg in gone:
            self.retire(seg, dropped=True)
        self._dir_mtime = st.st_mtime_ns
        self._dir_racy = listed_at - st.st_mtime_ns / 1e9 < RACY_S
        return new

    def _temp(self, name: str, info: os.stat_result, path: str) -> None:
        pid = fmt.temp_writer(name)
        assert pid is not None
        why = None
        if pid == os.getpid() and info.st_mtime < STARTED - 1.0:
            why = "left by an earlier process with this pid"
        elif pid != os.getpid() and not pid_alive(pid):
            why = f"left by writer pid {pid}, which is gone"
        elif time.time() - info.st_mtime >= STALE_AGE:
            why = f"older than {STALE_AGE:.0f} s"
        if why is not None:
            what = f"a temp segment {why}"
            remove_entry(self.dir_fd, name, info, self.debris, path, kind="stale_temps", what=what)

    def _open_new(self, name: str, info: os.stat_result, *, startup: bool) -> Segment | None:
        """Open and check a segment found in the directory; None if it is not one."""
        path = f"{self.path}/{name}"
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return None  # reclaimed meanwhile
        except OSError as exc:
            self.debris.found("unremovable", path, "a segment kvtier cannot open", str(exc))
            return None
        keep = False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None  # swapped meanwhile: the next listing deals with it
            header = fmt.parse_segment_header(os.pread(fd, fmt.SEGMENT_HEADER_BYTES, 0))
            segment_id = fmt.segment_of_name(name)
            if header is None or header[0] != segment_id:
                self.counters.add("segments_bad")
                what = (
                    "a truncated segment (no complete header)"
                    if st.st_size < fmt.SEGMENT_HEADER_BYTES
                    else "a file with a segment's name but no valid segment header"
                )
                remove_entry(
                    self.dir_fd, name, st, self.debris, path, kind="foreign_files", what=what
                )
                return None
            if stat.S_IMODE(st.st_mode) != 0o600 and st.st_nlink == 1:
                os.fchmod(fd, 0o600)
                what = f"a segment with mode {stat.S_IMODE(st.st_mode):o}"
                self.debris.found("modes_fixed", path, what, "mode reset to 0600")
            self.clock.seed(header[0])
            keep = True
            return Segment(name, header[0], st.st_ino, fd, size=st.st_size)
        finally:
            if not keep:
                os.close(fd)

    def _adopt_segment(self, seg: Segment) -> None:
        """Add a newly found segment: its writer's state, its records, into the index."""
        seg.sealed = try_lock(seg.fd, fcntl.LOCK_SH)
        if seg.sealed:
            fcntl.flock(seg.fd, fcntl.LOCK_UN)
        seg.pins = 1  # its descriptor stays open while it is scanned
        with self.lock:
            self._segments[seg.name] = seg
            self._open[seg] = None
        try:
            self._scan(seg, seg.fd)
        finally:
            self.unpin([seg])
        self._trim_open()

    def refresh(self, *, force: bool = False) -> None:
        """Pick up what other processes did since the last refresh.

        New segments (listed when the directory changed), new records in segments
        others still write (one read each), which of those they sealed, and segments
        gone from the directory (retired: their pages leave the index). ``force``
        refreshes even when another thread is doing so (waiting for it).
        """
        if self._closed:
            return
        if not self._refresh_lock.acquire(blocking=force):
            return  # another thread is refreshing right now
        try:
            self._refresh_locked()
        except OSError as exc:  # the directory is gone or unreadable: serve what is known
            self.warn_once(
                "refresh_errors", "segment backend: refreshing %s failed: %s", self.path, exc
            )
        finally:
            self._refresh_lock.release()

    def _refresh_locked(self) -> None:
        """:meth:`refresh`'s work, the listing lock held."""
        self.counters.add("refreshes")
        self._last_refresh = time.monotonic()
        mtime = os.fstat(self.dir_fd).st_mtime_ns
        if mtime != self._dir_mtime or self._dir_racy:
            for seg in sorted(self._list(startup=False), key=lambda s: s.id):
                self._adopt_segment(seg)
        with self.lock:
            growing = [s for s in self._segments.values() if not s.own and not s.sealed]
            for seg in growing:
                seg.pins += 1
        try:
            for seg in growing:
                fd = self.fd_of(seg)
                if fd is not None:
                    # the writer's lock first: once it is gone nothing more is appended,
                    # so this scan reaches the segment's final end
                    sealed = try_lock(fd, fcntl.LOCK_SH)
                    if sealed:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        seg.sealed = True
                    self._scan(seg, fd)
        finally:
            self.unpin(growing)

    def refresh_due(self) -> bool:
        """Whether the periodic refresh is due."""
        return time.monotonic() - self._last_refresh >= REFRESH_PERIOD_S

    def _scan(self, seg: Segment, fd: int) -> None:
        """Read ``seg``'s record headers from its cursor on and index their pages.

        A hole (zeros, a torn header, a header whose data the file does not hold) ends
        the scan of a segment another process still writes: it is a write in flight,
        and the next scan starts there again. In a sealed segment nothing will fill it,
        so the scan looks past it for the next valid record header (records are
        written side by side, so one published after the hole began, a put already
        acknowledged, may follow it); the hole itself is never indexed.
        """
        try:
            size = os.fstat(fd).st_size
        except OSError:
            return
        offset = seg.cursor
        records: list[fmt.Record] = []
        holes = 0
        while offset + fmt.FIXED_BYTES <= size:
            try:
                record = self._record_at(fd, seg, offset, size)
                if record is None and seg.sealed:
                    record = self._next_record(fd, seg, fmt.align(offset + 1), size)
                    holes += 1
            except OSError as exc:
                self.warn_once(
                    "get_errors", "segment backend: reading %s failed: %s", seg.name, exc
                )
                break
            if record is None:
                break
            records.append(record)
            offset = record.end
        with self.lock:
            if seg.retired:
                return
            seg.cursor = offset
            seg.size = max(seg.size, size)
            fresh = [self._index_record(seg, record) for record in records]
        if self.policy is not None:
            for pages in fresh:
                for key, nbytes in pages:
                    self.policy.record_insert(key, nbytes)
        if holes:
            self.counters.add("holes_skipped", holes)
        if (holes or offset < size) and not seg.torn and seg.sealed:
            seg.torn = True
            self.counters.add("segments_torn")
            self.log.warning(
                "segment backend: %s/%s: %d hole(s) (a torn tail, a truncated record, or a "
                "write that never finished) in %d bytes; the pages there are misses, the "
                "records after them are served",
                self.path,
                seg.name,
                holes,
                size,
            )

    def _record_at(self, fd: int, seg: Segment, offset: int, size: int) -> fmt.Record | None:
        """The valid record whose header is at ``offset`` and whose data the file holds."""
        data = os.pread(fd, HEADER_READ, offset)
        record, need = fmt.parse_record(data, offset, seg.id)
        if record is None and need > 0:
            data = os.pread(fd, need, offset)
            record, need = fmt.parse_record(data, offset, seg.id)
        if record is None:
            return None
        if record.entries and offset + record.header_bytes + record.data_bytes > size:
            return None  # its data is not all there (a skip record needs none)
        return record

    def _next_record(self, fd: int, seg: Segment, start: int, size: int) -> fmt.Record | None:
        """The first valid record at an aligned offset from ``start`` on (past a hole)."""
        at = start
        while at + fmt.FIXED_BYTES <= size:
            chunk = os.pread(fd, HUNT_READ, at)
            if not chunk:
                return None
            for i in range(0, len(chunk), fmt.ALIGN):
                if fmt.is_record_magic(chunk, i):
                    record = self._record_at(fd, seg, at + i, size)
                    if record is not None:
                        return record
            at += fmt.align(len(chunk))
        return None

    def _index_record(self, seg: Segment, record: fmt.Record) -> list[tuple[str, int]]:
        """Index a scanned record's live pages (lock held); the (key, bytes) adopted."""
        adopted: list[tuple[str, int]] = []
        offset = record.offset + record.header_bytes
        count = len(record.entries)
        for i, entry in enumerate(record.entries):
            if entry.live:
                loc = (
                    seg,
                    offset,
                    entry.length,
                    entry.seq,
                    fmt.state_offset(record.offset, count, i),
                )
                if self._adopt(entry.key, loc):
                    adopted.append((entry.key, entry.length))
            offset += entry.length
            self.clock.seed(entry.seq)
        return adopted

    def _adopt(self, key: str, loc: Loc) -> bool:
        """Make ``loc`` the key's location if it is newer than what is known (lock held)."""
        old = self._where.get(key)
        if old is not None:
            if (old[3], old[0].id) >= (loc[3], loc[0].id):
                return False
            self._drop_locked(key, old)
        self._where[key] = loc
        seg = loc[0]
        seg.keys.add(key)
        seg.live_bytes += loc[2]
        self._live_bytes += loc[2]
        return True

    def _drop_locked(self, key: str, loc: Loc) -> None:
        seg = loc[0]
        seg.keys.discard(key)
        seg.live_bytes -= loc[2]
        self._live_bytes -= loc[2]

    # --- the table -------------------------------------------------------------------

    @property
    def listing_lock(self) -> threading.Lock:
        """Held while the directory is listed; hold it to rename a new segment in and
        :meth:`add_own` it, so no listing sees it half-way."""
        return self._refresh_lock

    def add_own(self, seg: Segment) -> None:
        """Register a segment this backend just created (its fd open and locked)."""
        with self.lock:
            self._segments[seg.name] = seg

    def segments(self) -> list[Segment]:
        """Every segment in the table, oldest first."""
        with self.lock:
            return sorted(self._segments.values(), key=lambda s: s.id)

    def total_bytes(self) -> int:
        """Bytes of every segment file in the table (what ``capacity_bytes`` bounds)."""
        with self.lock:
            return sum(seg.size for seg in self._segments.values())

    def grow(self, seg: Segment, end: int) -> None:
        """An own segment's file will reach ``end``: a write was reserved there. Pins
        ``seg`` for that write (release with :meth:`unpin`)."""
        with self.lock:
            seg.size = max(seg.size, end)
            seg.written = max(seg.written, end)
            seg.pins += 1

    def retire(self, seg: Segment, *, dropped: bool) -> list[tuple[str, int]]:
        """Take ``seg`` out of the table; its descriptor closes once no call reads it.

        With ``dropped``, the pages whose newest version is there leave the index (the
        policy is told); otherwise the caller moves them first. Returns the (key,
        bytes) that left.
        """
        left: list[tuple[str, int]] = []
        with self.lock:
            if seg.retired:
                return left
            seg.retired = True
            self._segments.pop(seg.name, None)
            self._open.pop(seg, None)
            if dropped:
                for key in list(seg.keys):
                    loc = self._where.pop(key)
                    self._drop_locked(key, loc)
                    left.append((key, loc[2]))
            if seg.pins == 0:
                self._close_fd(seg)
        if self.policy is not None:
            for key, _ in left:
                self.policy.record_remove(key)
        return left

    def pin(self, seg: Segment) -> None:
        with self.lock:
            seg.pins += 1

    def unpin(self, segs: Iterable[Segment]) -> None:
        """Release pins taken by :meth:`lookup` or :meth:`pin`."""
        with self.lock:
            for seg in segs:
                seg.pins -= 1
                if seg.pins == 0 and seg.retired:
                    self._close_fd(seg)

    def _close_fd(self, seg: Segment) -> None:
        if seg.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(seg.fd)
            seg.fd = -1

    def fd_of(self, seg: Segment) -> int | None:
        """An open descriptor of pinned ``seg``, opened again if it was closed; None if
        the file is gone (reclaimed by another process)."""
        with self.lock:
            if seg.fd >= 0:
                if not seg.retired:
                    self._open[seg] = None
                    self._open.move_to_end(seg)
                return seg.fd
            if seg.retired:
                return None
            try:
                fd = os.open(seg.name, _FILE_FLAGS, dir_fd=self.dir_fd)
            except OSError:
                return None
            if os.fstat(fd).st_ino != seg.ino:
                os.close(fd)
                return None
            seg.fd = fd
            self._open[seg] = None
        self._trim_open()
        return fd

    def _trim_open(self) -> None:
        """Close the least recently used idle descriptors beyond :data:`MAX_OPEN`."""
        with self.lock:
            if len(self._open) <= MAX_OPEN:
                return
            for seg in list(self._open):
                if len(self._open) <= MAX_OPEN:
                    break
                if seg.pins == 0 and not (seg.own and not seg.sealed):
                    self._open.pop(seg)
                    self._close_fd(seg)

    # --- the index -------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> list[Loc | None]:
        """Each key's location, its segment pinned (release with :meth:`unpin`)."""
        where = self._where
        with self.lock:
            locs = [where.get(key) for key in keys]
            for loc in locs:
                if loc is not None:
                    loc[0].pins += 1
        return locs

    def contains(self, keys: Sequence[str]) -> list[bool]:
        where = self._where
        with self.lock:
            return [key in where for key in keys]

    def location(self, key: str) -> Loc | None:
        """The key's location now (not pinned)."""
        with self.lock:
            return self._where.get(key)

    def commit(self, keys: Sequence[str], locs: Sequence[Loc]) -> tuple[list[Loc], bool]:
        """Publish freshly written pages: the locations they superseded (to mark DEAD),
        and whether they were published (False: their segment left the store meanwhile,
        cleared or reclaimed by another instance, so the pages are not stored).

        A page loses to a newer version committed meanwhile (last writer wins by seq);
        then its own location is returned instead. The returned locations' segments are
        pinned: pass them to :meth:`mark_dead`, which releases them.
        """
        superseded: list[Loc] = []
        with self.lock:
            where = self._where
            if locs and locs[0][0].retired:
                return superseded, False
            for key, loc in zip(keys, locs, strict=True):
                seg = loc[0]
                old = where.get(key)
                if old is not None:
                    if (old[3], old[0].id) >= (loc[3], seg.id):
                        seg.pins += 1
                        superseded.append(loc)
                        continue
                    self._drop_locked(key, old)
                    old[0].pins += 1
                    superseded.append(old)
                where[key] = loc
                seg.keys.add(key)
                seg.live_bytes += loc[2]
                self._live_bytes += loc[2]
        return superseded, True

    def move(self, key: str, old: Loc, new: Loc) -> bool:
        """Point ``key`` from ``old`` to the rewritten ``new``, unless it moved meanwhile."""
        with self.lock:
            if self._where.get(key) is not old:
                return False
            self._drop_locked(key, old)
            self._where[key] = new
            new[0].keys.add(key)
            new[0].live_bytes += new[2]
            self._live_bytes += new[2]
            return True

    def remove(self, keys: Sequence[str]) -> list[Loc | None]:
        """Take keys out of the index (a delete); their former locations, pinned."""
        with self.lock:
            out: list[Loc | None] = []
            for key in keys:
                loc = self._where.pop(key, None)
                if loc is not None:
                    self._drop_locked(key, loc)
                    loc[0].pins += 1
                out.append(loc)
        if self.policy is not None:
            for key, loc in zip(keys, out, strict=True):
                if loc is not None:
                    self.policy.record_remove(key)
        return out

    def forget(self, key: str, loc: Loc, *, reclaimed: bool = False) -> None:
        """Drop ``key`` if it still lives at ``loc`` (a read found the page gone, or a
        reclaim dropped it; ``reclaimed``: on the backend's own account, see
        :meth:`~kvtier.core.policy.EvictionPolicy.record_reclaimed`)."""
        with self.lock:
            if self._where.get(key) is not loc:
                return
            del self._where[key]
            self._drop_locked(key, loc)
        if self.policy is not None:
            if reclaimed:
                self.policy.record_reclaimed(key)
            else:
                self.policy.record_remove(key)

    def live(self, seg: Segment) -> list[tuple[str, Loc]]:
        """The pages whose newest version is in ``seg``, in file order."""
        with self.lock:
            pages = [(key, self._where[key]) for key in seg.keys]
        pages.sort(key=lambda item: item[1][1])
        return pages

    def segment_of(self, keys: Iterable[str]) -> dict[Segment, int]:
        """Bytes of ``keys`` per segment holding their newest version."""
        out: dict[Segment, int] = {}
        with self.lock:
            for key in keys:
                loc = self._where.get(key)
                if loc is not None:
                    out[loc[0]] = out.get(loc[0], 0) + loc[2]
        return out

    def drop_all(self) -> list[Segment]:
        """Forget every page and segment (``clear``); the segments that were known."""
        with self.lock:
            segments = list(self._segments.values())
            keys = list(self._where)
            self._where.clear()
            self._live_bytes = 0
            for seg in segments:
                seg.keys.clear()
                seg.live_bytes = 0
        for seg in segments:
            self.retire(seg, dropped=False)
        if self.policy is not None:
            for key in keys:
                self.policy.record_remove(key)
        return segments

    # --- writes to published records ---------------------------------------------

    def mark_dead(self, locs: Sequence[Loc], *, erase: bool = False) -> None:
        """Set the state byte of each (pinned) location's entry to DEAD, then unpin them.

        With ``erase`` the page's first 8 bytes (its envelope magic) become
        :data:`~kvtier.backends.segment.format.ERASED` too, so a reader that still holds
        the old location (another process's index) finds no page. Entries of one
        record next to each other are marked in one write.
        """
        try:
            runs: list[tuple[Segment, int, int]] = []
            for seg, _offset, _length, _seq, state in sorted(locs, key=lambda x: (x[0].id, x[4])):
                if runs and runs[-1][0] is seg and runs[-1][1] + runs[-1][2] == state:
                    runs[-1] = (seg, runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((seg, state, 1))
            writable: dict[Segment, int | None] = {}
            for seg in {loc[0] for loc in locs}:
                fd = self.fd_of(seg)
                verdict = GONE if fd is None else self.alone(seg, fd)
                writable[seg] = fd if verdict == ALONE else None
                if verdict == LINKED:
                    self.disown(seg)  # its pages go, so a delete or overwrite still holds
            for seg, state, count in runs:
                fd = writable[seg]
                if fd is not None:
                    os.pwrite(fd, b"\x01" * count, state)
            if erase:
                for seg, offset, _length, _seq, _state in locs:
                    fd = writable[seg]
                    if fd is not None:
                        os.pwrite(fd, fmt.ERASED, offset)
        except OSError as exc:
            self.warn_once(
                "dead_mark_errors", "segment backend: marking a page dead failed: %s", exc
            )
        finally:
            self.unpin([loc[0] for loc in locs])

    def alone(self, seg: Segment, fd: int) -> str:
        """Whether ``seg`` may be written: :data:`ALONE` when the store's name still names
        it and no other name does; :data:`GONE` when the name is gone (another instance
        removed it); :data:`LINKED` when another name reaches it (a hard link from
        outside the store), which kvtier never writes into (as the ``file`` backend)."""
        try:
            named = os.stat(seg.name, dir_fd=self.dir_fd, follow_symlinks=False)
            links = os.fstat(fd).st_nlink
        except OSError:
            return GONE
        if named.st_ino != seg.ino:
            return GONE
        return ALONE if links == 1 else LINKED

    def disown(self, seg: Segment) -> None:
        """Take a segment another name reaches out of the store: its pages leave the
        index (counted as evictions) and the store's name of it is removed (the other
        name keeps the file, which kvtier never writes again)."""
        left = self.retire(seg, dropped=True)
        self.counters.add("evictions", len(left))
        self.counters.add("evicted_bytes", sum(nbytes for _, nbytes in left))
        with contextlib.suppress(OSError):
            if os.stat(seg.name, dir_fd=self.dir_fd, follow_symlinks=False).st_ino == seg.ino:
                os.unlink(seg.name, dir_fd=self.dir_fd)
        self.warn_once(
            "segments_linked",
            "segment backend: %s/%s has another name (a hard link from outside the store); "
            "kvtier never writes into a file another name reaches, so its %d pages were "
            "dropped and it left the store (remove the link to keep this from recurring)",
            self.path,
            seg.name,
            len(left),
        )

    # --- reporting ---------------------------------------------------------------------

    def warn_once(self, counter: str, message: str, *args: Any, amount: int = 1) -> None:
        """Count ``amount`` of ``counter`` and log ``message`` at WARNING the first time."""
        self.counters.add(counter, amount)
        with self.lock:
            first = counter not in self._warned
            self._warned.add(counter)
        if first:
            self.log.warning(message + " (further ones are counted in stats()[%r])", *args, counter)

    def stats(self) -> dict[str, int | float]:
        with self.lock:
            segments = list(self._segments.values())
            pages = len(self._where)
            live = self._live_bytes
        disk = sum(seg.size for seg in segments)
        return {
            **dict.fromkeys(COUNTERS, 0),
            "pages": pages,
            "bytes": live,
            "segments": len(segments),
            "segment_bytes": disk,
            "dead_bytes": max(0, disk - live - fmt.SEGMENT_HEADER_BYTES * len(segments)),
            **self.debris.stats(),
        }

    def close(self) -> None:
        """Close every descriptor (releasing this process's locks) and the directory."""
        with self.lock:
            self._closed = True
            for seg in self._segments.values():
                self._close_fd(seg)
            self._open.clear()
        if self._instances is not None:
            with contextlib.suppress(OSError):
                os.close(self._instances)
        with contextlib.suppress(OSError):
            os.close(self.dir_fd)
