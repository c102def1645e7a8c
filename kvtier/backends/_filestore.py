"""The on-disk scheme shared by the file and io_uring backends: paths, publishing, index.

Layout of a store (``store_dir(root, namespace)``)::

    <root>/                          created 0700; refused if owned by another user or
                                     readable / writable by group or others
      <namespace>/                   one store per BackendContext.namespace (``clear`` scope)
        <aa>/<bb>/<key>.kv           one file per page, 0600; ``aa``/``bb`` are the first
                                     four hex digits of blake2b(key), 65536 leaf dirs at most
        <aa>/<bb>/.<pid>.<tid>.<n>.tmp   a page being written by process ``pid``, thread
                                     ``tid``; never read, published by rename(2)

A page file holds the concatenation of the page's regions (envelope header, then payload)
and nothing else, so its size is the page's stored size and a reader needs no framing.

Publishing is ``write temp -> (fsync) -> rename(temp, final)`` in the same directory, so a
reader that opens ``<key>.kv`` sees a whole old page, a whole new page, or no file: never a
torn one, even when the writer is killed mid-write (its temp file is left behind and
removed at the next start-up) or the disk fills (the writer removes its temp file).
Concurrent puts of one key from several threads or processes each write their own temp
file; the last rename wins and the page is whole either way.

Durability modes: ``none`` (no fsync: the page survives a process crash, not a power
cut), ``page`` (fsync each page file before its rename and its directory after), ``batch``
(fsync each page file, then rename the batch and fsync each touched directory once).

The index (key -> size, in LRU order) is rebuilt at start-up by scanning the store, with
modification times giving the initial LRU order; afterwards it is maintained in memory, so
``exists`` costs a dict lookup. It serves LRU eviction under ``capacity_bytes`` and the
minimum-free-space guard (``os.statvfs``): before a page is written, least recently used
pages are evicted until both hold, or the put fails. Several processes may share a store;
each keeps its own index. A key missing from this process's index is looked up on disk
(one ``stat``) and adopted when another process wrote it; a key another process removed is
dropped from the index when a read finds no file. Capacity is therefore enforced per
process over the pages it knows of; the free-space guard sees the whole filesystem.

A backend built on this scheme (file, io_uring) does, per page::

    final = page_path(store, key)                 # validates the key
    reason = index.reserve(key, nbytes)           # evicts LRU pages; None when it fits
    fd, tmp = open_temp(final, o_direct=...)      # 0600, O_EXCL, shard dirs made 0700
    ...write every region at its offset...; fsync(fd) unless durability == "none"
    publish(tmp, final, sync_dir=durability == "page"); index.commit(key, nbytes)
    # on any failure: unlink_quietly([tmp]); index.release(nbytes); report False

and at start-up ``store = prepare_store(root, namespace)`` (0700 dirs, stale temps
removed), then ``index.rebuild()``.

Keys reach the filesystem only after :func:`check_key` (the key module's
``validate_key``: lowercase ASCII letters, digits, ``_`` and ``-``, starting with a letter
or digit, at most 160 characters), so no key can name a path outside the store or collide
with a temp file (those start with ``.``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field

from kvtier.core.errors import ConfigError, InvalidFieldError, InvalidKeyError
from kvtier.core.geometry import KVGeometry
from kvtier.core.keys import MAX_KEY_LENGTH, validate_key
from kvtier.core.layout import (
    ALIGNMENT,
    Layout,
    block_aligned_layouts,
    extent_bytes,
    extents_block_aligned,
)
from kvtier.core.storage import PageBuffers

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "MAX_KEY_LENGTH",
    "PAGE_SUFFIX",
    "Durability",
    "FileIndex",
    "FileStoreOptions",
    "advance_views",
    "check_direct_plan",
    "check_key",
    "default_root",
    "direct_aligned",
    "ensure_private_dir",
    "fsync_dir",
    "is_no_space",
    "make_shard_dirs",
    "open_temp",
    "page_path",
    "page_path_str",
    "prepare_store",
    "probe_o_direct",
    "publish",
    "pwritev_all",
    "remove_stale_temps",
    "scan_pages",
    "store_dir",
    "temp_flags",
    "temp_path",
    "unlink_quietly",
]

log = logging.getLogger(__name__)

Durability = Literal["none", "page", "batch"]
DIR_MODE = 0o700
FILE_MODE = 0o600
PAGE_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
_temp_seq: dict[int, int] = {}
_temp_lock = threading.Lock()
#: Linux accepts at most this many regions per preadv/pwritev call.
IOV_MAX = 1024


def default_root() -> Path:
    """``<tempdir>/kvtier-<uid>/file``: private to this user, created 0700."""
    return Path(tempfile.gettempdir()) / f"kvtier-{os.geteuid()}" / "file"


class FileStoreOptions(BaseModel):
    """Options every backend on this on-disk scheme takes (``file``, ``uring``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: Path = Field(
        default_factory=default_root,
        description="Directory holding the pages (created 0700; an existing one must be "
        "private to this user). Default: <tempdir>/kvtier-<uid>/file.",
    )
    fsync: Durability = Field(
        default="none",
        description="Durability: 'none' survives a process crash, not a power cut; "
        "'page' fsyncs each page and its directory; 'batch' fsyncs each page and each "
        "touched directory once per batch.",
    )
    o_direct: bool = Field(
        default=False,
        description="Bypass the page cache (O_DIRECT). Needs extents that are multiples of "
        "4096 bytes (checked at config time) and a filesystem that supports it (checked "
        "at start-up).",
    )
    capacity_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="Most bytes of pages kept; least recently used pages are evicted "
        "beyond it. None: bounded only by min_free_bytes. An integer or '64GiB'.",
    )
    min_free_bytes: ByteSize = Field(
        default=ByteSize(1 << 30),
        ge=0,
        description="Free space always left on the filesystem; pages are evicted (or the "
        "put fails) rather than going below it.",
    )
    check_disk_on_miss: bool = Field(
        default=True,
        description="On an index miss, exists() stats the file once, so pages written by "
        "other processes sharing the root are found.",
    )


