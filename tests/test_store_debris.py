"""Debris in a store's root: the file and io_uring backends open, clean up and keep serving.

Anything that is not a page, a shard directory or a live writer's temp file (directories,
symlinks in and out of the root, dangling or looping, FIFOs, sockets, foreign files, wrong
modes, empty or misplaced pages, stale temp files and directories) is removed or repaired,
logged once and counted in ``stats()["debris_*"]``; no symlink is ever followed out of the
root. The last test plants a seeded random mix of all of it next to valid pages.

Each case runs every loop that writes and publishes pages: the backends' own (raw pages:
the Python loop, the ring, the Python steps of the publish protocol) and, with envelopes
as ``PageStore`` hands them over, the compiled loop (its C steps of the protocol,
``_pageio_src/publish.c``, and the Python ones it leaves debris to).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import random
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import compiled
from kvtier.backends.filestore import debris as fs_debris
from kvtier.backends.filestore import paths as fs_paths
from kvtier.backends.filestore import publish as fs_publish
from kvtier.backends.filestore.base import FileStoreBackend
from kvtier.backends.filestore.debris import KINDS
from kvtier.backends.uring import URING_SPEC, UringConfig
from kvtier.core.envelope import ENVELOPE_BYTES, MAGIC, EnvelopeFormat
from kvtier.core.extents import Extent, extent_of_view
from kvtier.core.storage import StorageBackend
from kvtier.testing import require

#: Raw puts (the backend's own loop, the publish steps in C where built), the compiled
#: loop (envelopes), and "-python": the Python fallback, every step in Python.
BACKENDS = ["file", "uring", "file-compiled", "uring-compiled", "file-python", "uring-python"]


def _require_uring() -> None:
    require("uring", URING_SPEC.unavailable_reason())


class Enveloped(StorageBackend):
    """A file backend driven as ``PageStore`` drives it: each page behind a header slot, its
    envelope written and checked in the compiled loop (which then publishes it in C), or
    in Python for a page the backend leaves to its own loop (``before_write``,
    ``on_filled``).

    ``put``/``get`` take and fill the bare payloads, as on the backend itself; a page is
    read back only when its envelope checks out. The rest is the backend's.
    """

    def __init__(self, backend: FileStoreBackend[Any]) -> None:
        assert backend.checks_envelopes
        self.backend = backend
        self._format = EnvelopeFormat("debris", "page_first")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    @staticmethod
    def _slotted(pages: Sequence[Sequence[Extent]]) -> list[list[Extent]]:
        """Each payload behind a fresh header slot."""
        return [[extent_of_view(memoryview(bytearray(ENVELOPE_BYTES))), *page] for page in pages]

    def put(self, keys: Sequence[str], pages: Sequence[Sequence[Extent]]) -> list[bool]:
        slotted = self._slotted(pages)

        def write(i: int) -> None:  # a page the compiled loop leaves to the backend's own
            slot, *payload = slotted[i]
            self._format.write(slot.view, keys[i], [extent.view for extent in payload])

        envelope = self._format.batch(keys)
        return self.backend.put_with(keys, slotted, write, envelope=envelope)

    def get(self, keys: Sequence[str], pages: Sequence[Sequence[Extent]]) -> list[bool]:
        slotted = self._slotted(pages)
        envelope = self._format.batch(keys)
        valid = envelope.valid  # what the compiled loop found valid, and what Python does

        def check(i: int) -> None:
            slot, *payload = slotted[i]
            if self._format.verify(slot.view, keys[i], [e.view for e in payload]) is None:
                valid.append(i)

        got = self.backend.get_with(keys, slotted, check, envelope=envelope)
        return [ok and i in valid for i, ok in enumerate(got)]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.backend.exists(keys)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self.backend.delete(keys)

    def clear(self) -> None:
        self.backend.clear()

    def stats(self) -> dict[str, Any]:
        return self.backend.stats()

    def close(self) -> None:
        self.backend.close()


def stored(path: Path) -> bytes:
    """The payload a page file holds: its bytes after the envelope slot, if it has one."""
    data = path.read_bytes()
    return data[ENVELOPE_BYTES:] if data.startswith(MAGIC) else data


Opener = Callable[..., StorageBackend]


def _opener(kind: str, root: Path) -> Opener:
    def build(**options: Any) -> StorageBackend:
        options.setdefault("min_free_bytes", 0)
        if kind.endswith("-python"):  # (compiled_io off: the publish steps in Python too)
            options.setdefault("compiled_io", False)
        backend: FileStoreBackend[Any]
        if kind.startswith("file"):
            backend = FileBackend(FileConfig(root=root, **options))
        else:
            from kvtier.backends.uring.backend import UringBackend

            backend = UringBackend(UringConfig(root=root, **options))
        return Enveloped(backend) if kind.endswith("-compiled") else backend

    return build


@pytest.fixture(params=BACKENDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    if kind.startswith("uring"):
        _require_uring()
    if kind.endswith("-compiled"):
        require("compiled", None if compiled.available() else compiled.MISSING)
    return kind


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def open_store(backend_kind: str, root: Path) -> Iterator[Opener]:
    """Build backends of the parametrized kind on ``root``; closes them afterwards."""
    built: list[StorageBackend] = []
    build = _opener(backend_kind, root)

    def tracked(**options: Any) -> StorageBackend:
        backend = build(**options)
        built.append(backend)
        return backend

    yield tracked
    for backend in built:
        backend.close()


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A sentinel file and directory outside the root, which symlinks will point to."""
    out = tmp_path / "outside"
    out.mkdir()
    sentinel = out / "sentinel.bin"
    sentinel.write_bytes(b"S" * 8192)
    (out / "dir").mkdir()
    (out / "dir" / "keep.txt").write_bytes(b"keep me")
    snapshot = _snapshot(out)
    yield {"dir": out, "sentinel": sentinel, "target_dir": out / "dir", "snapshot": snapshot}
    assert _snapshot(out) == snapshot, "something outside the root was touched"


