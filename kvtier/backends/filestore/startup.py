"""Opening a store: the private root, the namespace directory, and the debris sweep.

:func:`sweep_store` is the one walk over a store: at start-up, on ``rescan()`` and on
``clear()``. It returns the published pages and deals with everything else it meets
(see :mod:`~kvtier.backends.filestore.debris` for the kinds): stale temp files and
debris are removed, wrong modes reset, and each is logged and counted. It walks with
directory descriptors and lstat, so no symlink is followed, and nothing it finds stops
the store from opening.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from kvtier.backends.filestore.debris import Debris, describe, kind_of, remove_entry
from kvtier.backends.filestore.paths import (
    DIR_MODE,
    FILE_MODE,
    PAGE_SUFFIX,
    PROBE_PREFIX,
    STARTED,
    TEMP_SUFFIX,
    shard_of,
    store_dir,
)
from kvtier.core.errors import ConfigError, KvtierError
from kvtier.core.keys import validate_key

__all__ = ["STALE_AGE", "ensure_private_dir", "pid_alive", "prepare_store", "sweep_store"]

#: A temp file older than this (seconds) is stale even if its writer's pid is alive.
STALE_AGE = 600.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HEX = frozenset("0123456789abcdef")


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700 (parents as umask allows), or check it is private.

    An existing directory must be owned by this user and not accessible to group or
    others: a shared temp directory must not let another user plant or read pages.
    """
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        info = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the page directory {str(path)!r}: {exc.strerror}; "
            "choose a writable 'root'",
            value=str(path),
        ) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(
            f"{str(path)!r} is not a directory (a symlink or a file); choose another 'root'",
            value=str(path),
        )
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"page directory {str(path)!r} is owned by uid {info.st_uid}, not by this user "
            f"({os.geteuid()}); choose a 'root' of your own",
            value=str(path),
        )
    if info.st_mode & 0o077:
        raise ConfigError(
            f"page directory {str(path)!r} has mode {stat.S_IMODE(info.st_mode):o}; pages "
            f"must not be readable by others: run chmod 700 on it or choose another 'root'",
            value=str(path),
        )


def prepare_store(root: str | os.PathLike[str], namespace: str, debris: Debris) -> Path:
    """Create (or check) ``root``, then make ``root/<namespace>`` a private directory.

    ``root`` is the user's choice and must be private (:func:`ensure_private_dir`).
    Inside it the namespace directory is kvtier's own: a file, symlink or special file
    in its place is removed, a directory of ours with another mode is reset to 0700, a
    directory of another user is removed; each is logged and counted in ``debris``.
    """
    ensure_private_dir(Path(root))
    store = store_dir(root, namespace)
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise ConfigError(
            f"cannot open the page directory {str(root)!r}: {exc.strerror}; "
            "choose a readable 'root'",
            value=str(root),
        ) from exc
    try:
        _ensure_child_dir(root_fd, namespace, os.fspath(store), debris, "the store")
    finally:
        os.close(root_fd)
    return store


def _ensure_child_dir(parent_fd: int, name: str, path: str, debris: Debris, role: str) -> None:
    """Make ``name`` in ``parent_fd`` a 0700 directory of ours, clearing debris in its way."""
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        info = None
    if info is not None and not _private_dir_of_ours(parent_fd, name, path, info, debris, role):
        what = f"{describe(info.st_mode)} where {role} should be"
        kind = "foreign_owner" if stat.S_ISDIR(info.st_mode) else kind_of(info.st_mode)
        if not remove_entry(parent_fd, name, info, debris, path, kind=kind, what=what):
            raise ConfigError(
                f"{path!r} is {describe(info.st_mode)} that kvtier cannot remove; remove it "
                "or choose another 'root'",
                value=path,
            )
        info = None
    if info is None:
        try:
            os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
        except FileExistsError:
            pass  # another process made it meanwhile
        except OSError as exc:
            raise ConfigError(
                f"cannot create the page directory {path!r}: {exc.strerror}; "
                "choose a writable 'root'",
                value=path,
            ) from exc


