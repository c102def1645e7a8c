"""The publish protocol of a page file, described once; its steps in C, and in Python
where the compiled module is not there.

Every writer of pages follows these steps, so that a reader that opens ``<key>.kv`` sees
the whole old page, the whole new page or no file, never a torn one (even when the writer
is killed mid-write or the disk fills), and so that a put reports True only for a page
it published. Steps 2-5 are written once in C (``_pageio_src/publish.c``, numbered as
here), and run there for every writer where the compiled module is built and
``compiled_io`` is on: the compiled loop for the pages it writes, and :func:`publish`
(through ``_pageio.publish_file``) for a page the file backend's own loop or the
io_uring ring wrote. The Python steps below (:func:`check_written`, :func:`move`,
:func:`check_moved`, :func:`drop_replaced`) are the fallback where the module is not
built, or ``compiled_io`` is off: the same rules, the same answers. Python keeps what
is rare in both cases: removing and counting debris, and the errors.

1. **Write** the page into a file under a temp name in the page's own directory (a fresh
   ``O_EXCL`` 0600 file; in the compiled loop, possibly a recycled spare), ``fdatasync``
   it unless ``fsync`` is "none", and take its identity (:func:`file_id`) before closing
   it. A failure removes the temp file (only while its name still holds it) and
   publishes nothing.
2. **Check the temp name** (:func:`check_written`): it must still hold the file written,
   a regular file of that identity, not followed; it is opened (never blocking), so that
   step 4 can read the file written even after another writer replaced it. Another entry
   under it (a directory, a symlink, another file) is never published: :class:`TempTaken`,
   with nothing to undo; the entry is left to the sweep. (Where the caller does not know
   the file, the regular file found is the one published.)
3. **Move** (:func:`move`): where a page is there, exchange the two names
   (``renameat2(RENAME_EXCHANGE)``): ext4 starts writeback of a file renamed over an
   existing one (``auto_da_alloc``), which made overwrites several times slower. Where
   nothing is there (ENOENT), or this kernel or filesystem cannot exchange (then it is
   not tried again), ``rename(2)``, after removing as debris whatever non-file holds the
   page's name (:func:`clear_name`, :func:`replace`). A failed move publishes nothing.
4. **Check the page's name** (:func:`check_moved`): it must hold the file written (its
   identity, not followed), or nothing (a delete or an eviction removed it since), or a
   *page of the key*: a regular file whose first :data:`SAME_PAGE_PREFIX` bytes (all of
   a shorter file) are those of the file written. With envelopes those bytes are the
   envelope up to its payload checksum: this store's static fields, the key's digest and
   the payload's length, so such a file is a page of this key that another writer, of
   this process or another, published over ours in the moment since the move. Then ours
   was published: no failure. Anything else there (a directory, a symlink, a foreign
   file) took the temp name in the moment between steps 2 and 3, and the move published
   it instead of our page: :class:`TempTaken`. An exchange is then undone (the old page
   is back, the entry under the temp name again, left to the sweep). After a rename the
   entry is left under the page's name: no regular file under a page's name is removed
   on a guess; every read refuses a foreign one by its envelope (a miss, never wrong
   bytes) and the next put of the key replaces it (step 5). This one rule, in both
   languages, replaces the in-process registry of writers the Python steps used to
   consult: a page another process publishes over ours is now recognised too, whichever
   language runs the steps. A put reports True only where a page of its key was
   published; a raw put (no envelope) is told from another by its header slot's leading
   bytes alone, as a store without envelopes cannot tell a page from a foreign file (two
   raw puts of one key whose header slots differ may then see one report False, and its
   exchange undone: the page left is whole either way).
5. **Drop the replaced file** (:func:`drop_replaced`): after an exchange the temp name
   holds what the page replaced. An old page file is unlinked (the compiled loop may keep
   it instead, as the spare the next page of its size is written into, when no reader
   holds it and it has no other link or owner; otherwise ``recycle_refused``); a non-file
   is removed as debris and counted (by Python, in either case).
6. **Report**: only a published page is committed to the index and counted (``puts``,
   ``bytes_written``: :meth:`FileStore.committed
   <kvtier.backends.filestore.store.FileStore.committed>`), and its directory is
   fsynced for ``fsync: "page"`` (for "batch", each touched directory once, after every
   page of the batch is published). :class:`TempTaken` releases the page's reservation
   and counts ``put_temp_taken`` (:meth:`FileStore.temp_taken
   <kvtier.backends.filestore.store.FileStore.temp_taken>`; the compiled loop then puts
   the page again through the backend's own loop); any other failure counts
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
from kvtier.backends.filestore.extension import pageio as _pageio
from kvtier.core.envelope_layout import place

__all__ = [
    "SAME_PAGE_PREFIX",
    "FileId",
    "TempTaken",
    "check_moved",
    "check_written",
    "clear_name",
    "drop_replaced",
    "exchange_supported",
    "file_id",
    "move",
    "publish",
    "replace",
]

#: A file's identity, ``(st_dev, st_ino)``: what a temp name must still hold to be published.
FileId = tuple[int, int]

#: Step 4's leading bytes: the envelope up to its payload checksum (this store's static
#: fields, the key's digest, the payload's length); ``SAME_PAGE_PREFIX`` in ``pageio.h``.
SAME_PAGE_PREFIX = place("payload_checksum")[0]

#: How step 2 opens the temp name and step 4 the page's: not followed, never blocking.
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


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


def check_written(tmp: Path | str, written: FileId | None) -> int:
    """Step 2 (Python): open the file ``tmp`` holds, which must be the file written (any
    regular file where ``written`` is None), else raise :class:`TempTaken`. The caller
    closes the descriptor; step 4 reads the file's leading bytes through it."""
    try:
        fd = os.open(tmp, _OPEN_FLAGS)
    except OSError:
        try:
            info = os.lstat(tmp)
        except OSError:
            raise _taken(tmp) from None
        if stat.S_ISREG(info.st_mode) and written in (None, (info.st_dev, info.st_ino)):
            raise  # the file written, which cannot be opened: a failure, not a taken name
        raise _taken(tmp) from None
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode) or written not in (None, (info.st_dev, info.st_ino)):
        os.close(fd)
        raise _taken(tmp)
    return fd


