"""The io_uring engine of the ``uring`` backend: batches of vectored I/O with a bounded queue.

A :class:`Ring` owns one io_uring instance and one eventfd registered with it. ``run``
takes a batch of :class:`IORequest` (vectored reads and writes over memoryviews, fsyncs,
renames),
keeps at most ``queue_depth`` of them in flight, refills the submission queue as
completions arrive and resubmits the remainder of short transfers. Completions are reaped
through liburing's cqe iterator (indexing a ``Cqe`` past its first entry ignores ring
wrap-around in the Python bindings), and the thread waits in ``os.read`` on the eventfd,
which releases the GIL; liburing's own ``io_uring_wait_cqe`` would hold it.

A Ring is not thread-safe. :class:`RingPool` gives each calling thread its own ring (rings
are cheap and the kernel needs no shared submission queue), so concurrent gets and puts
from different threads never wait on each other's batches. This module imports liburing
at import time; :mod:`kvtier.backends.uring.backend` imports this module at its top, the
plugin module :mod:`kvtier.backends.uring` never does (its probe imports both when it runs).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import liburing

__all__ = ["IORequest", "Op", "Ring", "RingPool", "ring_entries"]

#: The kernel's limit on iovecs per vectored request.
IOV_MAX = int(getattr(liburing, "IOV_MAX", 1024))


class Op(enum.IntEnum):
    """What one request does."""

    READ = 0
    WRITE = 1
    FSYNC = 2
    FDATASYNC = 3
    RENAME = 4
    OPEN = 5


@dataclass(eq=False)
class IORequest:
    """One vectored transfer (or sync) on one file; the ring fills ``done`` and ``error``.

    ``done`` counts bytes transferred; ``error`` is 0 or the errno of the first failure.
    A read that met end of file early has ``error == 0`` and ``done < nbytes``.
    """

    op: Op
    fd: int
    views: Sequence[memoryview] = ()
    offset: int = 0
    #: The caller's own bookkeeping (which key this request serves); the ring ignores it.
    tag: Any = None
    #: For RENAME: (old, new) as str objects. The bindings keep a pointer into each str's
    #: UTF-8 buffer until submission, so they must be str (not Path, whose conversion
    #: makes a temporary) and stay alive: the request holds them until it completes.
    paths: tuple[str, str] | None = None
    #: For OPEN: ``paths[0]`` is opened with these flags and mode; ``result`` is the fd.
    open_flags: int = 0
    mode: int = 0o600
    #: Hand this request to the kernel's io_uring workers (IOSQE_ASYNC) instead of trying
    #: it inline in io_uring_submit, which holds the GIL. Right for buffered I/O (inline
    #: page-cache copies hold the GIL; cold buffered reads inline retry readahead in small
    #: steps); wrong for O_DIRECT, which is issued without blocking anyway.
    punt: bool = False
    done: int = 0
    error: int = 0
    #: For OPEN: the new file descriptor (the caller owns and closes it).
    result: int = -1
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(view.nbytes for view in self.views)

    @property
    def ok(self) -> bool:
        """True when the whole request completed without error."""
        return self.error == 0 and self.done == self.nbytes


#: A request still to submit: the request, its views not yet transferred, the file offset.
_Pending = tuple[IORequest, list[memoryview], int]
#: Called when a request finishes; may return a follow-up request to queue.
OnDone = Callable[[IORequest], "IORequest | None"]


def ring_entries(queue_depth: int) -> int:
    """Submission-queue entries for a queue depth: the next power of two, at least 2."""
    entries = 2
    while entries < queue_depth:
        entries *= 2
    return entries


_IORING_REGISTER_IOWQ_MAX_WORKERS = 19
_SYS_IO_URING_REGISTER = 427  # the same number on every architecture


def _set_max_workers(ring_fd: int, bounded: int) -> bool:
    """Let the kernel run up to ``bounded`` blocking requests of this thread at once.

    io-wq's default for regular-file work is a few workers per CPU, fewer than a deep
    queue of punted requests needs. The bindings do not wrap this registration, so it
    goes through libc's syscall(2). Best effort: False where it is refused.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        values = (ctypes.c_uint32 * 2)(bounded, 0)  # 0 leaves the unbounded limit alone
        done = libc.syscall(
            _SYS_IO_URING_REGISTER,
            ring_fd,
            _IORING_REGISTER_IOWQ_MAX_WORKERS,
            ctypes.byref(values),
            2,
        )
    except (OSError, AttributeError):
        return False
    return bool(done == 0)


class _Inflight:
    """A submitted request's pieces that must stay alive until its completion."""

    __slots__ = ("iovec", "request", "unsent", "views", "wanted")

    def __init__(
        self,
        request: IORequest,
        views: list[memoryview],
        unsent: list[memoryview],
        iovec: object,
        wanted: int,
    ) -> None:
        self.request = request
        self.views = views
        self.unsent = unsent
        self.iovec = iovec
        self.wanted = wanted