def _private_dir_of_ours(
    parent_fd: int, name: str, path: str, info: os.stat_result, debris: Debris, role: str
) -> bool:
    """Whether ``info`` is a directory this user owns; a wrong mode is reset to 0700."""
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        return False
    mode = stat.S_IMODE(info.st_mode)
    if mode != DIR_MODE:
        try:
            os.chmod(name, DIR_MODE, dir_fd=parent_fd)
        except OSError as exc:
            what = f"{role} with mode {mode:o}"
            debris.found(
                "modes_fixed",
                path,
                what,
                f"could not reset it ({exc.strerror})",
                also="unremovable",
            )
        else:
            debris.found("modes_fixed", path, f"{role} with mode {mode:o}", "mode reset to 0700")
    return True


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` may still run (one we may not signal counts as alive): a
    temp file's writer that is gone left it behind."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _temp_writer(name: str) -> int | None:
    """The pid in a temp or probe file name (``.<pid>.<tid>.<n>.tmp``), or None."""
    if name.startswith(PROBE_PREFIX):
        digits = name[len(PROBE_PREFIX) :]
    elif name.startswith(".") and name.endswith(TEMP_SUFFIX):
        digits = name[1:].split(".", 1)[0]
    else:
        return None
    return int(digits) if digits.isdigit() else None


def _stale(pid: int, mtime: float, now: float, max_age: float) -> str | None:
    """Why a temp file of writer ``pid`` is stale, or None while its writer may be at work."""
    if pid == os.getpid() and mtime < STARTED - 1.0:
        return "left by an earlier process with this pid"
    if pid != os.getpid() and not pid_alive(pid):
        return f"left by writer pid {pid}, which is gone"
    if now - mtime >= max_age:
        return f"older than {max_age:.0f} s"
    return None


class _Sweep:
    """One walk over a store (see :func:`sweep_store`)."""

    def __init__(self, store: str, debris: Debris, max_age: float) -> None:
        self.store = store
        self.debris = debris
        self.max_age = max_age
        self.now = time.time()
        self.uid = os.geteuid()
        self.pages: list[tuple[str, int, float]] = []

    def walk(self) -> list[tuple[str, int, float]]:
        try:
            fd = os.open(self.store, _DIR_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            self._directory(fd, self.store, ())
        finally:
            os.close(fd)
        self.pages.sort(key=lambda item: item[2])
        return self.pages

    def _remove(self, fd: int, name: str, path: str, info: os.stat_result, where: str) -> None:
        what = f"{describe(info.st_mode)} where {where}"
        remove_entry(fd, name, info, self.debris, path, kind=kind_of(info.st_mode), what=what)

    def _directory(self, fd: int, path: str, shard: tuple[str, ...]) -> None:
        """Sweep the store (``shard`` empty), a first-level or a leaf shard directory."""
        try:
            with os.scandir(fd) as entries:
                children = list(entries)
        except OSError as exc:
            what = "a directory kvtier cannot list"
            self.debris.found("unremovable", path, what, f"skipped ({exc.strerror})")
            return
        for child in children:
            try:
                info = child.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            child_path = f"{path}/{child.name}"
            if len(shard) == 2:
                self._leaf_entry(fd, child.name, child_path, info, shard)
            elif (
                len(child.name) == 2 and _HEX.issuperset(child.name) and stat.S_ISDIR(info.st_mode)
            ):
                self._shard_dir(fd, child.name, child_path, info, shard)
            elif not shard and child.name.startswith(PROBE_PREFIX) and stat.S_ISREG(info.st_mode):
                self._temp(fd, child.name, child_path, info)
            else:
                self._remove(fd, child.name, child_path, info, "only shard directories belong")

    def _shard_dir(
        self, fd: int, name: str, path: str, info: os.stat_result, shard: tuple[str, ...]
    ) -> None:
        if info.st_uid != self.uid:
            what = f"a shard directory owned by uid {info.st_uid}"
            remove_entry(fd, name, info, self.debris, path, kind="foreign_owner", what=what)
            return
        _private_dir_of_ours(fd, name, path, info, self.debris, "a shard directory")
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            what = "a shard directory kvtier cannot open"
            self.debris.found("unremovable", path, what, f"skipped ({exc.strerror})")
            return
        try:
            self._directory(child, path, (*shard, name))
        finally:
            os.close(child)

    def _temp(self, fd: int, name: str, path: str, info: os.stat_result) -> None:
        pid = _temp_writer(name)
        if pid is None:
            self._remove(fd, name, path, info, "kvtier writes only pages and temp files")
            return
        if not stat.S_ISREG(info.st_mode):  # a writer only ever makes regular temp files
            self._remove(fd, name, path, info, "a temp file should be")
            return
        why = _stale(pid, info.st_mtime, self.now, self.max_age)
        if why is None:
            return  # a live writer's: it publishes or removes it itself
        what = f"a temp file {why}"
        remove_entry(fd, name, info, self.debris, path, kind="stale_temps", what=what)

    def _leaf_entry(
        self, fd: int, name: str, path: str, info: os.stat_result, shard: tuple[str, ...]
    ) -> None:
        if name.startswith("."):
            self._temp(fd, name, path, info)
            return
        key = name[: -len(PAGE_SUFFIX)] if name.endswith(PAGE_SUFFIX) else ""
        try:
            validate_key(key)
        except KvtierError:
            self._remove(fd, name, path, info, "kvtier writes only pages and temp files")
            return
        mode = info.st_mode
        if not stat.S_ISREG(mode):
            self._remove(fd, name, path, info, "a page should be")
        elif info.st_uid != self.uid:
            what = f"a page file owned by uid {info.st_uid}"
            remove_entry(fd, name, info, self.debris, path, kind="foreign_owner", what=what)
        elif shard_of(key) != shard:
            what = "a page file outside its key's shard directory (never read there)"
            remove_entry(fd, name, info, self.debris, path, kind="misplaced_pages", what=what)
        elif info.st_size == 0:
            what = "a zero-length page file"
            remove_entry(fd, name, info, self.debris, path, kind="empty_pages", what=what)
        else:
            if stat.S_IMODE(mode) != FILE_MODE:
                try:
                    os.chmod(name, FILE_MODE, dir_fd=fd)
                except OSError as exc:
                    what = f"a page file with mode {stat.S_IMODE(mode):o}"
                    action = f"left as it is ({exc.strerror})"
                    self.debris.found("modes_fixed", path, what, action, also="unremovable")
                else:
                    what = f"a page file with mode {stat.S_IMODE(mode):o}"
                    self.debris.found("modes_fixed", path, what, "mode reset to 0600")
            self.pages.append((key, info.st_size, info.st_mtime))


def sweep_store(
    store: str | os.PathLike[str], debris: Debris, *, max_age: float = STALE_AGE
) -> list[tuple[str, int, float]]:
    """Every published page under ``store`` as (key, size, mtime), oldest first.

    On the way, everything that is not a page, a shard directory or a live writer's temp
    file is dealt with: stale temp files (their writer is gone, or older than
    ``max_age`` s) and debris are removed, wrong modes reset; each is logged once and
    counted in ``debris``. Symlinks are removed, never followed.
    """
    return _Sweep(os.fspath(store), debris, max_age).walk()