def _same_page(final: Path | str, fd: int) -> bool:
    """Step 4's test of a regular file under ``final`` that is not the one written (open
    as ``fd``): whether its leading bytes are the file written's (a page of the key)."""
    ours = os.pread(fd, SAME_PAGE_PREFIX, 0)
    try:
        other = os.open(final, _OPEN_FLAGS)
    except OSError:
        return False
    try:
        return (
            stat.S_ISREG(os.fstat(other).st_mode) and os.pread(other, SAME_PAGE_PREFIX, 0) == ours
        )
    finally:
        os.close(other)


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


def check_moved(tmp: Path | str, final: Path | str, fd: int, *, exchanged: bool) -> None:
    """Step 4 (Python): raise :class:`TempTaken` unless ``final`` holds the file written
    (open as ``fd``, from :func:`check_written`), nothing, or a page of the key (its
    leading bytes are the file written's: see step 4 above).

    An exchange is undone first (the old page goes back under ``final``); after a
    rename, what holds ``final`` is left there.
    """
    try:
        info = os.lstat(final)
    except OSError:  # removed since the move (a delete, an eviction): it was published
        return
    mine = os.fstat(fd)
    if (info.st_dev, info.st_ino) == (mine.st_dev, mine.st_ino):
        return
    if stat.S_ISREG(info.st_mode) and _same_page(final, fd):
        return  # another writer's page of the key, published over ours since the move
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
    compiled: bool = True,
) -> None:
    """Steps 2-5: atomically replace ``final`` with the fully written ``tmp`` (same directory).

    ``written`` is the file step 1 wrote, where the caller knows it. The steps run in C
    where the compiled module is built, unless ``compiled`` is False (``compiled_io``
    off), and in Python otherwise. Whatever non-page held ``final`` is removed as debris
    and counted in ``debris``. Raises :class:`TempTaken` (nothing of ours published, an
    exchange undone) or OSError (nothing published); once the page is published nothing
    here raises except the directory fsync of ``sync_dir``, so a caller never reports a
    published page as failed.
    """
    debris = debris or _UNTRACKED
    if compiled and _pageio is not None:
        _compiled_steps(tmp, final, written, debris)
    else:
        _python_steps(tmp, final, written, debris)
    if sync_dir:
        writes.fsync_dir(os.path.dirname(os.fspath(final)))


def _compiled_steps(
    tmp: Path | str, final: Path | str, written: FileId | None, debris: Debris
) -> None:
    """Steps 2-5 in C (``_pageio.publish_file``); Python removes the debris the C steps
    find in the way (then they run again) or move out, and remembers a filesystem that
    cannot exchange."""
    global _renameat2
    cleared = False
    while True:
        code = _pageio.publish_file(tmp, final, written, _renameat2 is not None)
        if code == _pageio.OK:
            return
        if code == _pageio.REPLACED_DEBRIS:  # published; a non-page was moved out (step 5)
            discard(os.fspath(tmp), debris, where="a page")
            return
        if code == _pageio.TEMP_TAKEN:
            raise _taken(tmp)
        if code == _pageio.NO_EXCHANGE:  # not tried again, here or in the compiled loop
            _renameat2 = None
        elif code == _pageio.IN_THE_WAY and not cleared:  # (once: it is counted then)
            cleared = True
            clear_name(final, debris)
        elif code == _pageio.IN_THE_WAY:
            raise OSError(errno.EISDIR, "something other than a page holds the name", str(final))
        else:
            raise OSError(-code, os.strerror(-code), str(final))


def _python_steps(
    tmp: Path | str, final: Path | str, written: FileId | None, debris: Debris
) -> None:
    """Steps 2-5 in Python: where the compiled module is not built (or not used)."""
    fd = check_written(tmp, written)
    try:
        exchanged = move(tmp, final, debris)
        check_moved(tmp, final, fd, exchanged=exchanged)
    finally:
        os.close(fd)
    if exchanged:
        drop_replaced(tmp, debris)
