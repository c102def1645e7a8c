"""One opened store: what the file and io_uring backends share beyond moving the bytes.

:class:`FileStore` opens the store (private directories, the debris sweep, the index),
and holds the parts both backends would otherwise each keep a copy of: the counters and
their warn-once log, opening a page for reading without following a symlink or blocking
on a FIFO, creating a temp file, publishing it over whatever debris holds the name (the
protocol of :mod:`~kvtier.backends.filestore.publish`) and counting what a put came to,
``delete`` / ``clear`` / ``rescan`` and ``stats``. A backend keeps only its data path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import overload

from kvtier.backends.filestore import paths, startup, writes
from kvtier.backends.filestore import publish as protocol
from kvtier.backends.filestore.debris import Debris, discard
from kvtier.backends.filestore.index import FileIndex
from kvtier.backends.filestore.options import FileStoreOptions
from kvtier.core.layout import ALIGNMENT
from kvtier.core.policy import EvictionPolicy
from kvtier.core.storage import Counters, PageBuffers

__all__ = ["NOT_A_PAGE", "READ_FLAGS", "WRITER_POLL", "WRITER_WAIT", "FileStore"]

#: How a page is opened for reading: never through a symlink, never blocking on a FIFO.
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
#: open(2) errors that mean the name holds something other than a page file.
NOT_A_PAGE = frozenset({errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EINVAL})
#: How long a reader waits out a page being overwritten in place (a write of microseconds
#: to a few milliseconds), polling its lock every WRITER_POLL s; the compiled loop's too.
WRITER_WAIT = 0.020
WRITER_POLL = 50e-6
#: open(2) errors of a temp file that a repaired shard directory cures.
_BAD_SHARD = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})


class FileStore:
    """The store of one backend instance under ``root/<namespace>``, opened and swept.

    ``backend`` names the backend in log lines ("file", "uring"), which go to ``log``
    (the backend's logger); ``eviction`` is the policy capacity evicts through (None:
    LRU, see :class:`~kvtier.backends.filestore.index.FileIndex`). Opening never fails
    on debris inside the store (see :func:`~kvtier.backends.filestore.startup.sweep_store`);
    only a root that is not a private directory of this user, or a namespace entry that
    cannot be removed, is refused with a ConfigError.
    """

    def __init__(
        self,
        options: FileStoreOptions,
        namespace: str,
        backend: str,
        log: logging.Logger,
        *,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        self.backend = backend
        self.log = log
        self.debris = Debris(backend, log=log)
        self.counters = Counters()
        self._warned: set[str] = set()
        self.path = startup.prepare_store(options.root, namespace, self.debris)
        self.path_str = os.fspath(self.path)
        self.o_direct = options.o_direct
        #: Whether the publish protocol's steps run in C where the module is built
        #: (``compiled_io``; :func:`~kvtier.backends.filestore.publish.publish`).
        self.compiled_steps = options.compiled_io
        if options.o_direct:
            writes.probe_o_direct(self.path, options.root)
        self.index = FileIndex(
            self.path,
            capacity_bytes=options.capacity_bytes,
            min_free_bytes=options.min_free_bytes,
            check_disk_on_miss=options.check_disk_on_miss,
            debris=self.debris,
            eviction=eviction,
        )
        self.counters.set("pages_found_at_start", self.rescan())

    # --- counters ----------------------------------------------------------------------

    def warn_once(self, what: str, message: str, *args: object) -> None:
        """Count ``what`` and log its first occurrence at WARNING."""
        self.counters.add(what)
        if what not in self._warned:
            self._warned.add(what)
            self.log.warning(message, *args)

    def direct_for(self, page: PageBuffers) -> bool:
        """Whether this page may use O_DIRECT; a misaligned one falls back, loudly."""
        if not self.o_direct:
            return False
        if writes.direct_aligned(page):
            return True
        self.warn_once(
            "o_direct_fallbacks",
            "%s backend: a page's extents are not %d-byte aligned; using buffered I/O "
            "for such pages (counted as o_direct_fallbacks)",
            self.backend,
            ALIGNMENT,
        )
        return False

    def record_reads(self, pages: Sequence[tuple[str, int]]) -> None:
        """Count the pages a get read (key, bytes) and mark them recently used."""
        self.index.touch_many(pages)
        self.counters.add("hits", len(pages))
        self.counters.add("bytes_read", sum(size for _key, size in pages))

    def page_gone(self, key: str) -> None:
        """A page another process deleted or evicted: a counted miss, out of the index."""
        self.index.forget(key)
        self.counters.add("misses")

    def stats(self) -> dict[str, int | float]:
        """The backend's counters, the debris counters and the index's figures."""
        return {**self.counters.snapshot(), **self.debris.stats(), **self.index.stats()}

    # --- reads -------------------------------------------------------------------------

    def open_page(
        self, key: str, path: str, nbytes: int, *, direct: bool = False, blocking: bool = True
    ) -> int | None:
        """Open ``key``'s page (at ``path``) for reading; its descriptor, or None for a miss.

        A missing page, or something other than a regular file under its name (removed as
        debris), is a counted miss; a file of another size than ``nbytes`` counts as
        ``get_size_mismatch``. ``O_NONBLOCK`` (so a FIFO cannot block the open) is cleared
        again when ``blocking``: io_uring honours it on regular files (a read would fail
        with EAGAIN instead of waiting), ``preadv`` does not (open(2)), so the ``file``
        backend passes False and saves the system call.

        The descriptor holds the readers' shared ``flock``: the compiled loop overwrites
        a page's file in place, or recycles a replaced page's file (writing the next page
        into it in place), only under an exclusive lock, so a locked file does not change
        while it is read.
        A file a writer holds was either just replaced under its name (it is opened once
        more: the name then holds the new page) or, when the name still holds the same
        file, is being overwritten in place: that write is waited out for at most
        :data:`WRITER_WAIT` seconds. Still held, it is counted as ``get_busy`` (a miss).
        """
        held = None
        for _attempt in range(2):
            fd = self._open_page(key, path, nbytes, direct=direct, blocking=blocking)
            if fd is None or self._read_lock(fd):
                return fd
            inode = os.fstat(fd).st_ino
            if inode == held and self._wait_for_writer(fd):
                return fd
            held = inode
            os.close(fd)
        self.counters.add("get_busy")
        return None

    @classmethod
    def _wait_for_writer(cls, fd: int) -> bool:
        """Poll the readers' lock until an in-place overwrite ends; False after WRITER_WAIT."""
        deadline = time.monotonic() + WRITER_WAIT
        while time.monotonic() < deadline:
            time.sleep(WRITER_POLL)
            if cls._read_lock(fd):
                return True
        return False

    @staticmethod
    def _read_lock(fd: int) -> bool:
        """Take the readers' shared lock; False when a writer holds the file."""
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:  # no locks on this filesystem: nothing there recycles either
            pass
        return True

    def _open_page(
        self, key: str, path: str, nbytes: int, *, direct: bool, blocking: bool
    ) -> int | None:
        flags = READ_FLAGS | os.O_DIRECT if direct else READ_FLAGS
        try:
            fd = os.open(path, flags)
        except (FileNotFoundError, NotADirectoryError):
            self.page_gone(key)
            return None
        except OSError as exc:
            if exc.errno in NOT_A_PAGE and self.not_a_page(key, path):
                return None
            self.warn_once("get_errors", "%s backend: cannot open %s: %s", self.backend, path, exc)
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                os.close(fd)
                fd = -1
                self.not_a_page(key, path)
                return None
            if info.st_size != nbytes:  # truncated, foreign or the wrong page buffer
                os.close(fd)
                fd = -1
                self.counters.add("get_size_mismatch")
                return None
            if blocking:
                fcntl.fcntl(fd, fcntl.F_SETFL, os.O_DIRECT if direct else 0)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            self.warn_once("get_errors", "%s backend: reading %s: %s", self.backend, path, exc)
            return None
        return fd

    def not_a_page(self, key: str, path: str) -> bool:
        """Remove the non-page entry under ``key``'s name; count a miss. False: it is a file."""
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                return False
        except FileNotFoundError:
            pass
        self.index.forget(key)
        discard(path, self.debris, where="a page")
        self.counters.add("misses")
        return True

    # --- writes ------------------------------------------------------------------------

    def make_leaf(self, final: Path | str) -> None:
        """Create the shard directories above ``final`` (0700), removing debris in the way."""
        leaf = Path(final).parent
        for directory in (leaf.parent, leaf):
            try:
                info = os.lstat(directory)
            except FileNotFoundError:
                info = None
            if info is not None and stat.S_ISDIR(info.st_mode):
                continue
            if info is not None:
                discard(os.fspath(directory), self.debris, where="a shard directory")
            with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
                os.mkdir(directory, paths.DIR_MODE)

    @overload
    def open_temp(self, final: Path, *, o_direct: bool = False) -> tuple[int, Path]: ...
    @overload
    def open_temp(self, final: str, *, o_direct: bool = False) -> tuple[int, str]: ...

    def open_temp(self, final: Path | str, *, o_direct: bool = False) -> tuple[int, Path | str]:
        """:func:`paths.open_temp`, curing what blocks it: debris shard dirs, stale names."""
        for _attempt in range(3):
            try:
                return paths.open_temp(final, o_direct=o_direct)
            except FileExistsError as exc:  # an earlier process with this pid left it
                discard(os.fspath(exc.filename), self.debris, where="a fresh temp file")
            except OSError as exc:
                if exc.errno not in _BAD_SHARD:
                    raise
                self.make_leaf(final)
        return paths.open_temp(final, o_direct=o_direct)

    def retry_temp(self, final: Path, error: int, tmp: Path) -> bool:
        """After a failed create of ``tmp`` with ``error``: cure the cause; True to retry."""
        if error == errno.EEXIST:
            discard(os.fspath(tmp), self.debris, where="a fresh temp file")
            return True
        if error in _BAD_SHARD:
            self.make_leaf(final)
            return True
        return False

    def publish(
        self,
        tmp: Path | str,
        final: Path | str,
        *,
        sync_dir: bool = False,
        written: protocol.FileId | None = None,
    ) -> None:
        """Steps 2-5 of the publish protocol
        (:func:`~kvtier.backends.filestore.publish.publish`), with this store's debris: in
        C where the compiled module is built and ``compiled_io`` is on."""
        protocol.publish(
            tmp,
            final,
            sync_dir=sync_dir,
            debris=self.debris,
            written=written,
            compiled=self.compiled_steps,
        )

    def publish_page(
        self,
        key: str,
        tmp: str,
        final: str,
        nbytes: int,
        *,
        sync_dir: bool = False,
        written: protocol.FileId | None = None,
    ) -> bool:
        """Publish ``key``'s written temp file and report it (steps 2-6 of
        :mod:`~kvtier.backends.filestore.publish`); False (counted, the temp file removed,
        the reservation released) when the rename fails, and False (counted
        ``put_temp_taken``) when another entry took the temp name."""
        try:
            self.publish(tmp, final, written=written)
        except protocol.TempTaken:  # what holds the name is not ours: left to the sweep
            self.temp_taken(nbytes)
            return False
        except OSError as exc:  # nothing was published: the temp file is still ours
            writes.unlink_quietly([tmp])
            self.index.release(nbytes)
            self.warn_once(
                "put_failed_io", "%s backend: publishing %s: %s", self.backend, final, exc
            )
            return False
        self.committed(key, nbytes)
        if sync_dir:
            self.sync_dirs([final])
        return True

    def committed(self, key: str, nbytes: int) -> None:
        """Step 6 for a published page: into the index, counted in ``puts`` and bytes."""
        self.index.commit(key, nbytes)
        self.counters.add("puts")
        self.counters.add("bytes_written", nbytes)

    def temp_taken(self, nbytes: int) -> None:
        """Step 6 for :class:`~kvtier.backends.filestore.publish.TempTaken`: nothing was
        published; the reservation is released and ``put_temp_taken`` counted."""
        self.index.release(nbytes)
        self.counters.add("put_temp_taken")

    def write_failed(self, final: Path | str, cause: int | None, detail: object) -> None:
        """Count (and log once) a page write that failed with errno ``cause``: a full
        filesystem or quota as ``put_failed_no_space``, anything else as ``put_failed_io``."""
        if cause in (errno.ENOSPC, errno.EDQUOT):
            self.warn_once(
                "put_failed_no_space",
                "%s backend: %s is full (%s)",
                self.backend,
                self.path,
                detail,
            )
        else:
            self.warn_once(
                "put_failed_io", "%s backend: writing %s: %s", self.backend, final, detail
            )

    def sync_dirs(self, finals: Iterable[Path | str]) -> None:
        """fsync each directory holding one of ``finals`` once (durable renames); a failure
        is counted in ``fsync_errors`` and logged once."""
        for directory in {os.path.dirname(final) for final in finals}:
            try:
                writes.fsync_dir(directory)
            except OSError as exc:
                self.warn_once(
                    "fsync_errors", "%s backend: fsync of %s: %s", self.backend, directory, exc
                )

    # --- removal and rescans -----------------------------------------------------------

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Unlink each key's page; True where one was removed."""
        paths.check_keys(keys)
        return [self.index.remove(key) for key in keys]

    def clear(self) -> int:
        """Unlink every page of this store (indexed or not), sweeping debris; the count."""
        self.index.drop_all()
        return sum(
            self.index.unlink_page(key)
            for key, _size, _mtime in startup.sweep_store(self.path, self.debris)
        )

    def rescan(self) -> int:
        """Sweep the store and rebuild the index from what is on disk; the page count."""
        return self.index.load(startup.sweep_store(self.path, self.debris))
