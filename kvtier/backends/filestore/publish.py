"""The publish protocol of a page file, described once, and its steps in Python.

Every writer of pages follows these steps, so that a reader that opens ``<key>.kv`` sees
the whole old page, the whole new page or no file, never a torn one (even when the writer
is killed mid-write or the disk fills), and so that a put reports True only for a page
it published. Three loops run them: the Python loop (:func:`publish`, through
:meth:`FileStore.publish_page <kvtier.backends.filestore.store.FileStore.publish_page>`),
the io_uring ring (:mod:`kvtier.backends.uring.backend`: step 1 through the ring, steps
2-5 with :func:`publish`, or for ``fsync: "batch"`` step 3 as a ring rename between
:func:`check_written` and :func:`check_moved`), and the compiled loop
(``_pageio_src/publish.c``: the same steps in C with the GIL released, numbered as here).

1. **Write** the page into a file under a temp name in the page's own directory (a fresh
   ``O_EXCL`` 0600 file; in the compiled loop, possibly a recycled spare), ``fdatasync``
   it unless ``fsync`` is "none", and take its identity (:func:`file_id`) before closing
   it. A failure removes the temp file (only while its name still holds it) and
   publishes nothing.
2. **Check the temp name** (:func:`check_written`): it must still hold the file written,
   a regular file of that identity, not followed. Another entry under it (a directory,
   a symlink, another file) is never published: :class:`TempTaken`, with nothing to
   undo; the entry is left to the sweep. (Where the caller does not know the file, the
   regular file found is the one published: its identity is checked in step 4.)
3. **Move** (:func:`move`): where a page is there, exchange the two names
   (``renameat2(RENAME_EXCHANGE)``): ext4 starts writeback of a file renamed over an
   existing one (``auto_da_alloc``), which made overwrites several times slower. Where
   nothing is there (ENOENT), or this kernel or filesystem cannot exchange (then it is
   not tried again), ``rename(2)``, after removing as debris whatever non-file holds the
   page's name (:func:`clear_name`, :func:`replace`). A failed move publishes nothing.
4. **Check the page's name** (:func:`check_moved`): it must hold the file written (its
   identity, not followed), or a page another writer of the key published over ours in
   the moment since the move, or nothing (a delete or an eviction removed it since):
   ours was published, no failure. Anything else there (a directory, a symlink, a
   foreign file) took the temp name in the moment between steps 2 and 3, and the move
   published it instead of our page: :class:`TempTaken`. An exchange is then undone
   (the old page is back, the entry under the temp name again, left to the sweep).
   After a rename the entry is left under the page's name: it is not ours, but it
   cannot be told from another process's page of the key published in that moment, and
   no regular file under a page's name is removed on a guess; every read refuses a
   foreign one by its envelope (a miss, never wrong bytes) and the next put of the key
   replaces it (step 5). "Another writer": the Python steps know the files this
   process's writers are moving under a name (:func:`moving`); the compiled loop
   compares the envelope the name holds with the one it wrote (this store's static
   fields, the key's digest, the payload's length). So another process's page that
   replaces ours within those microseconds makes a put through the Python steps report
   False though a page of the key is there: a put may under-report, never claim a page
   that a get cannot find.
5. **Drop the replaced file** (:func:`drop_replaced`): after an exchange the temp name
   holds what the page replaced. An old page file is unlinked (the compiled loop may keep
   it instead, as the spare the next page of its size is written into, when no reader
   holds it and it has no other link or owner; otherwise ``recycle_refused``); a non-file
   is removed as debris and counted.
6. **Report**: only a published page is committed to the index and counted (``puts``,
   ``bytes_written``: :meth:`FileStore.committed
   <kvtier.backends.filestore.store.FileStore.committed>`), and its directory is
   fsynced for ``fsync: "page"`` (for "batch", each touched directory once, after every
   rename of the batch). :class:`TempTaken` releases the page's reservation and counts
   ``put_temp_taken`` (:meth:`FileStore.temp_taken
   <kvtier.backends.filestore.store.FileStore.temp_taken>`; the compiled loop then puts
   the page again through the Python loop); any other failure counts
   ``put_failed_io`` (or ``put_failed_no_space``) and removes the temp file.

One write skips the protocol: without fsync, the compiled loop overwrites a page the
index holds in its own file, of the same size, in place, under an exclusive ``flock``
that readers' shared one excludes, the header invalidated first and written last, so a
writer killed half-way leaves a page every reader refuses
(:func:`~kvtier.backends.filestore.compiled.write_slice`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.backends.filestore import writes
from kvtier.backends.filestore.debris import Debris, discard

__all__ = [
    "FileId",
    "TempTaken",
    "check_moved",
    "check_written",
    "clear_name",
    "drop_replaced",
    "exchange_supported",
    "file_id",
    "move",
    "moving",
    "publish",
    "replace",
]

#: A file's identity, ``(st_dev, st_ino)``: what a temp name must still hold to be published.
FileId = tuple[int, int]


def file_id(fd: int) -> FileId:
    """Step 1's identity of the open file ``fd`` (taken before it is closed, to publish it)."""
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


