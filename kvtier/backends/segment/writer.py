"""Appending records: the active segment, reservations, and reclaiming whole segments.

Each backend instance appends into one active segment of its own (created under an
exclusive ``flock``, see :mod:`~kvtier.backends.segment.store`). A put reserves a range
at the segment's tail under a short lock and writes it without one, so threads of one
process append side by side; a record's header is written after its data (the commit).
A segment that is full is sealed (its lock released) once its last write finished.

Space comes back a whole segment at a time (as in CacheLib's block cache regions and
Kangaroo's log): before a new segment is created, sealed segments are reclaimed until
the new one fits under ``capacity_bytes`` and above ``min_free_bytes``. Which segment:
with an eviction policy, the one holding the most of the bytes the policy would evict
first (plus its dead bytes); without one, the oldest. Its live pages that the policy did
not choose are rewritten into the new segment (up to ``reclaim_rewrite_fraction`` of a
segment, keeping their sequence numbers), the others are dropped, and the file is
unlinked only once those copies are published (synced under ``fsync: "batch"``), so a
kill at any moment leaves each kept page in the old segment or its copy. A segment with
nothing to copy is unlinked before the new one is created, so its space is free for it;
on a full disk the copies are given up (evictions) rather than the put. A reader holding
the old descriptor still reads the old page; a later reader misses or finds the copy.

Overwrites and deletes leave dead pages in sealed segments, whatever the capacity: when
a new segment is started, the sealed segment with the most dead bytes is compacted if at
least :data:`COMPACT_DEAD` of it is dead (its live pages rewritten, the file removed), so
a store that only overwrites stays within a few segments of its live data.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.backends.segment import format as fmt
from kvtier.backends.segment.config import SegmentConfig
from kvtier.backends.segment.store import (
    ALONE,
    GONE,
    LINKED,
    Loc,
    Segment,
    SegmentStore,
    try_lock,
)

__all__ = ["Appender", "Reservation", "Victim", "copy_range", "pwritev_all"]

IOV_MAX = 1024
#: A sealed segment at least this dead (superseded or deleted pages, torn tails) is
#: compacted when a new segment is started: its live pages are rewritten, the file removed.
COMPACT_DEAD = 0.75
#: How often, and how long each time, making room waits for a full segment of ours to be
#: sealed by the writes still in it.
_SEAL_WAITS = 20
_SEAL_WAIT_S = 0.25
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Write every region at ``offset`` onwards (short writes resumed); bytes written."""
    start = offset
    pending = list(views)
    while pending:
        done = os.pwritev(fd, pending[:IOV_MAX], offset)
        if done <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += done
        while pending and done >= pending[0].nbytes:
            done -= pending[0].nbytes
            pending.pop(0)
        if done:
            pending[0] = pending[0][done:]
    return offset - start


def copy_range(src: int, src_off: int, dst: int, dst_off: int, count: int) -> None:
    """Copy ``count`` bytes between files in the kernel (``copy_file_range``), or by hand."""
    while count > 0:
        try:
            done = os.copy_file_range(src, dst, count, src_off, dst_off)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            data = os.pread(src, min(count, 8 << 20), src_off)
            done = os.pwrite(dst, data, dst_off) if data else 0
        if done <= 0:
            raise OSError(errno.EIO, "copying a page of a reclaimed segment came up short")
        count -= done
        src_off += done
        dst_off += done


@dataclass
class Reservation:
    """Room for a record of ``count`` pages at ``offset`` of ``segment``."""

    segment: Segment
    offset: int
    count: int


@dataclass
class Victim:
    """A segment taken for reclamation: exclusively locked through ``fd`` (its kept
    pages are copied from it), still in the store until it is released."""

    seg: Segment
    fd: int
    #: Its live pages to copy before it goes, each with its location there.
    kept: list[tuple[str, Loc]]
    size: int
    #: Taken to compact it: if its pages cannot all be copied it stays as it is.
    compact: bool = False
    #: Its live pages dropped when it was taken (not kept).
    dropped: list[str] = field(default_factory=list)


