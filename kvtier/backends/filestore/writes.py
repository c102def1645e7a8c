"""Moving a page's bytes to disk and publishing them: vectored writes, fsync, rename.

Also the O_DIRECT checks made when the bytes move: whether a page's extents are aligned,
and (at start-up) whether the store's filesystem accepts O_DIRECT at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvtier.backends.filestore.debris import Debris, discard
from kvtier.backends.filestore.paths import PROBE_PREFIX
from kvtier.core.errors import ConfigError
from kvtier.core.layout import ALIGNMENT
from kvtier.core.storage import PageBuffers

__all__ = [
    "IOV_MAX",
    "FileId",
    "TempTaken",
    "advance_views",
    "clear_name",
    "direct_aligned",
    "exchange_supported",
    "file_id",
    "fsync_dir",
    "holds",
    "is_no_space",
    "not_a_file",
    "pieces",
    "probe_o_direct",
    "publish",
    "pwritev_all",
    "replace",
    "unlink_quietly",
]

#: Linux accepts at most this many regions per preadv/pwritev call.
IOV_MAX = 1024


def advance_views(views: list[memoryview], done: int) -> list[memoryview]:
    """The regions left after the first ``done`` bytes were transferred."""
    rest: list[memoryview] = []
    for view in views:
        if done >= view.nbytes:
            done -= view.nbytes
            continue
        rest.append(view[done:] if done else view)
        done = 0
    return rest


def pieces(views: list[memoryview], size: int) -> list[list[memoryview]]:
    """``views`` regrouped into consecutive runs of at most ``size`` bytes (split as needed)."""
    out: list[list[memoryview]] = []
    run: list[memoryview] = []
    room = size
    for view in views:
        while view.nbytes:
            part = view[:room]
            run.append(part)
            view = view[part.nbytes :]
            room -= part.nbytes
            if room == 0:
                out.append(run)
                run, room = [], size
    if run:
        out.append(run)
    return out


def pwritev_all(fd: int, views: list[memoryview]) -> int:
    """Write every region at offset 0 onwards (resuming after short writes); bytes written."""
    offset = 0
    while views:
        written = os.pwritev(fd, views[:IOV_MAX], offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += written
        views = advance_views(views, written)
    return offset


def fsync_dir(directory: Path | str) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """Whether publishing may try ``renameat2(RENAME_EXCHANGE)`` (not known to fail here)."""
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


#: A file's identity, ``(st_dev, st_ino)``: what a temp name must still hold to be published.
FileId = tuple[int, int]


def file_id(fd: int) -> FileId:
    """The identity of the open file ``fd`` (taken before it is closed, to publish it)."""
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


class TempTaken(OSError):
    """A temp name no longer held the file written under it: nothing was published.

    Another entry (a directory, a symlink, another file) took the name between the write
    and the rename; publishing it would report a page that no reader can find.
    """


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


def _taken(tmp: Path | str) -> TempTaken:
    return TempTaken(
        errno.ESTALE, "the temp name no longer holds the page written under it", str(tmp)
    )


def _drop_replaced(tmp: Path | str, debris: Debris) -> None:
    """Remove what an exchange moved under the temp name: the old page, or debris."""
    try:
        info = os.lstat(tmp)
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    else:  # a directory, symlink, FIFO... sat where the page now is
        discard(os.fspath(tmp), debris, where="a page")


def publish(
    tmp: Path | str,
    final: Path | str,
    *,
    sync_dir: bool = False,
    debris: Debris | None = None,
    written: FileId | None = None,
) -> None:
    """Atomically replace ``final`` with the fully written ``tmp`` (same directory).

    Where a page already exists, the two names are exchanged (``renameat2`` with
    ``RENAME_EXCHANGE``) and the old page, now under the temp name, is unlinked: readers
    still see the whole old or the whole new page, and ext4 does not start writeback of
    the new page as it does for a rename over an existing file (``auto_da_alloc``), which
    made overwrites several times slower. Elsewhere it is a plain ``rename``.

    Whatever held ``final`` before (a directory, a symlink...) is removed as debris and
    counted in ``debris``. Once the page is published nothing here raises (except the
    directory fsync of ``sync_dir``), so a caller never reports a published page as failed.

    Only the page written is published: ``tmp`` must be a regular file (the file
    ``written`` names, where the caller knows it) before the rename, and no non-file may
    hold ``final`` after it (another entry took the temp name in the moment between).
    Otherwise :class:`TempTaken` is raised and nothing counts as published: an exchange
    is undone (the old page is back under ``final``). After the rename ``final`` may
    hold another writer's newer page: that is no failure.
    """
    if not holds(tmp, written):
        raise _taken(tmp)
    exchanged = _exchange(tmp, final)
    if exchanged:
        if not_a_file(final):  # taken between the check and the exchange: undo
            _exchange(tmp, final)
            raise _taken(tmp)
        _drop_replaced(tmp, debris or _UNTRACKED)
    else:
        replace(tmp, final, debris, vacant=exchanged is None)
        if not_a_file(final):
            raise _taken(tmp)
    if sync_dir:
        fsync_dir(os.path.dirname(os.fspath(final)))


def is_no_space(exc: OSError) -> bool:
    """Whether ``exc`` means the filesystem or quota is full."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def unlink_quietly(paths: Iterable[Path | str]) -> None:
    """Remove temp files after a failed write; missing ones are fine."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def direct_aligned(page: PageBuffers) -> bool:
    """Whether every extent of ``page`` may be transferred with O_DIRECT."""
    return all(e.ptr % ALIGNMENT == 0 and e.length % ALIGNMENT == 0 for e in page)


def probe_o_direct(store: Path, root: Path) -> None:
    """Refuse at start-up, with a ConfigError naming ``root``, a store that rejects O_DIRECT."""
    probe = store / f"{PROBE_PREFIX}{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(
            f"o_direct is set but the filesystem holding {str(store)!r} refused "
            f"O_DIRECT ({exc.strerror}); older tmpfs, some overlay and network "
            "filesystems do not support it: choose a 'root' on a local disk or set "
            "o_direct to false",
            value=str(root),
        ) from exc
    os.close(fd)
    os.unlink(probe)
