"""Opening a store at start-up: private directories, stale temp files, the page scan."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from kvtier.backends.filestore.paths import (
    DIR_MODE,
    PAGE_SUFFIX,
    TEMP_SUFFIX,
    check_key,
    store_dir,
)
from kvtier.core.errors import ConfigError, InvalidKeyError

__all__ = ["ensure_private_dir", "prepare_store", "remove_stale_temps", "scan_pages"]


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


def prepare_store(root: str | os.PathLike[str], namespace: str) -> Path:
    """Create (or check) ``root`` and its namespace store, both 0700; clean stale temps."""
    ensure_private_dir(Path(root))
    store = store_dir(root, namespace)
    ensure_private_dir(store)
    remove_stale_temps(store)
    return store


def _leaf_dirs(store: Path) -> Iterator[Path]:
    try:
        level1 = [e for e in os.scandir(store) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for first in level1:
        if len(first.name) != 2:
            continue
        try:
            level2 = list(os.scandir(first.path))
        except FileNotFoundError:
            continue
        for second in level2:
            if len(second.name) == 2 and second.is_dir(follow_symlinks=False):
                yield Path(second.path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(store: Path, *, max_age: float = 600.0) -> int:
    """Remove temp files of dead writers (or older than ``max_age`` s); return the count."""
    removed = 0
    now = time.time()
    for leaf in _leaf_dirs(store):
        for entry in os.scandir(leaf):
            name = entry.name
            if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
                continue
            parts = name.split(".")
            try:
                pid = int(parts[1])
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except (ValueError, IndexError, FileNotFoundError):
                continue
            if pid == os.getpid() or (_pid_alive(pid) and age < max_age):
                continue
            try:
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def scan_pages(store: Path) -> list[tuple[str, int, float]]:
    """Every published page under ``store`` as (key, size, mtime), oldest first."""
    found: list[tuple[str, int, float]] = []
    for leaf in _leaf_dirs(store):
        for entry in os.scandir(leaf):
            name = entry.name
            if name.startswith(".") or not name.endswith(PAGE_SUFFIX):
                continue
            key = name[: -len(PAGE_SUFFIX)]
            try:
                check_key(key)
                info = entry.stat(follow_symlinks=False)
            except (InvalidKeyError, FileNotFoundError):
                continue
            if stat.S_ISREG(info.st_mode):
                found.append((key, info.st_size, info.st_mtime))
    found.sort(key=lambda item: item[2])
    return found