def _snapshot(directory: Path) -> dict[str, tuple[int, int, float, bytes]]:
    """Every entry under ``directory``: mode, size, mtime and content of files."""
    found: dict[str, tuple[int, int, float, bytes]] = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        content = path.read_bytes() if stat.S_ISREG(info.st_mode) else b""
        found[str(path)] = (info.st_mode, info.st_size, info.st_mtime, content)
    return found


def page(data: bytes) -> list[Extent]:
    return [extent_of_view(memoryview(bytearray(data)))]


def blank(size: int) -> list[Extent]:
    return page(bytes(size))


def joined(pg: list[Extent]) -> bytes:
    return b"".join(bytes(e.view) for e in pg)


def store_of(root: Path) -> Path:
    return root / "default"


def page_file(root: Path, key: str) -> Path:
    return fs_paths.page_path(store_of(root), key)


def mkdirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each 0700 as kvtier makes them."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir(mode=0o700)


def shard_dirs(root: Path, key: str) -> Path:
    """``key``'s page path, its shard directories created."""
    final = page_file(root, key)
    mkdirs(final.parent)
    return final


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def debris_counts(backend: StorageBackend) -> dict[str, int]:
    return {k: int(v) for k, v in backend.stats().items() if k.startswith("debris_")}


def expect(**counts: int) -> dict[str, int]:
    """Every debris counter: the given ones, zero for the rest."""
    return {f"debris_{kind}": counts.get(kind, 0) for kind in KINDS}


