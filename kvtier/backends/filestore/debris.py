"""Things in a store that are not pages: naming them, removing them safely, counting them.

Everything here works on a directory file descriptor and a name (``dir_fd``, ``lstat``,
``O_NOFOLLOW``), so a symlink is removed as a symlink and never followed: nothing outside
the store is opened, stat'ed or unlinked through one. A directory is removed with its
contents, but never across a mount point and never deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading

__all__ = [
    "KINDS",
    "MAX_DEPTH",
    "Debris",
    "describe",
    "discard",
    "kind_of",
    "remove_entry",
]

_default_log = logging.getLogger("kvtier.backends.filestore")

#: Every debris counter (``stats()["debris_<kind>"]``) and what it counts.
KINDS: dict[str, str] = {
    "dirs": "a directory where a page, a temp file or a shard directory should be",
    "symlinks": "a symlink (inside or out of the root, dangling or a loop), never followed",
    "special": "a FIFO, socket or device file",
    "foreign_files": "a regular file whose name kvtier never writes",
    "empty_pages": "a zero-length page file",
    "misplaced_pages": "a page file in a shard directory other than its key's",
    "foreign_owner": "a page or shard directory owned by another user",
    "stale_temps": "a temp file left by a writer that is gone (or too old)",
    "modes_fixed": "a page (0600) or shard directory (0700) whose mode was reset",
    "unremovable": "debris that could not be removed and was left in place",
}

#: Deepest directory tree removed as debris; anything deeper is left (and counted).
MAX_DEPTH = 128
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


#: What an entry's ``st_mode`` makes it: (test, debris kind, a few words for the log).
_ENTRIES = (
    (stat.S_ISDIR, "dirs", "a directory"),
    (stat.S_ISLNK, "symlinks", "a symlink"),
    (stat.S_ISREG, "foreign_files", "a file"),
    (stat.S_ISFIFO, "special", "a FIFO"),
    (stat.S_ISSOCK, "special", "a socket"),
)


def _entry(mode: int) -> tuple[str, str]:
    """The debris kind and the words for an entry of ``st_mode`` ``mode``."""
    for test, kind, words in _ENTRIES:
        if test(mode):
            return kind, words
    return "special", "a device file"


def kind_of(mode: int) -> str:
    """The debris kind of an entry with ``st_mode`` ``mode`` found where it does not belong."""
    return _entry(mode)[0]


def describe(mode: int) -> str:
    """A few words for an entry of ``st_mode`` ``mode``, for the log."""
    return _entry(mode)[1]


class Debris:
    """The debris counters of one store, and its log: one WARNING per thing found.

    ``log`` is the backend's logger. Thread-safe. After ``log_limit`` warnings a last one
    says that further debris is counted but not logged, so junk cannot flood the log.
    """

    def __init__(
        self, backend: str, *, log: logging.Logger | None = None, log_limit: int = 100
    ) -> None:
        self.backend = backend
        self.log = log or _default_log
        self.log_limit = log_limit
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KINDS, 0)
        self._logged = 0

    def found(
        self, kind: str, path: str, what: str, action: str, *, also: str | None = None
    ) -> None:
        """Count one ``kind`` (and ``also``) of debris at ``path``; log what it was and did."""
        with self._lock:
            self._counts[kind] += 1
            if also is not None:
                self._counts[also] += 1
            self._logged += 1
            logged = self._logged
        if logged <= self.log_limit:
            self.log.warning("%s backend: %s: %s; %s", self.backend, path, what, action)
        if logged == self.log_limit:
            self.log.warning(
                "%s backend: %d debris entries logged; further ones are counted in "
                "stats()['debris_*'] but not logged",
                self.backend,
                logged,
            )

    def stats(self) -> dict[str, int]:
        """``debris_<kind>`` for every kind, zeros included, so the names are stable."""
        with self._lock:
            return {f"debris_{kind}": count for kind, count in self._counts.items()}


def _remove_tree(parent_fd: int, name: str, device: int, depth: int) -> None:
    """Remove directory ``name`` of ``parent_fd`` and everything in it, following nothing."""
    if depth > MAX_DEPTH:
        raise OSError(errno.ELOOP, f"nested deeper than {MAX_DEPTH} directories")
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:  # a 0000 directory of ours: its owner may always chmod it
        os.chmod(name, 0o700, dir_fd=parent_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.fstat(fd).st_dev != device:
            raise OSError(errno.EXDEV, "it is a mount point (another filesystem)")
        with os.scandir(fd) as entries:
            children = list(entries)
        for child in children:
            try:
                info = child.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    _remove_tree(fd, child.name, device, depth + 1)
                else:
                    os.unlink(child.name, dir_fd=fd)
            except FileNotFoundError:
                continue
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def remove_entry(
    dir_fd: int,
    name: str,
    info: os.stat_result,
    debris: Debris,
    path: str,
    *,
    kind: str,
    what: str,
) -> bool:
    """Remove entry ``name`` of ``dir_fd`` (``info`` from lstat), count and log it.

    A symlink, FIFO, socket or file is unlinked (never opened); a directory is removed
    with its contents, on the same filesystem only. What cannot be removed is left in
    place, logged and also counted as ``unremovable``. True when it is gone.
    """
    try:
        if stat.S_ISDIR(info.st_mode):
            _remove_tree(dir_fd, name, os.fstat(dir_fd).st_dev, 0)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass  # removed meanwhile (by its writer, or another process's clean-up)
    except OSError as exc:
        action = f"left in place, could not remove it ({exc.strerror})"
        debris.found(kind, path, what, action, also="unremovable")
        return False
    debris.found(kind, path, what, "removed")
    return True


def discard(path: str, debris: Debris, *, where: str) -> bool:
    """Remove whatever non-page entry sits at ``path`` (a page, temp or shard path).

    Used at run time when a put, get or delete meets something other than a page file
    under a name it needs; ``where`` says what should be there ("a page"). The parent is
    opened with ``O_NOFOLLOW`` and the entry lstat'ed, so nothing is followed. True when
    the name is free afterwards.
    """
    parent, _, name = path.rpartition("/")
    try:
        parent_fd = os.open(parent or "/", _DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError as exc:
        what = f"an entry where {where} should be"
        debris.found("unremovable", path, what, f"left in place ({exc.strerror})")
        return False
    try:
        try:
            info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        what = f"{describe(info.st_mode)} where {where} should be"
        return remove_entry(
            parent_fd, name, info, debris, path, kind=kind_of(info.st_mode), what=what
        )
    finally:
        os.close(parent_fd)