def _advance(views: list[memoryview], count: int) -> list[memoryview]:
    """The views that remain after the first ``count`` bytes of ``views`` were transferred."""
    rest: list[memoryview] = []
    for index, view in enumerate(views):
        if count >= view.nbytes:
            count -= view.nbytes
            continue
        rest.append(view[count:])
        rest.extend(views[index + 1 :])
        break
    return rest


class Ring:
    """One io_uring with a registered eventfd; runs batches with a bounded queue depth."""

    def __init__(self, queue_depth: int = 32, *, force_async: bool = False) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth
        self.entries = ring_entries(queue_depth)
        #: Set IOSQE_ASYNC on every request: the kernel's workers do the copies instead
        #: of the submitting thread, so submission never holds the GIL for long.
        self.force_async = force_async
        self._ring = liburing.Ring()
        self._cqe = liburing.Cqe()
        self._eventfd = -1
        self._closed = True
        liburing.io_uring_queue_init(self.entries, self._ring)
        self._closed = False
        try:
            self._eventfd = os.eventfd(0, os.EFD_CLOEXEC)
            liburing.io_uring_register_eventfd(self._ring, self._eventfd)
        except BaseException:
            self.close()
            raise
        self.workers_set = _set_max_workers(self._ring.ring_fd, queue_depth)
        self._inflight: dict[int, _Inflight] = {}
        self._next_tag = 1
        #: Requests submitted, remainders of short transfers resubmitted, most in flight.
        self.submitted = 0
        self.resubmitted = 0
        self.peak_inflight = 0

    def close(self) -> None:
        """Tear the ring down. Idempotent; must not race with ``run`` on this ring."""
        if not self._closed:
            self._closed = True
            liburing.io_uring_queue_exit(self._ring)
        if self._eventfd >= 0:
            os.close(self._eventfd)
            self._eventfd = -1

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    def run(self, requests: Iterable[IORequest], on_done: OnDone | None = None) -> None:
        """Execute every request, at most ``queue_depth`` in flight; fills done/error.

        ``requests`` is consumed lazily, only as queue slots free up, so a generator can
        open each file just before its request is submitted and keep few descriptors
        open. ``on_done(request)`` is called once per finished request (in completion
        order) and may return a follow-up request (an fsync after a write) to queue next.
        """
        if self._closed:
            raise RuntimeError("this io_uring ring is closed; create a new backend")
        source = iter(requests)
        pending: deque[_Pending] = deque()
        exhausted = False
        try:
            while True:
                prepared = 0
                while len(self._inflight) < self.queue_depth:
                    if not pending:
                        if exhausted:
                            break
                        request = next(source, None)
                        if request is None:
                            exhausted = True
                            break
                        self._start(request, pending, on_done)
                        continue
                    request, views, offset = pending.popleft()
                    self._prepare(request, views, offset)
                    prepared += 1
                if prepared:
                    self._submit(pending, on_done)
                if not self._inflight and not pending and exhausted:
                    return
                if self._reap(pending, on_done) == 0 and self._inflight:
                    os.read(self._eventfd, 8)  # blocks with the GIL released
        except BaseException:
            try:
                self._drain()
            finally:
                if self._inflight:  # could not account for everything: retire the ring
                    self._inflight.clear()
                    self.close()
            raise

    def _start(self, request: IORequest, pending: deque[_Pending], on_done: OnDone | None) -> None:
        """Queue a new request (an empty transfer finishes at once)."""
        request.done = 0
        request.error = 0
        if request.op in (Op.READ, Op.WRITE) and request.nbytes == 0:
            self._finish(request, pending, on_done)
        else:
            pending.append((request, list(request.views), request.offset))

    def _finish(self, request: IORequest, pending: deque[_Pending], on_done: OnDone | None) -> None:
        if on_done is not None:
            follow_up = on_done(request)
            if follow_up is not None:
                self._start(follow_up, pending, on_done)

    def _prepare(self, request: IORequest, views: list[memoryview], offset: int) -> None:
        sqe = liburing.io_uring_get_sqe(self._ring)
        if sqe is None:  # cannot happen: entries >= queue_depth >= in flight
            raise RuntimeError("io_uring submission queue unexpectedly full")
        tag = self._next_tag
        self._next_tag += 1
        iovec = None
        wanted = 0
        unsent: list[memoryview] = []
        if request.op == Op.READ or request.op == Op.WRITE:
            views, unsent = views[:IOV_MAX], views[IOV_MAX:]
            wanted = sum(view.nbytes for view in views)
            iovec = liburing.Iovec(views)
            if request.op == Op.READ:
                liburing.io_uring_prep_readv(sqe, request.fd, iovec, offset)
            else:
                liburing.io_uring_prep_writev(sqe, request.fd, iovec, offset)
        elif request.op == Op.RENAME:
            if request.paths is None or not all(type(p) is str for p in request.paths):
                raise TypeError("a RENAME request needs paths=(old, new) as two str objects")
            liburing.io_uring_prep_rename(sqe, request.paths[0], request.paths[1])
        elif request.op == Op.OPEN:
            if request.paths is None or type(request.paths[0]) is not str:
                raise TypeError("an OPEN request needs paths=(path, ...) with a str path")
            liburing.io_uring_prep_open(sqe, request.paths[0], request.open_flags, request.mode)
        else:
            flags = liburing.IORING_FSYNC_DATASYNC if request.op == Op.FDATASYNC else 0
            liburing.io_uring_prep_fsync(sqe, request.fd, flags)
        if self.force_async or request.punt:
            liburing.io_uring_sqe_set_flags(sqe, liburing.IOSQE_ASYNC)
        liburing.io_uring_sqe_set_data64(sqe, tag)
        self._inflight[tag] = _Inflight(request, views, unsent, iovec, wanted)
        if len(self._inflight) > self.peak_inflight:
            self.peak_inflight = len(self._inflight)

    def _submit(self, pending: deque[_Pending], on_done: OnDone | None) -> None:
        while True:
            try:
                self.submitted += liburing.io_uring_submit(self._ring)
                return
            except OSError as exc:  # EINTR / EAGAIN / EBUSY: reap, then try again
                if exc.errno not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                    raise
                if self._reap(pending, on_done) == 0 and exc.errno != errno.EINTR:
                    os.read(self._eventfd, 8)

    def _reap(self, pending: deque[_Pending] | None, on_done: OnDone | None = None) -> int:
        """Process every completion now in the queue; returns how many there were."""
        seen = 0
        cqe = self._cqe
        for _ in liburing.CqeIter(self._ring, cqe):
            entry = cqe[0]
            seen += 1
            tag = entry.user_data
            try:
                result = entry.res
            except OSError as exc:  # negative res: the bindings raise with its errno
                result = -(exc.errno or errno.EIO)
            item = self._inflight.pop(tag, None)
            if item is None:
                continue
            if self._complete(item, result, pending) and pending is not None:
                self._finish(item.request, pending, on_done)
        if seen:
            liburing.io_uring_cq_advance(self._ring, seen)
        return seen

    def _complete(self, item: _Inflight, result: int, pending: deque[_Pending] | None) -> bool:
        """Account one completion; True when its request is finished (not resubmitted)."""
        request = item.request
        if result < 0:
            request.error = -result
            return True
        if request.op == Op.OPEN:
            if pending is None:  # draining after an error: nobody will own this descriptor
                os.close(result)
            else:
                request.result = result
            return True
        if request.op not in (Op.READ, Op.WRITE):
            return True
        request.done += result
        if request.done >= request.nbytes:
            return True
        if result == 0:
            if request.op == Op.WRITE:  # a write that makes no progress would spin
                request.error = errno.EIO
            return True  # a read at end of file: short, not an error
        rest = _advance(item.views, result) + item.unsent
        if result < item.wanted:
            self.resubmitted += 1
        if pending is None:  # draining after an error: give up on the remainder
            request.error = errno.ECANCELED
            return True
        pending.appendleft((request, rest, request.offset + request.done))
        return False

    def _drain(self) -> None:
        """Wait for everything in flight (after an error) so no buffer is used after return."""
        try:  # requests prepared before the error but not yet submitted go in now
            liburing.io_uring_submit(self._ring)
        except OSError:
            return
        while self._inflight:
            try:
                if self._reap(None) == 0:
                    os.read(self._eventfd, 8)
            except OSError:
                return