def check_direct_plan(config: Any, context: Any, field: str) -> None:
    """Refuse O_DIRECT at config time when the page's extents cannot be block aligned.

    ``field`` names the option in the error (``file.o_direct``, ``uring.o_direct``); the
    layouts suggested instead are those of the geometry's attention kind that align.
    """
    if not getattr(config, "o_direct", False):
        return
    geometry: KVGeometry = context.geometry
    layout = Layout(context.layout)
    if extents_block_aligned(geometry, layout):
        return
    working = [other.value for other in block_aligned_layouts(geometry) if other is not layout]
    hint = (
        f"use layout {' or '.join(repr(w) for w in working)}, or set o_direct to false"
        if working
        else "set o_direct to false (no layout aligns this geometry)"
    )
    raise InvalidFieldError(
        field,
        f"O_DIRECT needs every extent to be a multiple of {ALIGNMENT} bytes, but "
        f"layout {layout.value!r} cuts a page of {geometry.describe()} into extents of "
        f"{extent_bytes(geometry, layout)} bytes; {hint}",
        value=True,
    )


def direct_aligned(page: PageBuffers) -> bool:
    """Whether every extent of ``page`` may be transferred with O_DIRECT."""
    return all(e.ptr % ALIGNMENT == 0 and e.length % ALIGNMENT == 0 for e in page)


def probe_o_direct(store: Path, root: Path) -> None:
    """Refuse at start-up, with a ConfigError naming ``root``, a store that rejects O_DIRECT."""
    probe = store / f".o_direct_probe.{os.getpid()}"
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


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid page key (so a safe file name), else raise.

    Delegates to :func:`kvtier.core.keys.validate_key` (raises
    :class:`~kvtier.core.errors.InvalidKeyError`): ``[a-z0-9_-]``, starting with a letter
    or digit, at most :data:`MAX_KEY_LENGTH` characters, so no key is a path, ``.``,
    ``..``, a hidden or temp file name.
    """
    return validate_key(key)


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
    shard = hashlib.blake2b(key.encode("ascii"), digest_size=2).hexdigest()
    return f"{store}/{shard[:2]}/{shard[2:]}/{key}{PAGE_SUFFIX}"


def temp_path(final: Path) -> Path:
    """A fresh temp file name next to ``final``, unique per process, thread and call."""
    tid = threading.get_native_id()
    with _temp_lock:
        seq = _temp_seq[tid] = _temp_seq.get(tid, 0) + 1
    return final.parent / f".{os.getpid()}.{tid}.{seq}{TEMP_SUFFIX}"


def temp_flags(*, o_direct: bool = False) -> int:
    """The open(2) flags of a fresh temp file: write-only, created here, never shared."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    return flags | os.O_DIRECT if o_direct else flags


