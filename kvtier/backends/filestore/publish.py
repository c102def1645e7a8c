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
   undo; the entry is left to the sweep.
3. **Move** (:func:`move`): where a page is there, exchange the two names
   (``renameat2(RENAME_EXCHANGE)``): ext4 starts writeback of a file renamed over an
   existing one (``auto_da_alloc``), which made overwrites several times slower. Where
   nothing is there (ENOENT), or this kernel or filesystem cannot exchange (then it is
   not tried again), ``rename(2)``, after removing as debris whatever non-file holds the
   page's name (:func:`clear_name`, :func:`replace`). A failed move publishes nothing.
4. **Check the page's name** (:func:`check_moved`): no non-file may hold it after the
   move; one there means another entry took the temp name in the moment between steps 2
   and 3. An exchange is then undone (the old page is back) and it is
   :class:`TempTaken` either way. (A regular file slipped in within that moment would be
   published, and refused by its envelope on every read: a miss, never wrong bytes.
   Another writer's newer page under the name is no failure.)
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
   <kvtier.backends.filestore.store.FileStore.temp_taken>`); any other failure counts
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
    "holds",
    "move",
    "not_a_file",
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
    """A temp name no longer held the file written under it: nothing was published.

    Another entry (a directory, a symlink, another file) took the name between the write
    and the rename; publishing it would report a page that no reader can find.
    """


def _taken(tmp: Path | str) -> TempTaken:
    return TempTaken(
        errno.ESTALE, "the temp name no longer holds the page written under it", str(tmp)
    )


def holds(path: Path | str, written: FileId | None) -> bool:
    """Whether ``path`` (not followed) is a regular file, the one ``written`` names if given."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    return written is None or (info.st_dev, info.st_ino) == written


def not_a_file(path: Path | str) -> bool:
    """Whether something other than a regular file holds ``path`` (not followed).

    No writer of pages puts one under a page's name: right after a rename of ours, it
    means another entry took our temp name in the moment before.
    """
    try:
        return not stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def check_written(tmp: Path | str, written: FileId | None) -> None:
    """Step 2: raise :class:`TempTaken` unless ``tmp`` still holds the file written."""
    if not holds(tmp, written):
        raise _taken(tmp)


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


def check_moved(tmp: Path | str, final: Path | str, *, exchanged: bool) -> None:
    """Step 4: raise :class:`TempTaken` when a non-file holds ``final`` after the move.

    An exchange is undone first (the old page goes back under ``final``); a rename has
    nothing to undo.
    """
    if not not_a_file(final):
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
    :class:`TempTaken` (nothing published, an exchange undone) or OSError (nothing
    published); once the page is published nothing here raises except the directory
    fsync of ``sync_dir``, so a caller never reports a published page as failed.
    """
    check_written(tmp, written)
    exchanged = move(tmp, final, debris)
    check_moved(tmp, final, exchanged=exchanged)
    if exchanged:
        drop_replaced(tmp, debris)
    if sync_dir:
        writes.fsync_dir(os.path.dirname(os.fspath(final)))