class RingPool:
    """One :class:`Ring` per thread (and per process, after a fork), closed together."""

    def __init__(self, queue_depth: int, *, force_async: bool = False) -> None:
        self.queue_depth = queue_depth
        self.force_async = force_async
        self._local = threading.local()
        self._lock = threading.Lock()
        self._rings: list[Ring] = []
        self._closed = False

    def ring(self) -> Ring:
        """The calling thread's ring, created on first use."""
        ring: Ring | None = getattr(self._local, "ring", None)
        pid = os.getpid()
        if ring is not None and getattr(self._local, "pid", pid) == pid and not ring.closed:
            return ring
        with self._lock:
            if self._closed:
                raise RuntimeError("the io_uring backend is closed")
            ring = Ring(self.queue_depth, force_async=self.force_async)
            self._rings.append(ring)
        self._local.ring = ring
        self._local.pid = pid
        return ring

    def run(self, requests: Iterable[IORequest], on_done: OnDone | None = None) -> None:
        """Run a batch on the calling thread's ring (see :meth:`Ring.run`)."""
        self.ring().run(requests, on_done)

    def close(self) -> None:
        """Close every ring; callers must have finished their batches. Idempotent."""
        with self._lock:
            self._closed = True
            rings, self._rings = self._rings, []
        for ring in rings:
            ring.close()