def make_shard_dirs(final: Path) -> None:
    """Create the two shard directories above ``final`` (0700) where they are missing."""
    for directory in (final.parent.parent, final.parent):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, DIR_MODE)


def open_temp(final: Path, *, o_direct: bool = False) -> tuple[int, Path]:
    """Create a fresh 0600 temp file next to ``final`` (making shard dirs 0700 on demand)."""
    flags = temp_flags(o_direct=o_direct)
    tmp = temp_path(final)
    try:
        return os.open(tmp, flags, FILE_MODE), tmp
    except FileNotFoundError:
        make_shard_dirs(final)
        return os.open(tmp, flags, FILE_MODE), tmp


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


def fsync_dir(directory: Path) -> None:
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


def _exchange(tmp: Path, final: Path) -> bool:
    """Swap ``tmp`` and ``final`` atomically (renameat2 RENAME_EXCHANGE); False if unusable."""
    global _renameat2
    if _renameat2 is None:
        return False
    if (
        _renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE)
        == 0
    ):
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        _renameat2 = None  # this kernel or filesystem has no exchange: plain renames from now on
    elif err != errno.ENOENT:  # ENOENT: no page yet under ``final``, a plain rename will do
        raise OSError(err, os.strerror(err), str(final))
    return False


def publish(tmp: Path, final: Path, *, sync_dir: bool = False) -> None:
    """Atomically replace ``final`` with the fully written ``tmp`` (same directory).

    Where a page already exists, the two names are exchanged (``renameat2`` with
    ``RENAME_EXCHANGE``) and the old page, now under the temp name, is unlinked: readers
    still see the whole old or the whole new page, and ext4 does not start writeback of
    the new page as it does for a rename over an existing file (``auto_da_alloc``), which
    made overwrites several times slower. Elsewhere it is a plain ``rename``.
    """
    if _exchange(tmp, final):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    else:
        os.replace(tmp, final)
    if sync_dir:
        fsync_dir(final.parent)


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