def assert_clean(store: Path) -> None:
    """Only shard dirs (0700) and page files (0600) of the right shard are left."""
    for dirpath, dirnames, filenames in os.walk(store, followlinks=False):
        depth = len(Path(dirpath).relative_to(store).parts)
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            if depth < 2:
                assert stat.S_ISDIR(info.st_mode) and len(name) == 2, path
                assert stat.S_IMODE(info.st_mode) == 0o700, path
            else:
                assert stat.S_ISREG(info.st_mode) and name.endswith(".kv"), path
                assert stat.S_IMODE(info.st_mode) == 0o600, path
                assert fs_paths.page_path(store, name[:-3]) == path


# --- the cases of the report, one by one -----------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("fsync", ["none", "batch"])
def test_a_put_over_a_directory_publishes_reports_true_and_leaves_nothing(
    open_store: Opener, root: Path, fsync: str, batch: int
) -> None:
    """One page inline, or a batch through the ring (uring) or the thread pool (file)."""
    backend = open_store(fsync=fsync)
    keys = ["k", *(f"other{i}" for i in range(batch - 1))]
    assert backend.put(keys, [page(b"1" * 5000)] * batch) == [True] * batch
    final = page_file(root, "k")
    final.unlink()
    final.mkdir()
    (final / "inner").mkdir()
    (final / "inner" / "file").write_bytes(b"x")
    assert backend.put(keys, [page(b"2" * 5000)] * batch) == [True] * batch
    out = blank(5000)
    assert backend.get(["k"], [out]) == [True] and joined(out) == b"2" * 5000
    assert list(store_of(root).rglob(".*")) == []  # no temp debris
    assert final.is_file()
    assert debris_counts(backend) == expect(dirs=1)
    backend.close()
    again = open_store()  # and the store opens again, clean
    assert debris_counts(again) == expect()
    assert again.get(["k"], [out]) == [True] and joined(out) == b"2" * 5000


def test_a_put_over_a_new_key_held_by_a_directory_succeeds(open_store: Opener, root: Path) -> None:
    open_store().close()
    shard_dirs(root, "held").mkdir()
    backend = open_store()
    assert debris_counts(backend) == expect(dirs=1)  # removed at start-up
    page_file(root, "held").mkdir()  # ... and again while running
    assert backend.exists(["held"]) == [False]
    assert backend.put(["held"], [page(b"h" * 3000)]) == [True]
    out = blank(3000)
    assert backend.get(["held"], [out]) == [True] and joined(out) == b"h" * 3000
    assert debris_counts(backend) == expect(dirs=2)
    assert_clean(store_of(root))


def test_a_stale_temp_directory_does_not_stop_the_store_from_opening(
    open_store: Opener, root: Path
) -> None:
    open_store().put(["k"], [page(b"k" * 4000)])
    leaf = page_file(root, "k").parent
    temp_dir = leaf / f".{dead_pid()}.1.1.tmp"
    temp_dir.mkdir()
    (temp_dir / "junk").write_bytes(b"j")
    backend = open_store()
    assert not temp_dir.exists()
    assert debris_counts(backend) == expect(dirs=1)
    out = blank(4000)
    assert backend.get(["k"], [out]) == [True] and joined(out) == b"k" * 4000


def test_a_temp_file_of_an_earlier_process_with_this_pid_is_stale(
    open_store: Opener, root: Path
) -> None:
    """In a container every run may get the same pid: its old temp files must go too."""
    open_store().put(["k"], [page(b"k" * 4000)])
    leaf = page_file(root, "k").parent
    old = leaf / f".{os.getpid()}.{threading.get_native_id()}.1.tmp"
    old.write_bytes(b"half")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    backend = open_store()
    assert not old.exists()
    assert debris_counts(backend) == expect(stale_temps=1)
    assert backend.put(["k"], [page(b"n" * 4000)]) == [True]


