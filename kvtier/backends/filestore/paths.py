"""Where pages and temp files live in a store, and how a fresh temp file is created.

Every key passes :func:`check_key` before it becomes part of a path, so no key can name a
file outside the store or collide with a temp file (those start with ``.``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import overload

from kvtier.core.keys import MAX_KEY_LENGTH, validate_key, validate_keys

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "MAX_KEY_LENGTH",
    "PAGE_SUFFIX",
    "PROBE_PREFIX",
    "STARTED",
    "TEMP_SUFFIX",
    "check_key",
    "check_keys",
    "make_shard_dirs",
    "open_temp",
    "page_path",
    "page_path_str",
    "page_path_unchecked",
    "shard_of",
    "store_dir",
    "temp_flags",
    "temp_names",
    "temp_path",
    "temp_paths",
]

DIR_MODE = 0o700
FILE_MODE = 0o600
PAGE_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
PROBE_PREFIX = ".o_direct_probe."
#: When this process loaded the scheme: a temp file named with this process's pid but
#: older than this was left by an earlier process that had the same pid (containers).
STARTED = time.time()
_temp_seq: dict[int, int] = {}
_temp_lock = threading.Lock()


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid page key (so a safe file name), else raise.

    Delegates to :func:`kvtier.core.keys.validate_key` (raises
    :class:`~kvtier.core.errors.InvalidKeyError`): ``[a-z0-9_-]``, starting with a letter
    or digit, at most :data:`MAX_KEY_LENGTH` characters, so no key is a path, ``.``,
    ``..``, a hidden or temp file name.
    """
    return validate_key(key)


def check_keys(keys: Iterable[str]) -> None:
    """:func:`check_key` for a batch: raise on the first invalid key (one regex pass)."""
    validate_keys(list(keys))


def store_dir(root: str | os.PathLike[str], namespace: str) -> Path:
    """The directory holding one namespace's pages under ``root``."""
    check_key(namespace)
    return Path(root) / namespace


def page_path(store: Path, key: str) -> Path:
    """Where ``key``'s page lives: ``store/aa/bb/<key>.kv`` with ``aabb`` from blake2b."""
    return Path(page_path_str(os.fspath(store), key))


def page_path_str(store: str, key: str) -> str:
    """:func:`page_path` as a string, for the hot paths (a Path costs microseconds)."""
    check_key(key)
    return page_path_unchecked(store, key)


def page_path_unchecked(store: str, key: str) -> str:
    """:func:`page_path_str` of a key the caller has already checked (a batch's hot loop)."""
    shard = hashlib.blake2b(key.encode("ascii"), digest_size=2).hexdigest()
    return f"{store}/{shard[:2]}/{shard[2:]}/{key}{PAGE_SUFFIX}"


def shard_of(key: str) -> tuple[str, str]:
    """The two shard directory names of an already checked ``key``."""
    shard = hashlib.blake2b(key.encode("ascii"), digest_size=2).hexdigest()
    return shard[:2], shard[2:]


@overload
def temp_path(final: Path) -> Path: ...
@overload
def temp_path(final: str) -> str: ...


def temp_path(final: Path | str) -> Path | str:
    """A fresh temp file name next to ``final``, unique per process, thread and call.

    Given a string, it returns one (the put path's hot loop avoids ``Path`` objects,
    which cost microseconds each); given a ``Path``, a ``Path``.
    """
    (name,) = temp_paths([os.fspath(final)])
    return Path(name) if isinstance(final, Path) else name


def temp_paths(finals: list[str]) -> list[str]:
    """:func:`temp_path` for a batch of string paths (one lock, one sequence range)."""
    stem, first = temp_names(len(finals))
    return [
        f"{os.path.dirname(final)}/{stem}{seq}{TEMP_SUFFIX}"
        for seq, final in enumerate(finals, first)
    ]


def temp_names(count: int) -> tuple[str, int]:
    """Reserve ``count`` temp names for this thread: their stem and first sequence number.

    Temp file ``i`` of the batch is ``<its page's directory>/<stem><first + i>.tmp``;
    the stem (``.<pid>.<tid>.``) is what the start-up sweep reads a temp file's owner from.
    """
    tid = threading.get_native_id()
    with _temp_lock:
        first = _temp_seq.get(tid, 0) + 1
        _temp_seq[tid] = first + count - 1
    return f".{os.getpid()}.{tid}.", first


def temp_flags(*, o_direct: bool = False) -> int:
    """The open(2) flags of a fresh temp file: write-only, created here, never shared."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    return flags | os.O_DIRECT if o_direct else flags


def make_shard_dirs(final: Path | str) -> None:
    """Create the two shard directories above ``final`` (0700) where they are missing."""
    leaf = os.path.dirname(os.fspath(final))
    for directory in (os.path.dirname(leaf), leaf):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, DIR_MODE)


@overload
def open_temp(final: Path, *, o_direct: bool = False) -> tuple[int, Path]: ...
@overload
def open_temp(final: str, *, o_direct: bool = False) -> tuple[int, str]: ...


def open_temp(final: Path | str, *, o_direct: bool = False) -> tuple[int, Path | str]:
    """Create a fresh 0600 temp file next to ``final`` (making shard dirs 0700 on demand).

    The temp name has ``final``'s type (a string on the hot path, see :func:`temp_path`).
    """
    flags = temp_flags(o_direct=o_direct)
    tmp = temp_path(final)
    try:
        return os.open(tmp, flags, FILE_MODE), tmp
    except FileNotFoundError:
        make_shard_dirs(final)
        return os.open(tmp, flags, FILE_MODE), tmp
