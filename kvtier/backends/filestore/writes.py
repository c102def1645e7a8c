"""Moving a page's bytes to disk: vectored writes, fsync, and removing failed temp files.

Also the O_DIRECT checks made when the bytes move: whether a page's extents are aligned,
and (at start-up) whether the store's filesystem accepts O_DIRECT at all. Publishing the
written file under the page's name is :mod:`kvtier.backends.filestore.publish`.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable
from pathlib import Path

from kvtier.backends.filestore.paths import PROBE_PREFIX
from kvtier.core.errors import ConfigError
from kvtier.core.layout import ALIGNMENT
from kvtier.core.storage import PageBuffers

__all__ = [
    "IOV_MAX",
    "advance_views",
    "direct_aligned",
    "fsync_dir",
    "is_no_space",
    "pieces",
    "probe_o_direct",
    "pwritev_all",
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