class FileIndex:
    """The in-memory index of one store: key -> size in LRU order, capacity and free space.

    Thread-safe. ``reserve`` makes room before a write (evicting least recently used
    pages), ``commit`` records a published page, ``release`` undoes a reservation whose
    write failed.
    """

    def __init__(
        self,
        store: Path,
        *,
        capacity_bytes: int | None = None,
        min_free_bytes: int = 0,
        check_disk_on_miss: bool = True,
    ) -> None:
        self.store = store
        self._store_str = os.fspath(store)
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = min_free_bytes
        self.check_disk_on_miss = check_disk_on_miss
        self._lock = threading.Lock()
        self._sizes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._bytes = 0
        self._pending = 0
        self.evictions = 0
        self.evicted_bytes = 0

    # --- start-up ----------------------------------------------------------------------

    def rebuild(self) -> int:
        """Replace the index with a scan of the store; return the number of pages found."""
        pages = scan_pages(self.store)
        with self._lock:
            self._sizes.clear()
            for key, size, _mtime in pages:
                self._sizes[key] = size
            self._bytes = sum(self._sizes.values())
        return len(pages)

    # --- lookups -----------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the pages in this index."""
        with self._lock:
            return self._bytes

    def stats(self) -> dict[str, int | float]:
        """The index's part of a backend's ``stats()``: pages, bytes and evictions."""
        return {
            "pages": len(self),
            "bytes": self.stored_bytes,
            "evictions": self.evictions,
            "evicted_bytes": self.evicted_bytes,
        }

    def keys(self) -> list[str]:
        """The indexed keys, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored: the index, then (optionally) one stat on a miss."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`contains` for a batch: one lock for the index lookups, stats for misses.

        A key found in the index was checked when it got there; every other key is checked
        (and a bad one raises) before its file is looked up.
        """
        with self._lock:
            sizes = self._sizes
            found = [key in sizes for key in keys]
        for i, hit in enumerate(found):
            if not hit:
                if self.check_disk_on_miss:
                    found[i] = self.adopt(keys[i])
                else:
                    check_key(keys[i])
        return found

    def adopt(self, key: str) -> bool:
        """Add ``key`` to the index if its file exists (another process wrote it)."""
        try:
            info = os.stat(page_path_str(self._store_str, key), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not stat.S_ISREG(info.st_mode):
            return False
        with self._lock:
            if key not in self._sizes:
                self._sizes[key] = info.st_size
                self._bytes += info.st_size
        return True

    def touch(self, key: str, size: int | None = None) -> None:
        """Mark ``key`` as just used (adding it with ``size`` if it was not indexed)."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
            elif size is not None:
                self._sizes[key] = size
                self._bytes += size

    def forget(self, key: str) -> int | None:
        """Drop ``key`` from the index (its file is gone); return its size if it was there."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._bytes -= size
            return size

    # --- writes ------------------------------------------------------------------------

    def _free_bytes(self) -> int:
        info = os.statvfs(self.store)
        return info.f_bavail * info.f_frsize

    def reserve(self, key: str, nbytes: int) -> str | None:
        """Make room for a page of ``nbytes``; None when it fits, else why it cannot."""
        with self._lock:
            if self.capacity_bytes is not None:
                if nbytes > self.capacity_bytes:
                    return "page_larger_than_capacity"
                replaced = self._sizes.get(key, 0)
                while self._bytes - replaced + self._pending + nbytes > self.capacity_bytes:
                    if not self._evict_one_locked(protect=key):
                        return "capacity"
                    replaced = self._sizes.get(key, 0)
            if self.min_free_bytes > 0:
                free = self._free_bytes()
                while free - nbytes < self.min_free_bytes:
                    freed = self._evict_one_locked(protect=key)
                    if not freed:
                        return "min_free_space"
                    free += freed
            self._pending += nbytes
        return None

    def release(self, nbytes: int) -> None:
        """Undo a reservation whose write failed."""
        with self._lock:
            self._pending -= nbytes

    def commit(self, key: str, nbytes: int) -> None:
        """Record a published page (replacing any older size) as most recently used."""
        with self._lock:
            self._pending -= nbytes
            old = self._sizes.pop(key, None)
            if old is not None:
                self._bytes -= old
            self._sizes[key] = nbytes
            self._bytes += nbytes

    def _evict_one_locked(self, *, protect: str) -> int:
        """Unlink the least recently used page other than ``protect``; bytes freed or 0."""
        for victim in self._sizes:
            if victim != protect:
                break
        else:
            return 0
        size = self._sizes.pop(victim)
        self._bytes -= size
        try:
            os.unlink(page_path(self.store, victim))
        except FileNotFoundError:
            pass  # another process evicted or deleted it; the bytes are free either way
        except OSError as exc:
            log.warning("could not evict page %s: %s", victim, exc)
        self.evictions += 1
        self.evicted_bytes += size
        return max(size, 1)

    # --- removal -----------------------------------------------------------------------

    def remove(self, key: str) -> bool:
        """Unlink ``key``'s page and drop it from the index; True if a file was removed."""
        self.forget(key)
        try:
            os.unlink(page_path(self.store, key))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def remove_all(self) -> int:
        """Unlink every page in the store (indexed or not); return how many were removed."""
        removed = 0
        with self._lock:
            self._sizes.clear()
            self._bytes = 0
        for key, _size, _mtime in scan_pages(self.store):
            try:
                os.unlink(page_path(self.store, key))
                removed += 1
            except FileNotFoundError:
                pass
        return removed


def is_no_space(exc: OSError) -> bool:
    """Whether ``exc`` means the filesystem or quota is full."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def unlink_quietly(paths: Iterable[Path]) -> None:
    """Remove temp files after a failed write; missing ones are fine."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