def test_a_get_never_reads_through_a_symlink(
    open_store: Opener, root: Path, outside: dict[str, Any]
) -> None:
    backend = open_store()
    final = shard_dirs(root, "link")
    final.symlink_to(outside["sentinel"])  # the sentinel has exactly the page's size
    out = blank(8192)
    assert backend.get(["link"], [out]) == [False]
    assert joined(out) == bytes(8192)
    assert not final.is_symlink() and outside["sentinel"].exists()
    assert debris_counts(backend) == expect(symlinks=1)
    assert backend.put(["link"], [page(b"p" * 8192)]) == [True]
    assert backend.get(["link"], [out]) == [True] and joined(out) == b"p" * 8192
    final.unlink()
    final.symlink_to(outside["sentinel"])  # a symlink under a page's name, met by a put...
    assert backend.put(["link"], [page(b"q" * 8192)]) == [True]
    assert stored(final) == b"q" * 8192
    final.unlink()
    final.symlink_to(outside["sentinel"])  # ... and by a delete
    assert backend.delete(["link"]) == [False]
    assert not os.path.lexists(final)
    assert outside["sentinel"].read_bytes() == b"S" * 8192
    assert debris_counts(backend) == expect(symlinks=3)


def test_a_get_of_a_fifo_does_not_hang(open_store: Opener, root: Path) -> None:
    backend = open_store()
    final = shard_dirs(root, "pipe")
    os.mkfifo(final, 0o600)
    results: list[list[bool]] = []
    reader = threading.Thread(target=lambda: results.append(backend.get(["pipe"], [blank(64)])))
    reader.start()
    reader.join(10)
    if reader.is_alive():  # today's code blocks in open(2): unblock it, then fail
        os.close(os.open(final, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("a get of a FIFO blocked")
    assert results == [[False]]
    assert not final.exists() and debris_counts(backend) == expect(special=1)


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("blocker", ["file", "dangling symlink", "symlink loop"])
def test_a_shard_directory_held_by_debris_is_made_again_by_a_put(
    open_store: Opener, root: Path, blocker: str, level: int
) -> None:
    backend = open_store()
    shard = page_file(root, "sharded").parent
    if level == 1:
        shard = shard.parent
    mkdirs(shard.parent)
    if blocker == "file":
        shard.write_bytes(b"not a directory")
    else:
        shard.symlink_to("/nonexistent/x" if blocker == "dangling symlink" else shard)
    keys = ["sharded", "another"]  # a batch: the uring backend creates temps through the ring
    assert backend.put(keys, [page(b"s" * 2000), page(b"a" * 2000)]) == [True, True]
    out = blank(2000)
    assert backend.get(["sharded"], [out]) == [True] and joined(out) == b"s" * 2000
    kind = "foreign_files" if blocker == "file" else "symlinks"
    assert debris_counts(backend) == expect(**{kind: 1})
    assert_clean(store_of(root))


def test_a_symlinked_shard_directory_is_removed_not_written_through(
    open_store: Opener, root: Path, outside: dict[str, Any]
) -> None:
    open_store().close()
    final = page_file(root, "escape")
    final.parent.parent.symlink_to(outside["target_dir"])
    backend = open_store()
    assert not final.parent.parent.is_symlink()
    assert backend.put(["escape"], [page(b"e" * 1000)]) == [True]
    assert stored(final) == b"e" * 1000
    assert debris_counts(backend) == expect(symlinks=1)


def test_delete_and_clear_over_debris(open_store: Opener, root: Path) -> None:
    backend = open_store()
    assert backend.put(["a", "b"], [page(b"a" * 100), page(b"b" * 100)]) == [True, True]
    page_file(root, "a").unlink()
    page_file(root, "a").mkdir()
    assert backend.delete(["a", "b"]) == [False, True]
    assert not page_file(root, "a").exists()
    assert backend.put(["c"], [page(b"c" * 100)]) == [True]
    os.mkfifo(page_file(root, "c").parent / "stray", 0o600)
    backend.clear()
    assert list(store_of(root).rglob("*.kv")) == []
    assert debris_counts(backend) == expect(dirs=1, special=1)
    assert_clean(store_of(root))


def test_the_namespace_directory_itself_may_be_debris(open_store: Opener, root: Path) -> None:
    root.mkdir(mode=0o700)
    store_of(root).write_bytes(b"a file where the store should be")
    backend = open_store()
    assert store_of(root).is_dir()
    assert backend.put(["k"], [page(b"k" * 10)]) == [True]
    assert debris_counts(backend) == expect(foreign_files=1)


def test_wrong_modes_are_reset_and_the_pages_kept(open_store: Opener, root: Path) -> None:
    writer = open_store()
    assert writer.put(["m"], [page(b"m" * 700)]) == [True]
    writer.close()
    final = page_file(root, "m")
    final.chmod(0o644)
    final.parent.chmod(0o755)
    backend = open_store()
    assert stat.S_IMODE(final.stat().st_mode) == 0o600
    assert stat.S_IMODE(final.parent.stat().st_mode) == 0o700
    assert debris_counts(backend) == expect(modes_fixed=2)
    out = blank(700)
    assert backend.get(["m"], [out]) == [True] and joined(out) == b"m" * 700


def test_empty_and_misplaced_pages_are_removed(open_store: Opener, root: Path) -> None:
    shard_dirs(root, "empty").write_bytes(b"")
    wrong_leaf = store_of(root) / "00" / "00"
    mkdirs(wrong_leaf)
    key = next(f"m{i}" for i in range(1000) if fs_paths.shard_of(f"m{i}") != ("00", "00"))
    (wrong_leaf / f"{key}.kv").write_bytes(b"q" * 300)
    backend = open_store()
    assert backend.exists(["empty", key]) == [False, False]
    assert debris_counts(backend) == expect(empty_pages=1, misplaced_pages=1)


def test_each_thing_is_logged_once_with_its_path_and_action(
    open_store: Opener, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    open_store().close()
    free = next(n for n in ("ab", "cd") if n != fs_paths.shard_of("d")[0])
    planted = [shard_dirs(root, "d"), store_of(root) / "README", store_of(root) / free]
    planted[0].mkdir()
    planted[1].write_bytes(b"hello")
    planted[2].symlink_to("/nonexistent")
    with caplog.at_level(logging.WARNING, logger="kvtier.backends"):
        backend = open_store()
        backend.rescan()  # nothing is left, so nothing is logged again
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 3
    for path in planted:
        (line,) = [m for m in messages if f"{path}:" in m]
        assert line.endswith("; removed")
    assert debris_counts(backend) == expect(dirs=1, foreign_files=1, symlinks=1)


def test_the_log_is_capped_but_everything_is_counted(
    open_store: Opener, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    open_store().close()
    for i in range(150):
        (store_of(root) / f"junk{i}").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="kvtier.backends"):
        backend = open_store()
    assert len(caplog.records) == 101  # 100 entries, then one line saying the rest is counted
    assert "counted" in caplog.records[-1].getMessage()
    assert debris_counts(backend)["debris_foreign_files"] == 150


# --- hidden input: a seeded random mix of everything ------------------------------------


class Planter:
    """Plants a random mix of debris in a store next to valid pages, and keeps the books."""

    def __init__(self, rng: random.Random, root: Path, outside: dict[str, Any]) -> None:
        self.rng = rng
        self.root = root
        self.store = store_of(root)
        self.outside = outside
        self.expected: Counter[str] = Counter()
        self.valid: dict[str, bytes] = {}
        self.truncated: dict[str, int] = {}  # key -> the page size a get asks for
        self.blocked: list[str] = []  # keys whose page path held debris
        self.touched_pages: set[str] = set()
        self.touched_dirs: set[Path] = set()
        self.dead = dead_pid()
        self.serial = 0
        self.bad_shards: set[str] = set()  # first-level shard names that hold debris

    def fresh_key(self) -> str:
        """A key not used yet, outside the shards that hold debris."""
        while True:
            self.serial += 1
            key = f"planted-{self.serial}-{self.rng.randrange(10**6)}"
            if fs_paths.shard_of(key)[0] not in self.bad_shards:
                return key

    def free_shard(self) -> str:
        """A first-level shard name not in use, from now on reserved for debris."""
        while True:
            name = f"{self.rng.randrange(256):02x}"
            if not os.path.lexists(self.store / name):
                self.bad_shards.add(name)
                return name

    def key_in(self, first: str) -> str:
        """A fresh key whose first shard directory is ``first``."""
        while True:
            self.serial += 1
            key = f"planted-{self.serial}-{self.rng.randrange(10**6)}"
            if fs_paths.shard_of(key)[0] == first:
                return key

    def some_leaf(self) -> Path:
        key = self.rng.choice(sorted(self.valid))
        return page_file(self.root, key).parent

    def page_at(self) -> tuple[str, Path]:
        key = self.fresh_key()
        self.blocked.append(key)
        return key, shard_dirs(self.root, key)

    # each planter returns the debris kind it expects to be counted (or None)

    def dir_at_page(self) -> str:
        _key, final = self.page_at()
        final.mkdir()
        (final / "nested" / "deeper").mkdir(parents=True)
        (final / "nested" / "file").write_bytes(self.rng.randbytes(100))
        (final / "to-sentinel").symlink_to(self.outside["sentinel"])
        return "dirs"

    def symlink_at_page(self) -> str:
        _key, final = self.page_at()
        target = self.rng.choice(
            [self.outside["sentinel"], self.outside["target_dir"], Path("/nonexistent/x"), final]
        )
        final.symlink_to(target)  # out of the root, dangling, or a loop onto itself
        return "symlinks"

    def symlink_at_shard(self) -> str:
        name = self.free_shard()
        (self.store / name).symlink_to(self.outside["target_dir"])
        self.blocked.append(self.key_in(name))
        return "symlinks"

    def symlink_inside(self) -> str:
        key = self.rng.choice(sorted(self.valid))
        (self.some_leaf() / f"alias-{self.serial}").symlink_to(page_file(self.root, key))
        self.serial += 1
        return "symlinks"

    def special_at_page(self) -> str:
        _key, final = self.page_at()
        if self.rng.random() < 0.5:
            os.mkfifo(final, 0o600)
        else:
            os.mknod(final, stat.S_IFSOCK | 0o600)
        return "special"

    def foreign_file(self) -> str:
        where = self.rng.choice([self.store, self.some_leaf(), self.some_leaf().parent])
        self.serial += 1
        (where / f"notes-{self.serial}.txt").write_bytes(self.rng.randbytes(50))
        return "foreign_files"

    def file_at_shard(self) -> str:
        name = self.free_shard()
        (self.store / name).write_bytes(b"not a shard")
        self.blocked.append(self.key_in(name))
        return "foreign_files"

    def foreign_dir(self) -> str:
        self.serial += 1
        directory = self.store / f"backup-{self.serial}"
        directory.mkdir()
        (directory / "old.kv").write_bytes(b"z" * 10)
        return "dirs"

    def empty_page(self) -> str:
        _key, final = self.page_at()
        final.write_bytes(b"")
        return "empty_pages"

    def misplaced_page(self) -> str:
        key = self.fresh_key()
        leaf = self.some_leaf()
        if fs_paths.page_path(self.store, key).parent == leaf:
            return self.empty_page()
        (leaf / f"{key}{fs_paths.PAGE_SUFFIX}").write_bytes(self.rng.randbytes(200))
        return "misplaced_pages"

    def stale_temp(self) -> str:
        self.serial += 1
        pid = self.rng.choice([self.dead, os.getpid()])
        temp = self.some_leaf() / f".{pid}.{self.rng.randrange(1, 99)}.{self.serial}.tmp"
        if pid == os.getpid():  # written by an earlier process that had our pid
            temp.write_bytes(b"old")
            os.utime(temp, (time.time() - 7200, time.time() - 7200))
            return "stale_temps"
        if self.rng.random() < 0.5:
            temp.write_bytes(self.rng.randbytes(64))
            return "stale_temps"
        temp.mkdir()
        (temp / "inside").write_bytes(b"i")
        return "dirs"

    def page_mode(self) -> str | None:
        untouched = sorted(set(self.valid) - self.touched_pages)
        if not untouched:
            return None
        key = self.rng.choice(untouched)
        self.touched_pages.add(key)
        page_file(self.root, key).chmod(self.rng.choice([0o644, 0o000, 0o400, 0o666]))
        return "modes_fixed"

    def dir_mode(self) -> str | None:
        leaf = self.some_leaf()
        directory = self.rng.choice([leaf, leaf.parent])
        if directory in self.touched_dirs:
            return None
        self.touched_dirs.add(directory)
        directory.chmod(self.rng.choice([0o755, 0o750, 0o770, 0o711]))
        return "modes_fixed"

    def foreign_owner(self) -> str | None:
        if os.geteuid() != 0:
            return None
        _key, final = self.page_at()
        final.write_bytes(b"f" * 300)
        os.chown(final, 54321, 54321)
        return "foreign_owner"

    def truncate_page(self) -> str | None:
        untouched = sorted(set(self.valid) - self.touched_pages)
        if not untouched:
            return None
        key = self.rng.choice(untouched)
        self.touched_pages.add(key)
        size = len(self.valid.pop(key))
        os.truncate(page_file(self.root, key), self.rng.randrange(1, size))
        self.truncated[key] = size
        return None  # read as a miss (size check), not counted at start-up

    PLANTERS = (
        "dir_at_page",
        "symlink_at_page",
        "symlink_at_shard",
        "symlink_inside",
        "special_at_page",
        "foreign_file",
        "file_at_shard",
        "foreign_dir",
        "empty_page",
        "misplaced_page",
        "stale_temp",
        "page_mode",
        "dir_mode",
        "foreign_owner",
        "truncate_page",
    )

    def plant(self, count: int) -> None:
        # Every planter first, so that each kind is covered; then a random mix.
        order = list(self.PLANTERS) + [self.rng.choice(self.PLANTERS) for _ in range(count)]
        self.rng.shuffle(order)
        for name in order:
            kind = getattr(self, name)()
            if kind is not None:
                self.expected[kind] += 1


@pytest.mark.parametrize("seed", range(6))
def test_a_store_full_of_random_debris_opens_and_serves_every_valid_page(
    backend_kind: str,
    root: Path,
    outside: dict[str, Any],
    seed: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = random.Random(seed)
    enveloped = backend_kind.endswith("-compiled")  # the writer and reader write alike
    family = [kind for kind in BACKENDS if kind.endswith("-compiled") == enveloped]
    writer_kind = rng.choice(family) if backend_kind.startswith("uring") else family[0]
    writer = _opener(writer_kind, root)()
    planter = Planter(rng, root, outside)
    for i in range(rng.randrange(8, 20)):
        data = rng.randbytes(rng.randrange(200, 12_000))
        planter.valid[f"valid-{i}"] = data
        assert writer.put([f"valid-{i}"], [page(data)]) == [True]
    writer.close()
    planter.plant(rng.randrange(10, 40))

    build = _opener(backend_kind, root)
    with caplog.at_level(logging.WARNING, logger="kvtier.backends"):
        backend = build()  # opens, whatever is there
    try:
        debris_logged = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(debris_logged) == sum(planter.expected.values())  # each one, once
        assert debris_counts(backend) == expect(**planter.expected)
        assert backend.stats()["pages_found_at_start"] == len(planter.valid) + len(
            planter.truncated
        )

        keys = sorted(planter.valid)
        outs = [blank(len(planter.valid[k])) for k in keys]
        assert backend.get(keys, outs) == [True] * len(keys)  # bit-exact, every one
        assert [joined(o) for o in outs] == [planter.valid[k] for k in keys]
        short = sorted(planter.truncated)
        assert backend.get(short, [blank(planter.truncated[k]) for k in short]) == [False] * len(
            short
        )
        assert backend.exists(planter.blocked) == [False] * len(planter.blocked)

        fresh = {k: rng.randbytes(rng.randrange(100, 5000)) for k in planter.blocked + short}
        fresh["brand-new"] = b"n" * 4096
        new_keys = sorted(fresh)
        assert backend.put(new_keys, [page(fresh[k]) for k in new_keys]) == [True] * len(new_keys)
        outs = [blank(len(fresh[k])) for k in new_keys]
        assert backend.get(new_keys, outs) == [True] * len(new_keys)
        assert [joined(o) for o in outs] == [fresh[k] for k in new_keys]
        assert debris_counts(backend) == expect(**planter.expected)  # nothing new met
    finally:
        backend.close()
    assert_clean(store_of(root))  # (once closed: the compiled loop keeps a spare till then)

    use_file = backend_kind.startswith("uring") or URING_SPEC.unavailable_reason()
    other = _opener(family[0] if use_file else family[1], root)()
    try:  # a second opening finds a clean store, readable by the other backend too
        assert debris_counts(other) == expect()
        everything = {**planter.valid, **fresh}
        keys = sorted(everything)
        outs = [blank(len(everything[k])) for k in keys]
        assert other.get(keys, outs) == [True] * len(keys)
        assert [joined(o) for o in outs] == [everything[k] for k in keys]
    finally:
        other.close()
    assert outside["sentinel"].read_bytes() == b"S" * 8192
    assert _snapshot(outside["dir"]) == outside["snapshot"]  # nothing outside was touched


def test_debris_that_cannot_be_removed_never_stops_the_store(
    open_store: Opener, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put over it reports True only if its page is published, and False only if not."""
    backend = open_store()
    final = shard_dirs(root, "stuck")
    final.mkdir()
    (final / "inside").write_bytes(b"i")

    def cannot(*args: object) -> None:
        raise OSError(errno.EBUSY, "Device or resource busy")

    monkeypatch.setattr(fs_debris, "_remove_tree", cannot)
    (result,) = backend.put(["stuck"], [page(b"s" * 3000)])
    temps = [p for p in final.parent.iterdir() if p.name.startswith(".")]
    if result:  # the exchange published the page; the directory stays under the temp name
        out = blank(3000)
        assert backend.get(["stuck"], [out]) == [True] and joined(out) == b"s" * 3000
        assert [p.is_dir() for p in temps] == [True]
    else:  # nothing published: the directory is still there, and no temp file of ours
        assert final.is_dir() and (final / "inside").read_bytes() == b"i"
        assert temps == []
    assert debris_counts(backend) == expect(dirs=1, unremovable=1)
    backend.close()
    again = open_store()  # still opens, and counts what it still cannot remove
    assert debris_counts(again) == expect(dirs=1, unremovable=1)
    assert again.put(["other"], [page(b"o" * 10)]) == [True]


def test_a_failed_exchange_reports_false_and_publishes_nothing(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file backend's exchange refused (EBUSY, as for a mount point): False, no temp.

    The Python steps (ctypes' renameat2); the C steps' exchange is refused by a preloaded
    shim in test_compiled_loop.py."""
    backend = _opener("file-python", root)()
    final = shard_dirs(root, "mounted")
    final.mkdir()

    def busy(*args: object) -> int:
        ctypes.set_errno(errno.EBUSY)
        return -1

    monkeypatch.setattr(fs_publish, "_renameat2", busy)
    assert backend.put(["mounted"], [page(b"m" * 100)]) == [False]
    assert final.is_dir()
    assert [p.name for p in final.parent.iterdir()] == ["mounted.kv"]
    assert backend.stats()["put_failed_io"] == 1
    backend.close()