class TempTaken(OSError):
    """A temp name no longer held the file written under it: nothing of ours was published.

    Another entry (a directory, a symlink, another file) took the name between the write
    and the move: found before the move (step 2), or after it under the page's name
    (step 4, an exchange undone). Reporting the put would claim a page no reader finds.
    """


def _taken(tmp: Path | str) -> TempTaken:
    return TempTaken(
        errno.ESTALE, "the temp name no longer holds the page written under it", str(tmp)
    )


def check_written(tmp: Path | str, written: FileId | None) -> FileId:
    """Step 2: the identity of the file ``tmp`` holds, which must be the file written
    (any regular file where ``written`` is None); else raise :class:`TempTaken`."""
    try:
        info = os.lstat(tmp)
    except OSError:
        raise _taken(tmp) from None
    found = (info.st_dev, info.st_ino)
    if not stat.S_ISREG(info.st_mode) or (written is not None and found != written):
        raise _taken(tmp)
    return found


class _Moves:
    """The files this process's writers are moving under each page name (steps 3-4).

    Step 4 asks it whether a file that is not the writer's own under the page's name is
    another writer's page, published over ours since the move: a file some writer of
    this process is moving under that name, for as long as any of them is (so the last
    to check still sees the others' files). A process forked while a writer held the
    lock starts with none.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, tuple[int, frozenset[FileId]]] = {}
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._names = {}

    def begin(self, final: str, written: FileId) -> None:
        with self._lock:
            writers, files = self._names.get(final, (0, frozenset()))
            self._names[final] = (writers + 1, files | {written})

    def end(self, final: str) -> None:
        with self._lock:
            writers, files = self._names.pop(final, (1, frozenset()))
            if writers > 1:
                self._names[final] = (writers - 1, files)

    def moving(self, final: str, found: FileId) -> bool:
        with self._lock:
            return found in self._names.get(final, (0, frozenset()))[1]


_MOVES = _Moves()


@contextlib.contextmanager
def moving(final: Path | str, written: FileId) -> Iterator[None]:
    """Steps 3 and 4 of a writer of this process run inside: while they do, ``written``
    under ``final`` is a page of the key to every other writer's step 4."""
    name = os.fspath(final)
    _MOVES.begin(name, written)
    try:
        yield
    finally:
        _MOVES.end(name)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    return function


_renameat2: Any = _load_renameat2() if sys.platform.startswith("linux") else None


def exchange_supported() -> bool:
    """Whether step 3 may try ``renameat2(RENAME_EXCHANGE)`` (not known to fail here)."""
    return _renameat2 is not None


def _exchange(tmp: Path | str, final: Path | str) -> bool | None:
    """Swap ``tmp`` and ``final`` atomically (renameat2 RENAME_EXCHANGE).

    True when swapped; None when nothing is under ``final`` (ENOENT: a plain rename will
    do); False when this kernel or filesystem cannot exchange.
    """
    global _renameat2
    if _renameat2 is None:
        return False
    if (
        _renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE)
        == 0
    ):
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:  # no page yet under ``final``
        return None
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        _renameat2 = None  # this kernel or filesystem has no exchange: plain renames from now on
        return False
    raise OSError(err, os.strerror(err), str(final))