@dataclass
class Spare:
    """A dead segment's file kept to become the next new segment: its pages' page cache
    is written over in place instead of a new file's being allocated while the old
    one's is freed (an overwrite then costs what a write into existing pages costs).

    Hidden under a temp name of this process, exclusively locked through ``fd``; kept
    only while this instance was alone on the namespace and no call of its own still
    read the segment, so nothing can read the old pages from it any more.
    """

    fd: int
    name: str
    pid: int
    #: Its bytes on disk (counted against the bounds like a segment's).
    size: int


class Appender:
    """The active segment of one backend, its reservations and reclamation."""

    def __init__(self, store: SegmentStore, config: SegmentConfig, log: logging.Logger) -> None:
        self.store = store
        self.config = config
        self.log = log
        #: Guards the active segment, its tail and the writes in flight; notified when a
        #: segment is sealed or room was made.
        self._cond = threading.Condition()
        self._making = False
        self._active: Segment | None = None
        self._tail = 0
        self._inflight: dict[Segment, int] = {}
        self._full: set[Segment] = set()
        self._spare: Spare | None = None

    # --- reservations --------------------------------------------------------------

    def reserve(self, sizes: Sequence[int], first: int) -> Reservation | str:
        """Room for a record of pages ``sizes[first:]`` (as many as fit, at least one).

        Creates a segment (reclaiming others first) when the active one is full; a
        string says why there is no room (``capacity``, ``min_free_space``,
        ``page_larger_than_capacity``, ``no_space``, ``errors``). One thread makes room
        at a time; the others wait for it and then fit into its segment.
        """
        with self._cond:
            while True:
                reservation = self._fit(sizes, first)
                if reservation is not None:
                    return reservation
                if self._making:
                    self._cond.wait()
                    continue
                if self._active is not None:
                    self._retire_active()
                need = fmt.SEGMENT_HEADER_BYTES + fmt.header_bytes(1) + sizes[first]
                limit = max(int(self.config.segment_bytes), need)
                self._making = True
                try:
                    refused = self._make_room(limit)
                finally:
                    self._making = False
                    self._cond.notify_all()
                if refused is not None:
                    return refused

    def _fit(self, sizes: Sequence[int], first: int) -> Reservation | None:
        """Reserve as many of the pages as fit in the active segment (lock held)."""
        seg = self._active
        if seg is None:
            return None
        if not self._usable(seg):
            self._retire_active()
            return None
        room = seg.limit - self._tail
        count, data = 0, 0
        most = min(len(sizes) - first, fmt.MAX_RECORD_PAGES)
        while count < most:
            size = sizes[first + count]
            if fmt.header_bytes(count + 1) + data + size > room:
                break
            data += size
            count += 1
        if count == 0:
            return None
        offset = self._tail
        self._tail = fmt.align(offset + fmt.header_bytes(count) + data)
        self._inflight[seg] = self._inflight.get(seg, 0) + 1
        self.store.grow(seg, offset + fmt.header_bytes(count) + data)
        return Reservation(seg, offset, count)

    def finish(self, seg: Segment, *, failed: bool = False) -> None:
        """A write into ``seg`` is done; a failed one stops appends to it."""
        with self._cond:
            self._inflight[seg] -= 1
            if failed and seg is self._active:
                self._retire_active()
            elif seg in self._full and self._inflight[seg] == 0:
                self._seal(seg)
                self._cond.notify_all()

    def _usable(self, seg: Segment) -> bool:
        """Whether the active segment still takes records: it is still in the store,
        under its name, and no other name reaches it (lock held). Another instance's
        ``clear`` removes it (then every segment it removed is noticed now, and a new
        segment starts); a hard link from outside is never written into."""
        store = self.store
        verdict = GONE if seg.retired or seg.fd < 0 else store.alone(seg, seg.fd)
        if verdict == ALONE:
            return True
        if verdict == LINKED:
            why = "has another name (a hard link from outside the store)"
            counter = "segments_linked"
        else:
            why = "was removed by another instance (a clear, or a reclaim)"
            counter = "segments_removed_by_others"
        store.warn_once(
            counter,
            "segment backend: the active segment %s/%s %s; appending into a new one",
            store.path,
            seg.name,
            why,
        )
        if verdict == GONE:
            store.refresh(force=True)  # forget every segment that went with it
        return False

    def _retire_active(self) -> None:
        """The active segment takes no more records; sealed once its writes are done."""
        seg = self._active
        assert seg is not None
        self._active = None
        self._full.add(seg)
        if self._inflight.get(seg, 0) == 0:
            self._seal(seg)

    def _seal(self, seg: Segment) -> None:
        """Release the writer's lock: no record will be appended to ``seg`` again."""
        self._full.discard(seg)
        self._inflight.pop(seg, None)
        seg.sealed = True
        self.store.pin(seg)  # its descriptor cannot be closed (and its number reused) here
        try:
            if seg.fd < 0:
                return  # cleared meanwhile: closed, so unlocked
            if seg.reused:
                self._cut_stale_tail(seg)
            if self.config.fsync == "batch":
                try:
                    os.fdatasync(seg.fd)
                except OSError as exc:
                    self.store.warn_once("fsync_errors", "segment backend: fsync failed: %s", exc)
            with contextlib.suppress(OSError):
                fcntl.flock(seg.fd, fcntl.LOCK_UN)
        finally:
            self.store.unpin([seg])

    def _cut_stale_tail(self, seg: Segment) -> None:
        """Cut a reused segment's file at the end of its records, before it is sealed:
        past them are the dead segment's old bytes, which a scan of a sealed segment
        would look through for records (none is ever this segment's)."""
        store = self.store
        with store.lock:
            end = seg.written
        try:
            os.ftruncate(seg.fd, end)
        except OSError as exc:  # the scan then steps over the old bytes (counted holes)
            store.warn_once(
                "segment_create_errors", "segment backend: cutting %s: %s", seg.name, exc
            )
            return
        with store.lock:
            seg.size = end

    def reset(self) -> None:
        """Forget the active segment (``clear`` removed it) and any spare file."""
        with self._cond:
            if self._active is not None:
                self._retire_active()
            self._drop_spare()

    def close(self) -> None:
        """Seal the active segment; remove the spare file."""
        self.reset()

    # --- the spare: a dead segment's file, the next new segment --------------------------

    def _keep_spare(self, victim: Victim) -> bool:
        """Keep a taken segment with no pages left as the spare instead of removing it
        (lock held): only while this instance is alone on the namespace (no other can
        still read it, or open it) and no call of this one reads it."""
        store = self.store
        seg = victim.seg
        if self._spare is not None or victim.kept:
            return False
        with store.lock:
            idle = seg.pins == 1 and not seg.keys  # only _take's pin; no page lives there
        if not idle:
            return False
        name = fmt.temp_name(seg.id, secrets.randbits(32), os.getpid())
        with store.lock:
            size = seg.size
        with store.exclusive() as alone:
            if not alone:
                return False
            try:
                if os.stat(seg.name, dir_fd=store.dir_fd, follow_symlinks=False).st_ino != seg.ino:
                    return False
                os.rename(seg.name, name, src_dir_fd=store.dir_fd, dst_dir_fd=store.dir_fd)
            except OSError:
                return False
        self._spare = Spare(victim.fd, name, os.getpid(), size)
        return True

    def _take_spare(self) -> Spare | None:
        """The spare, now the caller's (None: none, or a forked child's copy of its
        parent's, which is closed here and never written)."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.pid != os.getpid():
            with contextlib.suppress(OSError):
                os.close(spare.fd)
            return None
        return spare

    def _drop_spare(self, spare: Spare | None = None) -> None:
        """Remove the spare file (``spare``, or the kept one)."""
        spare = spare or self._take_spare()
        if spare is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(spare.name, dir_fd=self.store.dir_fd)
        with contextlib.suppress(OSError):
            os.close(spare.fd)

    # --- new segments and reclamation ----------------------------------------------

    def _make_room(self, limit: int) -> str | None:
        """Reclaim until a segment of ``limit`` bytes fits, then create it (lock held).

        The order keeps every live page on disk at every moment: victims whose pages
        are all dropped go first (unlinked and closed, so their space is free before the
        new segment is created); then the new segment is created; the pages kept are
        copied into it and published (durably under ``fsync: "batch"``); only then do
        the segments they came from go. A kill anywhere leaves each kept page in its
        old segment or in its published copy (the same sequence number: either wins).
        """
        config = self.config
        capacity = None if config.capacity_bytes is None else int(config.capacity_bytes)
        if capacity is not None and limit > capacity:
            return "page_larger_than_capacity"
        min_free = int(config.min_free_bytes)
        policy = self.store.policy
        budget = int(config.reclaim_rewrite_fraction * int(config.segment_bytes)) if policy else 0
        victims: list[Victim] = []
        refreshed = False
        waits = 0
        freed = 0
        free = self._free_bytes() if min_free > 0 else 0
        refused: str | None = None
        finished = False
        try:
            while True:
                total = self.store.total_bytes() - sum(v.size for v in victims)
                # a spare becomes the new segment: its bytes are the new segment's
                spare = self._spare.size if self._spare is not None else 0
                over = capacity is not None and total + max(limit, spare) > capacity
                low = min_free > 0 and free + freed - limit < min_free
                if not (over or low):
                    break
                if not refreshed:
                    self.store.refresh(force=True)  # who else still writes, what they sealed
                    refreshed = True
                    continue
                if self._owned():
                    # the chain's space manager chooses what leaves (see reclaim): no room
                    refused = "capacity" if over else "min_free_space"
                    break
                taken = {v.seg for v in victims}
                victim = self._choose_victim(taken)
                if victim is None and self._full and waits < _SEAL_WAITS:
                    # a full segment of ours is still being written: wait for it to be
                    # sealed (a reclaimable segment then), rather than refuse the put
                    waits += 1
                    self._cond.wait(_SEAL_WAIT_S)
                    continue
                if victim is None:
                    refused = "capacity" if over else "min_free_space"
                    break
                took = self._take(victim, budget)
                if took is None:
                    continue
                budget -= sum(loc[2] for _, loc in took.kept)
                freed += took.size
                self.store.counters.add("segments_reclaimed")
                if took.kept:
                    victims.append(took)
                else:
                    self._release(took)  # nothing to copy: its space comes back now
            if refused is None:
                # overwrites and deletes leave dead pages behind: a sealed segment that is
                # mostly dead is compacted (its few live pages rewritten) as a new one starts
                room = int(config.segment_bytes) // 2 - sum(
                    loc[2] for v in victims for _, loc in v.kept
                )
                victim = self._mostly_dead(room, {v.seg for v in victims})
                took = self._take(victim, victim.live_bytes, keep_all=True) if victim else None
                if took is not None:
                    took.compact = True
                    if took.kept:
                        victims.append(took)
                    else:  # all dead: gone now, its file the new segment's where it may be
                        self._release(took)
                refused = self._create_or_give_up(limit, victims)
            if refused is None:
                self._rewrite(victims)
            finished = True
        finally:
            for v in victims:
                if finished and not (v.compact and v.kept):
                    self._release(v, drop=True)
                else:
                    self._cancel(v)  # its pages stay where they are
        return refused

    def _owned(self) -> bool:
        """Whether a storage chain's space manager owns the space (see :meth:`reclaim`)."""
        policy = self.store.policy
        return policy is not None and policy.space_owned

    # --- the space manager's calls (kvtier.core.space.ReclaimsUnits) ---------------

    def space(self, page_cost: int) -> tuple[int, int | None]:
        """The bytes of every segment, and how many more bytes of pages costing
        ``page_cost`` each fit before :meth:`reserve` refuses (None: no bound): the active
        segment's room and that of the new segments ``capacity_bytes`` and
        ``min_free_bytes`` still allow, each less a record header and a page that does not
        fit at its end (and the alignment after it)."""
        config, store = self.config, self.store
        total = store.total_bytes()  # a spare (on disk too) is the next segment's room
        spare = self._spare.size if self._spare is not None else 0
        seg_bytes = int(config.segment_bytes)
        slack = fmt.header_bytes(1) + fmt.ALIGN + page_cost
        active = self._active
        pending = 0  # what the active segment will still take of the bounds
        room = 0
        if active is not None and not active.retired:
            pending = max(0, active.limit - self._tail)
            room = max(0, pending - slack)
        bounds: list[int] = []
        if config.capacity_bytes is not None:
            bounds.append(int(config.capacity_bytes) - total - pending)
        if int(config.min_free_bytes) > 0:
            bounds.append(self._free_bytes() - int(config.min_free_bytes) - pending)
        if not bounds:
            return total + spare, None
        segments = max(0, min(bounds)) // seg_bytes
        each = max(0, seg_bytes - fmt.SEGMENT_HEADER_BYTES - slack)
        return total + spare, room + segments * each

    def candidates(self) -> list[tuple[Segment, list[tuple[str, Loc]]]]:
        """The segments that could be reclaimed now (sealed, none of ours being written),
        oldest first, each with its live pages."""
        self.store.refresh(force=True)  # who else still writes, what they sealed
        return [
            (seg, self.store.live(seg)) for seg in self.store.segments() if self._free_to_take(seg)
        ]

    def _free_to_take(self, seg: Segment) -> bool:
        """Whether ``seg`` may be reclaimed: sealed, not ours being written, in the store."""
        return seg.sealed and seg not in self._full and not seg.retired

    def reclaim(self, unit: int, keep: frozenset[str]) -> list[str] | None:
        """Reclaim segment ``unit`` on the space manager's word: its live pages in ``keep``
        are rewritten (into the active segment, then a new one: the reclaimed segment's
        space makes room for it), the others dropped; the keys dropped, or None when it
        could not be taken (nothing changed). Kept pages that find no room are dropped as
        reclaimed (``record_reclaimed``)."""
        with self._cond:
            while self._making:
                self._cond.wait()
            self._making = True
            try:
                return self._reclaim(unit, keep)
            finally:
                self._making = False
                self._cond.notify_all()

    def _reclaim(self, unit: int, keep: frozenset[str]) -> list[str] | None:
        seg = next(
            (seg for seg in self.store.segments() if seg.id == unit and self._free_to_take(seg)),
            None,
        )
        took = None if seg is None else self._take(seg, 0, keep=keep)
        if took is None:
            return None
        self.store.counters.add("segments_reclaimed")
        victims = [took]
        finished = False
        try:
            if took.kept:
                self._rewrite(victims)  # into the active segment, as far as it fits
            if took.kept and self._new_segment_fits(took):
                if self._active is not None:
                    self._retire_active()
                limit = max(
                    int(self.config.segment_bytes),
                    fmt.SEGMENT_HEADER_BYTES
                    + fmt.header_bytes(1)
                    + max(loc[2] for _, loc in took.kept),
                )
                if self._create_or_give_up(limit, victims) is None:
                    self._rewrite(victims)
            finished = True
        finally:
            for v in victims:
                if finished:
                    self._release(v, drop=True)  # a kept page not copied is lost: reclaimed
                else:
                    self._cancel(v)  # its pages stay where they are
        return took.dropped

    def _new_segment_fits(self, victim: Victim) -> bool:
        """Whether a new segment fits once ``victim`` is gone (its kept pages go there)."""
        config = self.config
        limit = int(config.segment_bytes)
        capacity = config.capacity_bytes
        if capacity is not None and self.store.total_bytes() - victim.size + limit > capacity:
            return False
        min_free = int(config.min_free_bytes)
        return not (min_free > 0 and self._free_bytes() + victim.size - limit < min_free)

    def _create_or_give_up(self, limit: int, victims: list[Victim]) -> str | None:
        """Create the new segment; on a full disk, give up copying the victims' kept
        pages (dropped, counted as evictions) so their segments' space comes back, and
        try again: the reclaimed segments' first, then the compacted one's. None when
        created, else why not (``no_space``, ``errors``)."""
        try:
            self._create(limit)
            return None
        except OSError as exc:
            error = exc
        for group in ([v for v in victims if not v.compact], [v for v in victims if v.compact]):
            if error.errno not in _NO_SPACE:
                break
            if not group:
                continue
            for v in group:
                victims.remove(v)
                self._release(v, drop=True)
            try:
                self._create(limit)
                return None
            except OSError as exc:
                error = exc
        self.store.warn_once(
            "segment_create_errors",
            "segment backend: cannot create a segment in %s: %s",
            self.store.path,
            error,
        )
        return "no_space" if error.errno in _NO_SPACE else "errors"

    def _free_bytes(self) -> int:
        info = os.statvfs(self.store.dir_fd)
        return info.f_bavail * info.f_frsize

    def _mostly_dead(self, room: int, taken: set[Segment]) -> Segment | None:
        """The sealed segment with the most dead bytes, if at least :data:`COMPACT_DEAD`
        of it is dead and its live pages fit in ``room`` bytes; else None."""
        best: Segment | None = None
        least = int(self.config.segment_bytes) // 2
        for seg in self.store.segments():
            dead = seg.size - seg.live_bytes
            if (
                seg.sealed
                and seg not in self._full
                and seg not in taken
                and seg.size >= least
                and dead >= COMPACT_DEAD * seg.size
                and seg.live_bytes <= room
                and (best is None or dead > best.size - best.live_bytes)
            ):
                best = seg
        return best

    def _choose_victim(self, taken: set[Segment]) -> Segment | None:
        """The sealed segment to reclaim next: in the policy's order, else the oldest."""
        candidates = [
            seg
            for seg in self.store.segments()
            if seg.sealed and seg not in self._full and seg not in taken
        ]
        if not candidates:
            return None
        policy = self.store.policy
        if policy is None:
            return candidates[0]
        wanted = set(candidates)
        victims = policy.choose_victims(int(self.config.segment_bytes))
        scores = {seg: b for seg, b in self.store.segment_of(victims).items() if seg in wanted}
        if not scores:
            return candidates[0]

        def score(seg: Segment) -> tuple[int, int]:
            dead = seg.size - seg.live_bytes
            return (scores.get(seg, 0) + dead, -seg.id)

        return max(scores, key=score)

    def _take(
        self,
        seg: Segment,
        budget: int,
        *,
        keep_all: bool = False,
        keep: frozenset[str] | None = None,
    ) -> Victim | None:
        """Take ``seg`` for reclamation: exclusively locked, its pages dropped but those
        kept (the ones the policy would not evict first, within ``budget`` bytes; with
        ``keep_all``, every live page within it; with ``keep``, those keys: the space
        manager's choice). The file stays until
        :meth:`_release` (after the kept pages are published elsewhere) or
        :meth:`_cancel`.

        None when ``seg`` could not be taken (another process writes or reclaims it, or
        it is gone).
        """
        store = self.store
        try:
            fd = os.open(seg.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=store.dir_fd)
        except OSError:
            store.retire(seg, dropped=True)
            return None
        try:
            same = os.fstat(fd).st_ino == seg.ino
            locked = same and try_lock(fd, fcntl.LOCK_EX)
        except OSError:
            same = locked = False
        if not same:
            os.close(fd)
            store.retire(seg, dropped=True)
            return None
        if not locked:
            os.close(fd)
            seg.sealed = False  # someone holds it: not a candidate until a refresh says so
            return None
        store.pin(seg)
        kept: list[tuple[str, Loc]] = []
        policy = store.policy
        live = store.live(seg)
        if keep is not None:
            kept = [(key, loc) for key, loc in live if key in keep]
        elif keep_all:
            for key, loc in live:
                if loc[2] <= budget:
                    kept.append((key, loc))
                    budget -= loc[2]
        elif policy is not None and budget > 0 and live:
            cold = set(policy.choose_victims(seg.live_bytes))
            for key, loc in live:
                if key not in cold and loc[2] <= budget:
                    kept.append((key, loc))
                    budget -= loc[2]
        staying = {key for key, _ in kept}
        dropped = []
        # the kept pages stay indexed (readable from the segment) until moved
        for key, loc in live:
            if key not in staying:
                self._evict(key, loc)
                dropped.append(key)
        with store.lock:
            size = seg.size
        return Victim(seg, fd, kept, size, dropped=dropped)

    def _evict(self, key: str, loc: Loc, *, reclaimed: bool = False) -> None:
        """Drop a page from the index (reclamation gave up its copy); ``reclaimed``: a
        page the space manager did not choose (a kept one that found no room)."""
        self.store.forget(key, loc, reclaimed=reclaimed and self._owned())
        self.store.counters.add("evictions")
        self.store.counters.add("evicted_bytes", loc[2])

    def _release(self, victim: Victim, *, drop: bool = False) -> None:
        """Remove a taken segment: its name unlinked, its descriptors closed. With
        ``drop``, its kept pages not copied yet are dropped first (evictions)."""
        store = self.store
        seg = victim.seg
        if drop:
            for key, loc in victim.kept:
                self._evict(key, loc, reclaimed=True)
            victim.kept = []
        spared = self._keep_spare(victim)
        if not spared:
            with contextlib.suppress(OSError):
                if os.stat(seg.name, dir_fd=store.dir_fd, follow_symlinks=False).st_ino == seg.ino:
                    os.unlink(seg.name, dir_fd=store.dir_fd)
        if victim.compact:
            store.counters.add("segments_compacted")
        store.retire(seg, dropped=True)
        if not spared:
            os.close(victim.fd)  # releases the reclaimer's lock
        store.unpin([seg])

    def _cancel(self, victim: Victim) -> None:
        """Give a taken segment back as it is (its pages not copied stay indexed there)."""
        os.close(victim.fd)
        self.store.unpin([victim.seg])

    def _create(self, limit: int) -> None:
        """Create, lock and publish a fresh active segment of at most ``limit`` bytes:
        in the spare's file when there is one."""
        spare = self._take_spare()
        if spare is not None:
            try:
                self._create_from(spare, limit)
                return
            except OSError as exc:
                self.store.warn_once(
                    "segment_create_errors", "segment backend: reusing a segment file: %s", exc
                )
                self._drop_spare(spare)
        store = self.store
        segment_id, temp, name = self._new_names()
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, 0o600, dir_fd=store.dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            seg = self._publish(fd, segment_id, temp, name, limit, reused=False)
            if self.config.fsync == "batch":
                os.fsync(store.dir_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=store.dir_fd)
            raise
        self._activate(seg)

    def _create_from(self, spare: Spare, limit: int) -> None:
        """Publish the spare's file as the new active segment: a new id and header, under
        a temp name first, then its name (it is still exclusively locked). Its old
        records past the new ones never parse as this segment's (they carry the old
        id); sealing cuts them off."""
        store = self.store
        segment_id, temp, name = self._new_names()
        os.rename(spare.name, temp, src_dir_fd=store.dir_fd, dst_dir_fd=store.dir_fd)
        spare.name = temp
        seg = self._publish(spare.fd, segment_id, temp, name, limit, reused=True)
        if self.config.fsync == "batch":
            with contextlib.suppress(OSError):
                os.fsync(store.dir_fd)
        self._activate(seg)
        store.counters.add("segments_reused")

    def _new_names(self) -> tuple[int, str, str]:
        """A new segment's id, its temp name (this process's) and its name."""
        segment_id = self.store.clock.next()
        tag = secrets.randbits(32)
        return (
            segment_id,
            fmt.temp_name(segment_id, tag, os.getpid()),
            fmt.segment_name(segment_id, tag),
        )

    def _publish(
        self, fd: int, segment_id: int, temp: str, name: str, limit: int, *, reused: bool
    ) -> Segment:
        """Write the segment header into the exclusively locked file ``fd`` under
        ``temp`` and rename it to ``name``, into the store. A reused file's old bytes
        count in its size until sealing cuts them off."""
        store = self.store
        os.pwrite(fd, fmt.pack_segment_header(segment_id, segment_id, os.getpid()), 0)
        if self.config.fsync == "batch":
            os.fdatasync(fd)
        info = os.fstat(fd)
        size = max(info.st_size, fmt.SEGMENT_HEADER_BYTES) if reused else fmt.SEGMENT_HEADER_BYTES
        seg = Segment(
            name, segment_id, info.st_ino, fd, own=True, size=size, limit=limit, reused=reused
        )
        with store.listing_lock:
            os.rename(temp, name, src_dir_fd=store.dir_fd, dst_dir_fd=store.dir_fd)
            store.add_own(seg)
        return seg

    def _activate(self, seg: Segment) -> None:
        """Append into ``seg`` from now on (a segment just published)."""
        self._active = seg
        self._tail = fmt.SEGMENT_HEADER_BYTES
        self.store.counters.add("segments_created")

    def _rewrite(self, victims: list[Victim]) -> None:
        """Copy the victims' kept pages into the active segment and publish them, as
        records with their own sequence numbers (durably under ``fsync: "batch"``: data,
        then header, each synced). What is copied leaves ``kept``; what does not fit
        (or fails) stays there."""
        store = self.store
        dst = self._active
        pending = [(v, key, loc) for v in victims for key, loc in v.kept]
        sources = {v.seg: v.fd for v in victims}
        sizes = [loc[2] for _, _, loc in pending]
        i = 0
        while dst is not None and i < len(pending):
            reservation = self._fit(sizes, i)
            if reservation is None:
                break
            count = reservation.count
            chunk = pending[i : i + count]
            offset = reservation.offset
            head = fmt.header_bytes(count)
            at = offset + head
            new: list[tuple[str, Loc, Loc]] = []
            try:
                for j, (_, key, loc) in enumerate(chunk):
                    copy_range(sources[loc[0]], loc[1], dst.fd, at, loc[2])
                    state = fmt.state_offset(offset, count, j)
                    new.append((key, loc, (dst, at, loc[2], loc[3], state)))
                    at += loc[2]
                if self.config.fsync == "batch":
                    os.fdatasync(dst.fd)
                header = fmt.pack_record_header(
                    dst.id,
                    [key for _, key, _ in chunk],
                    [loc[3] for _, _, loc in chunk],
                    sizes[i : i + count],
                )
                os.pwrite(dst.fd, header, offset)
                if self.config.fsync == "batch":
                    os.fdatasync(dst.fd)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    span = head + sum(sizes[i : i + count])
                    os.pwrite(dst.fd, fmt.pack_skip_record(dst.id, span), offset)
                store.warn_once(
                    "rewrite_errors", "segment backend: rewriting reclaimed pages failed: %s", exc
                )
                break
            finally:
                self._inflight[dst] -= 1
                store.unpin([dst])
            stale: list[Loc] = []
            for key, old, loc in new:
                if store.move(key, old, loc):
                    store.counters.add("pages_rewritten")
                    store.counters.add("bytes_rewritten", loc[2])
                else:  # deleted or overwritten meanwhile: the copy must never be read
                    store.pin(dst)
                    stale.append(loc)
            store.mark_dead(stale, erase=True)
            i += count
        left = pending[i:]
        for v in victims:
            v.kept = [(key, loc) for owner, key, loc in left if owner is v]