#: Errors of rename(2) that mean something other than a page holds the final name.
_BLOCKED = frozenset({errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST})
_UNTRACKED = Debris("kvtier")


def clear_name(final: Path | str, debris: Debris | None = None) -> bool:
    """Remove (and count) whatever other than a page file holds ``final``'s name.

    A rename would replace a symlink or FIFO silently and fail on a directory; this
    lstat first makes every such thing counted and logged, whichever way it is published.
    True when something was found (removed or not).
    """
    try:
        info = os.lstat(final)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISREG(info.st_mode):
        return False
    discard(os.fspath(final), debris or _UNTRACKED, where="a page")
    return True


def replace(
    tmp: Path | str, final: Path | str, debris: Debris | None = None, *, vacant: bool = False
) -> None:
    """``rename(tmp, final)`` over whatever non-page entry holds ``final`` (removed first).

    ``vacant``: the caller just saw nothing under ``final``, so the lstat is skipped (a
    directory made meanwhile still fails the rename, and is removed then). Raises (and
    publishes nothing) when the rename fails.
    """
    tried = False if vacant else clear_name(final, debris)
    try:
        os.replace(tmp, final)
    except OSError as exc:
        if exc.errno not in _BLOCKED or tried:  # tried: it is counted already
            raise
        discard(os.fspath(final), debris or _UNTRACKED, where="a page")
        os.replace(tmp, final)


def move(tmp: Path | str, final: Path | str, debris: Debris | None = None) -> bool:
    """Step 3: exchange ``tmp`` with the page under ``final``, or rename it there.

    True when the names were exchanged (the replaced entry is now under ``tmp``); raises
    OSError, with nothing moved, when neither works.
    """
    exchanged = _exchange(tmp, final)
    if exchanged:
        return True
    replace(tmp, final, debris, vacant=exchanged is None)
    return False


def check_moved(
    tmp: Path | str, final: Path | str, written: FileId | None, *, exchanged: bool
) -> None:
    """Step 4: raise :class:`TempTaken` unless ``final`` holds the file written after the
    move, or a page another writer of this process is moving there (see :func:`moving`).

    ``written`` None (a caller that does not know the file) checks only that a regular
    file is there. An exchange is undone first (the old page goes back under ``final``);
    after a rename, what holds ``final`` is left there (see step 4 above).
    """
    try:
        info = os.lstat(final)
    except OSError:  # removed since the move (a delete, an eviction): it was published
        return
    found = (info.st_dev, info.st_ino)
    if stat.S_ISREG(info.st_mode) and (
        written is None or found == written or _MOVES.moving(os.fspath(final), found)
    ):
        return
    if exchanged:
        _exchange(tmp, final)
    raise _taken(tmp)


def drop_replaced(tmp: Path | str, debris: Debris | None = None) -> None:
    """Step 5: remove what an exchange moved under the temp name: the old page, or debris."""
    try:
        info = os.lstat(tmp)
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    else:  # a directory, symlink, FIFO... sat where the page now is
        discard(os.fspath(tmp), debris or _UNTRACKED, where="a page")


def publish(
    tmp: Path | str,
    final: Path | str,
    *,
    sync_dir: bool = False,
    debris: Debris | None = None,
    written: FileId | None = None,
) -> None:
    """Steps 2-5: atomically replace ``final`` with the fully written ``tmp`` (same directory).

    ``written`` is the file step 1 wrote, where the caller knows it. Whatever non-page
    held ``final`` is removed as debris and counted in ``debris``. Raises
    :class:`TempTaken` (nothing of ours published, an exchange undone) or OSError
    (nothing published); once the page is published nothing here raises except the directory
    fsync of ``sync_dir``, so a caller never reports a published page as failed.
    """
    written = check_written(tmp, written)
    with moving(final, written):
        exchanged = move(tmp, final, debris)
        check_moved(tmp, final, written, exchanged=exchanged)
    if exchanged:
        drop_replaced(tmp, debris)
    if sync_dir:
        writes.fsync_dir(os.path.dirname(os.fspath(final)))
