"""The file backend's compiled per-page loop (``_pageio``) against its Python loop.

The compiled loop must write the same files and give the same answers as the Python
loop it replaces on the hot path: bit-exact round trips, byte-identical envelopes,
pages readable by the other loop and by the io_uring backend, and the same verdict and
counters for every kind of damaged or foreign store entry. ``KVTIER_REQUIRE_COMPILED=1``
(CI) makes a missing build a failure instead of a skip.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import random
import shlex
import shutil
import signal
import string
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import compiled, slices
from kvtier.backends.filestore import paths as fs_paths
from kvtier.backends.filestore.store import WRITER_WAIT
from kvtier.core.envelope import HEADER, EnvelopeFormat, key_digest
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import MAX_KEY_LENGTH, Namespace, PageKeyer
from kvtier.core.pagestore import PageStore
from kvtier.testing import require

GEOMETRY = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4)
#: Pages big enough to take the piece-by-piece read (more than 2 x 256 KiB).
BIG = KVGeometry.mha(num_layers=8, num_kv_heads=8, head_dim=128, page_size=16)
PAGES = 8


def _require_uring() -> None:
    from kvtier.backends.uring import probe_io_uring

    require("uring", probe_io_uring())


@pytest.fixture(autouse=True)
def _compiled_loop_built() -> None:
    missing = None if compiled.available() else f"it is not built: {compiled.MISSING}"
    require("compiled", missing)


class Setup:
    """A host pool of random pages, their keys, and a file backend over one root."""

    def __init__(
        self,
        root: Path,
        *,
        compiled_io: bool,
        geometry: KVGeometry = GEOMETRY,
        uring: bool = False,
        **options: object,
    ) -> None:
        self.geometry = geometry
        self.pool = HostPool(geometry, "page_first", num_pages=2 * PAGES, pin_memory=False)
        for page in range(PAGES):
            for extent in self.pool.extents(page):
                extent.view[:] = os.urandom(extent.length)
        namespace = Namespace("compiled", geometry.fingerprint)
        self.keys = PageKeyer(namespace, geometry.page_size).keys(
            list(range(geometry.page_size * PAGES))
        )
        self.backend: Any
        if uring:  # (io_threads, a file backend option, does not apply)
            from kvtier.backends.uring import UringConfig
            from kvtier.backends.uring.backend import UringBackend

            _require_uring()
            ring_config = UringConfig(root=root, min_free_bytes=0, compiled_io=compiled_io)
            self.backend = UringBackend(ring_config)
        else:
            config = FileConfig(root=root, min_free_bytes=0, compiled_io=compiled_io, **options)  # type: ignore[arg-type]
            self.backend = FileBackend(config)
        self.store = PageStore(self.backend, self.pool, fingerprint=geometry.fingerprint)

    @property
    def store_dir(self) -> Path:
        return Path(self.backend.store)

    def path(self, i: int) -> str:
        return fs_paths.page_path_str(os.fspath(self.backend.store), self.keys[i])

    def payload(self, page: int) -> bytes:
        return b"".join(bytes(e.view) for e in self.pool.extents(page))

    def put_all(self) -> list[bool]:
        return self.store.put(self.keys, list(range(PAGES)))

    def get_all(self) -> list[bool]:
        return self.store.get(self.keys, list(range(PAGES, 2 * PAGES)))

    def close(self) -> None:
        self.store.close()
        self.backend.close()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Setup]]:
    made: list[Setup] = []

    def build(name: str = "root", **kwargs: object) -> Setup:
        setup = Setup(tmp_path / name, **kwargs)  # type: ignore[arg-type]
        made.append(setup)
        return setup

    yield build
    for setup in made:
        setup.close()


def test_the_backend_says_which_loop_it_runs(make: Callable[..., Setup]) -> None:
    assert make("a", compiled_io=True).backend.checks_envelopes is True
    assert make("b", compiled_io=False).backend.checks_envelopes is False


@pytest.mark.parametrize("geometry", [GEOMETRY, BIG], ids=["small", "pieces"])
@pytest.mark.parametrize("threads", [1, 4])
def test_round_trip_is_bit_exact(
    make: Callable[..., Setup], geometry: KVGeometry, threads: int
) -> None:
    setup = make(compiled_io=True, geometry=geometry, io_threads=threads)
    assert setup.put_all() == [True] * PAGES
    assert setup.get_all() == [True] * PAGES
    for page in range(PAGES):
        assert setup.payload(PAGES + page) == setup.payload(page)
    stats = setup.store.stats()
    assert (stats["hits"], stats["invalid"], stats["puts"]) == (PAGES, 0, PAGES)
    backend = setup.backend.stats()
    assert backend["puts"] == PAGES
    assert backend["bytes_written"] == backend["bytes_read"] > 0


@pytest.mark.parametrize("geometry", [GEOMETRY, BIG], ids=["small", "streamed"])
def test_envelopes_are_byte_identical_to_the_python_writer(
    make: Callable[..., Setup], geometry: KVGeometry
) -> None:
    # (a new page over 512 KiB is hashed, then written in one call from offset 0; an
    # overwrite in place is written piece by piece, its header last)
    setup = make(compiled_io=True, geometry=geometry)
    assert setup.put_all() == [True] * PAGES
    fmt = EnvelopeFormat(geometry.fingerprint, "page_first")
    for i in range(PAGES):
        stored = Path(setup.path(i)).read_bytes()
        slot = memoryview(bytearray(len(stored) - len(setup.payload(i))))
        fmt.write(slot, setup.keys[i], [e.view for e in setup.pool.extents(i)])
        assert stored[: slot.nbytes] == bytes(slot)
        assert stored[slot.nbytes :] == setup.payload(i)


@pytest.mark.parametrize("writer, reader", [(True, False), (False, True)])
def test_each_loop_reads_what_the_other_wrote(
    make: Callable[..., Setup], tmp_path: Path, writer: bool, reader: bool
) -> None:
    first = make("shared", compiled_io=writer)
    assert first.put_all() == [True] * PAGES
    first.close()
    second = make("shared", compiled_io=reader)
    second.pool = first.pool  # the same payloads, read into the second half
    second.store = PageStore(second.backend, first.pool, fingerprint=GEOMETRY.fingerprint)
    assert second.get_all() == [True] * PAGES
    for page in range(PAGES):
        assert first.payload(PAGES + page) == first.payload(page)


def test_the_uring_backend_reads_what_the_compiled_loop_wrote(
    make: Callable[..., Setup],
) -> None:
    from kvtier.backends.uring import UringConfig

    _require_uring()
    from kvtier.backends.uring.backend import UringBackend

    setup = make(compiled_io=True)
    assert setup.put_all() == [True] * PAGES
    uring = UringBackend(UringConfig(root=setup.backend.config.root, min_free_bytes=0))
    try:
        store = PageStore(uring, setup.pool, fingerprint=GEOMETRY.fingerprint)
        assert store.get(setup.keys, list(range(PAGES, 2 * PAGES))) == [True] * PAGES
    finally:
        uring.close()
    for page in range(PAGES):
        assert setup.payload(PAGES + page) == setup.payload(page)


def _flip(offset: int) -> Callable[[Setup], None]:
    def damage(setup: Setup) -> None:
        with open(setup.path(0), "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))

    return damage


def _foreign_page(setup: Setup) -> None:
    shutil.copyfile(setup.path(1), setup.path(0))


def _truncate(setup: Setup) -> None:
    os.truncate(setup.path(0), os.path.getsize(setup.path(0)) - 1)


def _remove(setup: Setup) -> None:
    os.unlink(setup.path(0))


def _directory(setup: Setup) -> None:
    os.unlink(setup.path(0))
    os.mkdir(setup.path(0))


def _symlink(setup: Setup) -> None:
    target = setup.path(0) + ".elsewhere"
    os.rename(setup.path(0), target)
    os.symlink(target, setup.path(0))


def _fifo(setup: Setup) -> None:
    os.unlink(setup.path(0))
    os.mkfifo(setup.path(0))


#: damage -> the counter (PageStore's or the backend's) that must say what happened.
DAMAGE: dict[str, tuple[Callable[[Setup], None], str]] = {
    "payload-bit": (_flip(HEADER.size + 4096), "invalid_corrupt_checksum"),
    "header-bit": (_flip(60), "invalid_corrupt_header"),
    "magic": (_flip(0), "invalid_bad_magic"),
    "foreign-page": (_foreign_page, "invalid_wrong_key"),
    "truncated": (_truncate, "get_size_mismatch"),
    "removed": (_remove, "misses"),
    "directory": (_directory, "debris_dirs"),
    "symlink": (_symlink, "debris_symlinks"),
    "fifo": (_fifo, "debris_special"),
}


def _outcome(setup: Setup, counter: str) -> tuple[list[bool], int, int, int]:
    results = setup.get_all()
    stats = {**setup.backend.stats(), **setup.store.stats()}
    return results, stats["hits"], stats["invalid"], int(stats.get(counter, 0))


@pytest.mark.parametrize("uring", [False, True], ids=["file", "uring"])
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_gets_the_same_verdict_from_both_loops(
    make: Callable[..., Setup], case: str, uring: bool
) -> None:
    damage, counter = DAMAGE[case]
    outcomes = []
    for compiled_io in (True, False):
        setup = make(f"root-{compiled_io}", compiled_io=compiled_io, uring=uring)
        assert setup.put_all() == [True] * PAGES
        damage(setup)
        outcomes.append(_outcome(setup, counter))
    ours, python = outcomes
    assert ours == python
    results, hits, _invalid, count = ours
    assert results == [False] + [True] * (PAGES - 1)
    assert hits == PAGES - 1
    assert count >= 1, f"{counter} not counted for {case}"


def test_header_only_verification_skips_the_payload_in_both_loops(
    make: Callable[..., Setup],
) -> None:
    for compiled_io in (True, False):
        setup = make(f"root-{compiled_io}", compiled_io=compiled_io)
        setup.store = PageStore(
            setup.backend, setup.pool, fingerprint=GEOMETRY.fingerprint, verify="header"
        )
        assert setup.put_all() == [True] * PAGES
        _flip(HEADER.size + 4096)(setup)
        assert setup.get_all() == [True] * PAGES  # what header-only promises, no more
        _flip(60)(setup)
        assert setup.get_all()[0] is False


def test_an_overwrite_replaces_the_page_atomically(make: Callable[..., Setup]) -> None:
    setup = make(compiled_io=True)
    assert setup.put_all() == [True] * PAGES
    old = Path(setup.path(0)).read_bytes()
    for extent in setup.pool.extents(0):
        extent.view[:] = os.urandom(extent.length)
    assert setup.store.put(setup.keys[:1], [0]) == [True]
    assert Path(setup.path(0)).read_bytes() != old
    assert setup.store.get(setup.keys[:1], [PAGES]) == [True]
    assert setup.payload(PAGES) == setup.payload(0)
    # the replaced file is kept, locked, for the next overwrite: gone once the backend closes
    setup.close()
    leftovers = [p for p in Path(setup.store_dir).rglob(".*")]
    assert leftovers == []


def _overwrite(setup: Setup, page: int) -> None:
    for extent in setup.pool.extents(page):
        extent.view[:] = os.urandom(extent.length)
    assert setup.store.put(setup.keys[page : page + 1], [page]) == [True]


@pytest.mark.parametrize("uring", [False, True], ids=["file", "uring"])
def test_overwrites_without_fsync_go_into_the_pages_own_file(
    make: Callable[..., Setup], uring: bool
) -> None:
    setup = make(compiled_io=True, io_threads=1, uring=uring)
    assert setup.put_all() == [True] * PAGES
    inodes = [os.stat(setup.path(i)).st_ino for i in range(PAGES)]
    for page in range(PAGES):
        _overwrite(setup, page)
    assert [os.stat(setup.path(i)).st_ino for i in range(PAGES)] == inodes
    assert setup.backend.stats()["puts_in_place"] == PAGES
    assert setup.get_all() == [True] * PAGES  # full verification: the new bytes, whole
    for page in range(PAGES):
        assert setup.payload(PAGES + page) == setup.payload(page)
    python = make("python", compiled_io=False)  # the Python loop reads them as well
    shutil.rmtree(python.store_dir)
    shutil.copytree(setup.store_dir, python.store_dir)
    assert python.store.get(setup.keys, list(range(PAGES, 2 * PAGES))) == [True] * PAGES
    for page in range(PAGES):
        assert python.payload(PAGES + page) == setup.payload(page)


def test_header_only_readers_never_see_a_page_mid_overwrite(make: Callable[..., Setup]) -> None:
    # in-place overwrites against readers that check only the header: the locks alone
    # keep them from a half-written page (the compiled loop releases the GIL throughout)
    setup = make(compiled_io=True, io_threads=1, geometry=BIG)
    assert setup.put_all() == [True] * PAGES
    versions = {setup.payload(page) for page in range(PAGES)}
    key = setup.keys[0]
    header = PageStore(
        setup.backend, setup.pool, fingerprint=setup.geometry.fingerprint, verify="header"
    )
    stop = threading.Event()
    errors: list[BaseException] = []
    hits = [0]

    def write() -> None:
        try:
            for round_ in range(200):
                assert setup.store.put([key], [round_ % PAGES]) == [True]
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    def read(page: int) -> None:
        try:
            while not stop.is_set():
                if header.get([key], [page]) == [True]:
                    hits[0] += 1
                    assert setup.payload(page) in versions, "a torn page was served"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write)]
    threads += [threading.Thread(target=read, args=(PAGES + i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert hits[0] > 0
    assert setup.backend.stats()["puts_in_place"] > 0
    # nor one whose header the writer had invalidated: readers wait for the whole page
    assert header.stats()["invalid"] == 0


_WRITER = """
import os
import sys
from pathlib import Path

import torch

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.pagestore import PageStore

root, kind, compiled_io, fsync = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
geometry = KVGeometry.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64)
key = PageKeyer(Namespace("killed", geometry.fingerprint), geometry.page_size).keys(
    list(range(geometry.page_size))
)[0]


def open_store():
    pool = HostPool(geometry, "page_first", num_pages=2, pin_memory=False)
    for page, fill in ((0, 1), (1, 2)):
        for extent in pool.extents(page):
            torch.frombuffer(extent.view, dtype=torch.uint8).fill_(fill)
    options = dict(root=root, min_free_bytes=0, compiled_io=compiled_io, fsync=fsync)
    if kind == "uring":
        from kvtier.backends.uring import UringConfig
        from kvtier.backends.uring.backend import UringBackend

        backend = UringBackend(UringConfig(**options))
    else:
        backend = FileBackend(FileConfig(io_threads=1, **options))
    return PageStore(backend, pool, fingerprint=geometry.fingerprint)


print(key, flush=True)
for command in sys.stdin:  # each writer is a child of this one: a kill costs no start-up
    child = os.fork()
    if child == 0:
        code = 3
        try:
            store = open_store()
            if command.strip() == "seed":
                code = 0 if store.put([key], [0]) == [True] else 4
            else:
                print(f"writing {os.getpid()}", flush=True)
                for round_ in range(1_000_000):  # one 16 MiB page after the other
                    assert store.put([key], [(round_ + 1) % 2]) == [True]
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    print(f"ended {os.waitstatus_to_exitcode(status)}", flush=True)
"""

#: Every way a page is written, as (backend, compiled_io, fsync): the file backend's
#: Python and compiled loops, the ring, and uring's compiled loop (which writes only
#: without fsync); "none" overwrites with the compiled loop go in place. "batch" publishes
#: its own way (every page written and synced, then every rename: the Python loop's
#: deferred publish, the ring's batch of renames) and has no compiled loop: with
#: compiled_io on, a "batch" put runs those same loops (and these cases would cover a
#: compiled one, were one added).
_WRITERS = [
    ("file", False, "none"),
    ("file", False, "page"),
    ("file", False, "batch"),
    ("file", True, "none"),
    ("file", True, "page"),
    ("file", True, "batch"),
    ("uring", False, "none"),
    ("uring", False, "page"),
    ("uring", False, "batch"),
    ("uring", True, "none"),
    ("uring", True, "batch"),
]
_WRITER_IDS = [
    f"{kind}-{('compiled' if compiled_io else 'ring' if kind == 'uring' else 'python')}-{fsync}"
    for kind, compiled_io, fsync in _WRITERS
]


@pytest.mark.parametrize(("kind", "compiled_io", "fsync"), _WRITERS, ids=_WRITER_IDS)
def test_a_writer_killed_mid_overwrite_leaves_no_torn_page(
    tmp_path: Path, kind: str, compiled_io: bool, fsync: str
) -> None:
    # SIGKILL stops a writer at a random moment of a put. A page published by exchange or
    # rename is whole, the old one or the new one. One overwritten in place (the compiled
    # loop without fsync) may stop between two 4 KiB pages of the file: its invalidated
    # header then makes it a miss, under header-only verification too
    if kind == "uring":
        _require_uring()
    in_place = compiled_io and fsync == "none"

    def open_backend() -> Any:
        if kind == "uring":
            from kvtier.backends.uring import UringConfig
            from kvtier.backends.uring.backend import UringBackend

            return UringBackend(
                UringConfig(root=tmp_path, min_free_bytes=0, compiled_io=compiled_io)
            )
        config = FileConfig(root=tmp_path, min_free_bytes=0, compiled_io=compiled_io, io_threads=1)
        return FileBackend(config)

    geometry = KVGeometry.mha(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64)
    pool = HostPool(geometry, "page_first", num_pages=1, pin_memory=False)
    whole = {bytes([fill]) * (pool.page_bytes) for fill in (1, 2)}
    rng = random.Random(3)
    refused = invalid = 0
    command = [sys.executable, "-c", _WRITER, str(tmp_path), kind, str(int(compiled_io)), fsync]
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as server:
        assert server.stdin is not None and server.stdout is not None
        stdin, stdout = server.stdin, server.stdout

        def ask(command: str) -> str:
            stdin.write(command + "\n")
            stdin.flush()
            return stdout.readline().strip()

        key = stdout.readline().strip()
        assert ask("seed") == "ended 0"
        backend = open_backend()
        reader = PageStore(backend, pool, fingerprint=geometry.fingerprint, verify="header")
        try:
            path = fs_paths.page_path_str(os.fspath(backend.store), key)
            inode = os.stat(path).st_ino
            for _ in range(6):
                writing = ask("write")
                assert writing.startswith("writing "), writing
                time.sleep(0.05 + rng.random() * 0.05)
                os.kill(int(writing.split()[1]), signal.SIGKILL)
                assert stdout.readline().strip() == f"ended {-signal.SIGKILL}"
                if in_place:
                    assert os.stat(path).st_ino == inode  # written in place, never replaced
                if reader.get([key], [0]) == [True]:
                    assert b"".join(bytes(e.view) for e in pool.extents(0)) in whole, "torn"
                else:
                    assert in_place, "a page published by exchange or rename went missing"
                    refused += 1
            invalid = reader.stats()["invalid"]
        finally:
            stdin.close()
            server.wait(timeout=60)
            reader.close()
            backend.close()
    assert server.returncode == 0
    assert invalid == refused  # each miss: a header without its magic
    again = open_backend()  # start-up removes what the killed writers left under temp names
    again.close()
    assert list(tmp_path.rglob(f".*{fs_paths.TEMP_SUFFIX}")) == []


def test_a_file_of_another_size_is_replaced_not_patched(make: Callable[..., Setup]) -> None:
    setup = make(compiled_io=True, io_threads=1)
    assert setup.put_all() == [True] * PAGES
    os.truncate(setup.path(0), 100)  # damaged: shorter than the page
    inode = os.stat(setup.path(0)).st_ino
    _overwrite(setup, 0)
    assert os.stat(setup.path(0)).st_ino != inode  # a new file, published whole
    assert setup.backend.stats().get("puts_in_place", 0) == 0
    assert setup.store.get(setup.keys[:1], [PAGES]) == [True]
    assert setup.payload(PAGES) == setup.payload(0)


def test_a_hard_linked_page_is_never_overwritten_in_place(
    make: Callable[..., Setup], tmp_path: Path
) -> None:
    setup = make(compiled_io=True, io_threads=1)
    assert setup.put_all() == [True] * PAGES
    other = tmp_path / "other-link"
    os.link(setup.path(0), other)
    old = other.read_bytes()
    _overwrite(setup, 0)
    assert other.read_bytes() == old  # the other name keeps the old page
    assert setup.backend.stats().get("puts_in_place", 0) == 0


@pytest.mark.parametrize("uring", [False, True], ids=["file", "uring"])
def test_an_overwrite_a_reader_holds_publishes_a_new_file(
    make: Callable[..., Setup], uring: bool
) -> None:
    setup = make(compiled_io=True, io_threads=1, uring=uring)
    assert setup.put_all() == [True] * PAGES
    old = Path(setup.path(0)).read_bytes()
    reader = os.open(setup.path(0), os.O_RDONLY)  # as a reader mid-read holds it
    try:
        fcntl.flock(reader, fcntl.LOCK_SH)
        _overwrite(setup, 0)
        assert os.pread(reader, len(old) + 1, 0) == old  # the whole old page, unchanged
        assert os.fstat(reader).st_ino != os.stat(setup.path(0)).st_ino
    finally:
        os.close(reader)
    assert setup.backend.stats().get("puts_in_place", 0) == 0
    assert setup.store.get(setup.keys[:1], [PAGES]) == [True]
    assert setup.payload(PAGES) == setup.payload(0)


def test_durable_overwrites_write_into_the_file_a_replaced_page_left(
    make: Callable[..., Setup],
) -> None:
    setup = make(compiled_io=True, io_threads=1, fsync="page")
    assert setup.put_all() == [True] * PAGES
    first = os.stat(setup.path(0)).st_ino
    _overwrite(setup, 0)  # page 0's old file is now the spare
    _overwrite(setup, 1)  # ... and page 1 is written into it
    assert os.stat(setup.path(1)).st_ino == first
    assert setup.backend.stats().get("puts_in_place", 0) == 0
    assert setup.store.get(setup.keys[:2], [PAGES, PAGES + 1]) == [True, True]
    assert setup.payload(PAGES) == setup.payload(0)
    assert setup.payload(PAGES + 1) == setup.payload(1)


@pytest.mark.parametrize("uring", [False, True], ids=["file", "uring"])
def test_a_file_a_reader_holds_is_never_recycled(make: Callable[..., Setup], uring: bool) -> None:
    # uring recycles only without fsync (its durable writes go through the ring), where a
    # held page is replaced by a new file instead of in place
    setup = make(
        compiled_io=True, io_threads=1, uring=uring, **({} if uring else {"fsync": "page"})
    )
    assert setup.put_all() == [True] * PAGES
    old = Path(setup.path(0)).read_bytes()
    reader = os.open(setup.path(0), os.O_RDONLY)  # as a reader mid-read holds it
    try:
        fcntl.flock(reader, fcntl.LOCK_SH)
        _overwrite(setup, 0)
        _overwrite(setup, 1)  # would be written into page 0's old file if it were free
        _overwrite(setup, 2)
        assert os.pread(reader, len(old) + 1, 0) == old  # the whole old page, unchanged
        assert os.fstat(reader).st_nlink == 0  # unlinked, not recycled
    finally:
        os.close(reader)
    assert setup.store.get(setup.keys[:3], [PAGES, PAGES + 1, PAGES + 2]) == [True] * 3


@pytest.mark.parametrize(
    ("compiled_io", "uring"),
    [(True, False), (False, False), (True, True)],
    ids=["compiled", "python", "uring"],
)
def test_a_reader_waits_out_an_overwrite_in_place(
    make: Callable[..., Setup], compiled_io: bool, uring: bool
) -> None:
    # the name still holds the same, locked file: a page being overwritten in place, which
    # ends within milliseconds; the reader waits for it instead of missing
    setup = make(compiled_io=compiled_io, uring=uring)
    assert setup.put_all() == [True] * PAGES
    writer = os.open(setup.path(0), os.O_WRONLY)
    fcntl.flock(writer, fcntl.LOCK_EX)
    release = threading.Timer(0.005, os.close, args=(writer,))
    release.start()
    try:
        assert setup.get_all() == [True] * PAGES
    finally:
        release.join()
    assert setup.backend.stats().get("get_busy", 0) == 0
    assert setup.payload(PAGES) == setup.payload(0)


@pytest.mark.parametrize("compiled_io", [True, False], ids=["compiled", "python"])
def test_a_page_a_writer_holds_is_a_counted_busy_miss(
    make: Callable[..., Setup], compiled_io: bool
) -> None:
    setup = make(compiled_io=compiled_io)
    assert setup.put_all() == [True] * PAGES
    writer = os.open(setup.path(0), os.O_WRONLY)  # as the compiled loop holds a spare
    try:
        fcntl.flock(writer, fcntl.LOCK_EX)
        assert setup.get_all() == [False] + [True] * (PAGES - 1)
        assert setup.backend.stats()["get_busy"] == 1
    finally:
        os.close(writer)
    assert setup.get_all() == [True] * PAGES


def test_a_directory_under_the_page_name_is_replaced_and_counted(
    make: Callable[..., Setup],
) -> None:
    setup = make(compiled_io=True)
    os.makedirs(setup.path(0))
    Path(setup.path(0), "inside").write_bytes(b"x")
    assert setup.put_all() == [True] * PAGES
    assert Path(setup.path(0)).is_file()
    assert setup.backend.stats()["debris_dirs"] >= 1
    assert setup.get_all() == [True] * PAGES


def test_a_file_where_a_shard_directory_belongs_is_repaired(
    make: Callable[..., Setup],
) -> None:
    setup = make(compiled_io=True)
    leaf = Path(setup.path(0)).parent
    leaf.parent.mkdir(parents=True, exist_ok=True)
    leaf.write_bytes(b"not a directory")
    assert setup.put_all() == [True] * PAGES
    assert leaf.is_dir()
    assert setup.get_all() == [True] * PAGES


def test_page_durability_round_trips(make: Callable[..., Setup]) -> None:
    setup = make(compiled_io=True, fsync="page")
    assert setup.put_all() == [True] * PAGES
    assert setup.get_all() == [True] * PAGES
    assert setup.backend.stats().get("fsync_errors", 0) == 0


def test_capacity_refusals_are_counted_not_written(make: Callable[..., Setup]) -> None:
    setup = make(compiled_io=True, capacity_bytes=1)
    assert setup.put_all() == [False] * PAGES
    assert setup.backend.stats()["put_failed_page_larger_than_capacity"] == PAGES
    assert not any(Path(setup.path(i)).exists() for i in range(PAGES))


def test_malformed_calls_are_refused_with_a_reason(tmp_path: Path) -> None:
    pageio = compiled._pageio
    header = memoryview(bytearray(HEADER.size))
    payload = memoryview(bytearray(64))
    store = str(tmp_path)
    with pytest.raises(ValueError, match="differ in length"):
        pageio.read_pages(store, ["a", "b"], [[header, payload]], False, None, False)
    with pytest.raises(ValueError, match="differ in length"):
        pageio.read_pages(store, ["a"], [[header, payload]], [False, True], None, False)
    with pytest.raises(ValueError, match="smaller than the envelope header"):
        pageio.read_pages(store, ["a"], [[header[:8], payload]], False, None, False)
    with pytest.raises(TypeError, match="56 bytes"):
        pageio.read_pages(store, ["a"], [[header, payload]], False, b"short", True)
    readonly = memoryview(bytes(HEADER.size))
    with pytest.raises(BufferError):
        pageio.read_pages(store, ["a"], [[readonly, payload]], False, None, False)
    with pytest.raises(ValueError, match="differ in length"):
        pageio.write_pages(
            store, ["a", "b"], ".1.2.", 1, [[header, payload]], False, None, False, False
        )
    for stem in ("x.1.2.", "./../.1."):
        with pytest.raises(ValueError, match="not a temp name stem"):
            pageio.write_pages(
                store, ["a"], stem, 1, [[header, payload]], False, None, False, False
            )
    assert list(tmp_path.iterdir()) == []
    assert pageio.bind("/nonexistent/libxxhash.so") is False


@pytest.mark.parametrize(
    "key", ["", "A", "_a", "-a", "a/b", "..", "a.kv", "é", "a" * (MAX_KEY_LENGTH + 1), "a\x00b"]
)
def test_the_compiled_loop_makes_no_path_of_an_unchecked_key(tmp_path: Path, key: str) -> None:
    # keys are checked before they reach the loop; it refuses one that was not, so no
    # caller's mistake can name a file outside the store
    header = memoryview(bytearray(HEADER.size))
    payload = memoryview(bytearray(64))
    with pytest.raises(ValueError, match="not a checked page key"):
        compiled._pageio.read_pages(str(tmp_path), [key], [[header, payload]], False, None, False)
    with pytest.raises(ValueError, match="not a checked page key"):
        compiled._pageio.write_pages(
            str(tmp_path), [key], ".1.2.", 1, [[header, payload]], False, None, False, False
        )
    with pytest.raises(ValueError, match="not a checked page key"):
        compiled._pageio.name(str(tmp_path), key)
    assert list(tmp_path.iterdir()) == []


def test_the_compiled_loop_names_pages_as_the_python_loop_does() -> None:
    # the C page names and key digests (its own BLAKE2b) against hashlib's, for every key
    # length up to the longest, across the 128-byte block boundary
    rng = random.Random(7)
    alphabet = string.ascii_lowercase + string.digits + "_-"
    store = "/var/kvtier/ns-1"
    for length in range(1, MAX_KEY_LENGTH + 1):
        for _ in range(4):
            key = rng.choice("a9") + "".join(rng.choice(alphabet) for _ in range(length - 1))
            path, digest = compiled._pageio.name(store, key)
            assert path == fs_paths.page_path_unchecked(store, key)
            assert digest == key_digest(key)
    assert compiled._pageio.MAX_KEY_LENGTH == MAX_KEY_LENGTH


@pytest.mark.parametrize("geometry", [GEOMETRY, BIG], ids=["small", "pieces"])
def test_pages_not_in_the_page_cache_are_read_on_the_io_threads(
    make: Callable[..., Setup], monkeypatch: pytest.MonkeyPatch, geometry: KVGeometry
) -> None:
    setup = make(compiled_io=True, io_threads=4, geometry=geometry)
    assert setup.put_all() == [True] * PAGES
    cold = {1, 4, 6}
    for i in cold:  # written back, then dropped from the page cache
        fd = os.open(setup.path(i), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    passes: list[tuple[bool, list[int]]] = []
    real = compiled.read_slice

    def recorded(*args: object, nowait: bool = False, **kwargs: object) -> list[int]:
        passes.append((nowait, list(args[3])))  # type: ignore[call-overload]
        return real(*args, nowait=nowait, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compiled, "read_slice", recorded)
    assert setup.get_all() == [True] * PAGES
    for page in range(PAGES):
        assert setup.payload(PAGES + page) == setup.payload(page)
    cached = sorted(i for nowait, which in passes if nowait for i in which)
    assert cached == list(range(PAGES))  # every page tried from the page cache first
    waited = sorted(i for nowait, which in passes[1:] for i in which if not nowait)
    if not waited:
        pytest.skip("this filesystem kept the dropped pages cached (tmpfs?)")
    assert set(waited) <= cold  # only cold pages waited (readahead may have cached some)
    assert setup.store.stats()["hits"] == PAGES


def test_uring_reads_cached_pages_before_the_ring_and_cold_ones_through_it(
    make: Callable[..., Setup],
) -> None:
    setup = make(compiled_io=True, uring=True)
    assert setup.backend.checks_envelopes is True
    assert setup.put_all() == [True] * PAGES
    ring = setup.backend._rings.ring()
    before = ring.submitted
    assert setup.get_all() == [True] * PAGES  # all in the page cache: no ring request
    assert ring.submitted == before
    for i in (2, 5):
        fd = os.open(setup.path(i), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    assert setup.get_all() == [True] * PAGES
    for page in range(PAGES):
        assert setup.payload(PAGES + page) == setup.payload(page)
    if ring.submitted == before:
        pytest.skip("this filesystem kept the dropped pages cached (tmpfs?)")
    assert ring.submitted - before <= 2  # only the dropped pages went to the ring
    stats = {**setup.backend.stats(), **setup.store.stats()}
    assert stats["hits"] == 2 * PAGES and stats["invalid"] == 0


@pytest.mark.parametrize("uring", [False, True], ids=["file", "uring"])
def test_warm_copies_run_on_one_thread_per_cpu_and_mib(
    make: Callable[..., Setup], monkeypatch: pytest.MonkeyPatch, uring: bool
) -> None:
    # page-cache reads and overwrites without fsync wait for nothing: more threads than
    # CPUs (or than MiB in the batch) would only take turns
    setup = make(compiled_io=True, io_threads=4, uring=uring, geometry=BIG)
    assert setup.put_all() == [True] * PAGES
    threads: set[int] = set()

    def recording(real: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def recorded(*args: Any, **kwargs: Any) -> list[Any]:
            threads.add(threading.get_ident())
            return real(*args, **kwargs)

        return recorded

    monkeypatch.setattr(compiled, "read_slice", recording(compiled.read_slice))
    monkeypatch.setattr(compiled, "write_slice", recording(compiled.write_slice))
    batch_bytes = PAGES * sum(e.length for e in setup.pool.page_buffers(0))
    expected = min(slices.CPUS, batch_bytes // slices.MIN_SLICE_BYTES, 4)
    assert setup.get_all() == [True] * PAGES
    assert len(threads) == expected
    threads.clear()
    assert setup.put_all() == [True] * PAGES  # overwrites, in place
    assert len(threads) == expected
    assert setup.backend.stats()["puts_in_place"] == PAGES
    threads.clear()
    assert setup.store.get(setup.keys[:1], [PAGES]) == [True]  # one page: no hand-off
    assert len(threads) == 1  # (the thread that called the backend)


def test_open_pages_opens_what_the_ring_reads_and_counts_the_rest(
    make: Callable[..., Setup],
) -> None:
    # uring's ring path opens a batch in one C call: locked, sized, O_NONBLOCK cleared
    setup = make(compiled_io=True)
    assert setup.put_all() == [True] * PAGES
    os.truncate(setup.path(1), 100)  # a wrong size
    os.unlink(setup.path(2))  # gone
    os.unlink(setup.path(3))
    os.mkdir(setup.path(3))  # debris under the page's name
    writer = os.open(setup.path(4), os.O_WRONLY)  # held by a writer throughout
    fcntl.flock(writer, fcntl.LOCK_EX)
    pages = [setup.pool.page_buffers(i) for i in range(PAGES)]
    try:
        fds = compiled.open_pages(setup.backend._fs, setup.keys, pages, [False] * PAGES)
    finally:
        os.close(writer)
    try:
        assert [fd >= 0 for fd in fds] == [True, False, False, False, False, True, True, True]
        for fd in (fd for fd in fds if fd >= 0):
            assert os.get_blocking(fd)  # O_NONBLOCK cleared
            with pytest.raises(BlockingIOError):  # and the readers' lock held
                probe = os.open(setup.path(fds.index(fd)), os.O_WRONLY)
                try:
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                finally:
                    os.close(probe)
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    stats = setup.backend.stats()
    assert stats["get_size_mismatch"] == 1
    assert stats["get_busy"] == 1
    assert stats["debris_dirs"] == 1 and not os.path.exists(setup.path(3))


def test_the_built_loop_is_not_older_than_its_source() -> None:
    # its own C files and header, and the shared ones (the envelope, hashing, glue in
    # kvtier/_csrc/): hatch_build.py compiles them all into one
    home = Path(compiled.__file__).with_name("_pageio_src")
    built = Path(compiled._pageio.__file__)
    if built.parent != home.parent:  # an installed wheel: built from its own source
        pytest.skip(f"the loop was installed from a wheel ({built})")
    shared = Path(kvtier.__file__).with_name("_csrc")
    sources = sorted(home.glob("*.[ch]")) + sorted(shared.glob("*.[ch]"))
    names = {source.name for source in sources}
    assert {"module.c", "pageio.h", "publish.c", "envelope.c", "envelope_layout.h"} <= names
    newer = [source.name for source in sources if source.stat().st_mtime > built.stat().st_mtime]
    assert not newer, (
        f"{built.name} is older than {', '.join(newer)}: rebuild it with "
        "`pip install --no-deps -e .`"
    )


def test_a_forked_child_never_writes_into_its_parents_spare(
    make: Callable[..., Setup],
) -> None:
    setup = make(compiled_io=True, io_threads=1, fsync="page")
    assert setup.put_all() == [True] * PAGES
    _overwrite(setup, 0)  # the thread that wrote it now holds a spare
    spares = setup.backend._spares
    ((writer, held),) = spares._by_thread.items()
    pid = os.fork()
    if pid == 0:  # the child: the writer's thread ident, inherited descriptors and locks
        threading.get_ident = lambda: writer
        code = 0 if spares.take() is None else 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert spares._by_thread[writer] == held  # the parent's, untouched
    assert Path(os.fsdecode(held[1])).exists()


@pytest.mark.parametrize("compiled_io", [True, False], ids=["compiled", "python"])
def test_pages_of_more_regions_than_one_system_call_takes(
    tmp_path: Path, compiled_io: bool
) -> None:
    # layer_first cuts a page into one region per layer and K/V: 1200 + the header slot,
    # more than the 1024 regions (IOV_MAX) one preadv / pwritev accepts
    geometry = KVGeometry.mha(num_layers=600, num_kv_heads=1, head_dim=8, page_size=1)
    pool = HostPool(geometry, "layer_first", num_pages=4, pin_memory=False)
    assert len(pool.page_buffers(0)) > 1024
    for page in range(2):
        for extent in pool.extents(page):
            extent.view[:] = os.urandom(extent.length)
    keys = PageKeyer(Namespace("regions", geometry.fingerprint), 1).keys([1, 2])
    config = FileConfig(root=tmp_path, min_free_bytes=0, compiled_io=compiled_io)
    backend = FileBackend(config)
    try:
        store = PageStore(backend, pool, fingerprint=geometry.fingerprint)
        assert store.put(keys, [0, 1]) == [True, True]
        assert store.put(keys, [0, 1]) == [True, True]  # overwrites (in place)
        assert store.get(keys, [2, 3]) == [True, True]
        for page in range(2):
            payload = [bytes(e.view) for e in pool.extents(page)]
            assert [bytes(e.view) for e in pool.extents(page + 2)] == payload
        assert backend.stats().get("get_errors", 0) == 0
    finally:
        backend.close()


def test_o_direct_pages_round_trip_and_recycle(tmp_path: Path) -> None:
    geometry = KVGeometry.mha(num_layers=2, num_kv_heads=8, head_dim=128, page_size=16)
    pool = HostPool(geometry, "page_first_direct", num_pages=8, pin_memory=False)
    for page in range(4):
        for extent in pool.extents(page):
            extent.view[:] = os.urandom(extent.length)
    keys = PageKeyer(Namespace("direct", geometry.fingerprint), 1).keys([1, 2, 3, 4])
    config = FileConfig(root=tmp_path, min_free_bytes=0, o_direct=True, io_threads=1)
    backend = FileBackend(config)
    try:
        store = PageStore(backend, pool, fingerprint=geometry.fingerprint)
        assert store.put(keys, [0, 1, 2, 3]) == [True] * 4
        first = os.stat(fs_paths.page_path_str(os.fspath(backend.store), keys[0])).st_ino
        assert store.put(keys, [0, 1, 2, 3]) == [True] * 4  # overwrites: recycled files
        second = os.stat(fs_paths.page_path_str(os.fspath(backend.store), keys[1])).st_ino
        assert second == first
        assert store.get(keys, [4, 5, 6, 7]) == [True] * 4
        for page in range(4):
            want = [bytes(e.view) for e in pool.extents(page)]
            assert [bytes(e.view) for e in pool.extents(page + 4)] == want
        assert backend.stats().get("o_direct_fallbacks", 0) == 0
    finally:
        backend.close()


def test_the_compiled_envelope_layout_is_the_python_one() -> None:
    # (every layout value: tests/test_envelope_layout.py)
    from kvtier.core import envelope, envelope_layout

    pageio = compiled._pageio
    assert round(WRITER_WAIT * 1e9) == pageio.WRITER_WAIT_NS  # both loops wait as long
    assert envelope_layout.disagreement(pageio) is None
    assert envelope.HEADER.size == pageio.HEADER_BYTES


# --- files kvtier must never write into or publish (found by hostile tests) ----------

#: The ways a store writes over a replaced page: (backend options, uring).
_RECYCLERS = [({}, False), ({"fsync": "page"}, False), ({}, True)]
_RECYCLER_IDS = ["file", "file-fsync-page", "uring"]


def _spares(setup: Setup) -> list[Path]:
    return sorted(setup.store_dir.rglob(f".*{fs_paths.TEMP_SUFFIX}"))


@pytest.mark.parametrize(("options", "uring"), _RECYCLERS, ids=_RECYCLER_IDS)
def test_a_hard_linked_page_file_is_never_written_into(
    make: Callable[..., Setup], tmp_path: Path, options: dict[str, object], uring: bool
) -> None:
    # put k0; ln k0's file outside the root; put k0; put k1: the outside name must keep
    # k0's old bytes (k1 was once written into the linked file, as a recycled spare)
    setup = make(compiled_io=True, io_threads=1, uring=uring, **options)
    assert setup.store.put(setup.keys[:1], [0]) == [True]
    outside = tmp_path / "outside-link"
    os.link(setup.path(0), outside)
    old = outside.read_bytes()
    _overwrite(setup, 0)
    assert setup.store.put(setup.keys[1:2], [1]) == [True]
    _overwrite(setup, 2 if uring else 1)
    assert outside.read_bytes() == old
    assert os.stat(outside).st_nlink == 1  # the store dropped its own name of it
    assert setup.backend.stats()["recycle_refused"] == 1
    assert setup.store.get(setup.keys[:2], [PAGES, PAGES + 1]) == [True, True]
    assert setup.payload(PAGES) == setup.payload(0)
    assert setup.payload(PAGES + 1) == setup.payload(1)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize(("options", "uring"), _RECYCLERS, ids=_RECYCLER_IDS)
def test_a_page_file_of_another_owner_is_never_written_into(
    make: Callable[..., Setup], options: dict[str, object], uring: bool
) -> None:
    setup = make(compiled_io=True, io_threads=1, uring=uring, **options)
    assert setup.store.put(setup.keys[:1], [0]) == [True]
    os.chown(setup.path(0), 4242, 4242)
    held = os.open(setup.path(0), os.O_RDONLY)  # (no lock: the writer must not wait for it)
    try:
        old = os.pread(held, 1 << 20, 0)
        _overwrite(setup, 0)  # neither in place nor kept as a spare
        assert setup.store.put(setup.keys[1:2], [1]) == [True]
        assert os.pread(held, 1 << 20, 0) == old
        assert os.fstat(held).st_ino != os.stat(setup.path(0)).st_ino
        assert os.fstat(held).st_ino != os.stat(setup.path(1)).st_ino
    finally:
        os.close(held)
    assert setup.backend.stats()["recycle_refused"] == 1
    assert setup.backend.stats().get("puts_in_place", 0) == 0
    assert setup.store.get(setup.keys[:2], [PAGES, PAGES + 1]) == [True, True]


def test_a_spare_linked_after_it_was_kept_is_never_written_into(
    make: Callable[..., Setup], tmp_path: Path
) -> None:
    setup = make(compiled_io=True, io_threads=1, fsync="page")
    assert setup.store.put(setup.keys[:1], [0]) == [True]
    _overwrite(setup, 0)  # k0's old file is the spare now, under a temp name
    (spare,) = _spares(setup)
    outside = tmp_path / "outside-link"
    os.link(spare, outside)
    old = outside.read_bytes()
    assert setup.store.put(setup.keys[1:2], [1]) == [True]
    assert outside.read_bytes() == old
    assert setup.backend.stats()["recycle_refused"] == 1
    assert setup.store.get(setup.keys[:2], [PAGES, PAGES + 1]) == [True, True]
    assert setup.payload(PAGES + 1) == setup.payload(1)


def _take_name(path: Path, kind: str, *, aside: bool = False) -> None:
    """Put another entry of ``kind`` under ``path``, as a stray process or hand might.

    ``aside``: the file that held the name is moved to another name in its directory
    (still linked once), else unlinked.
    """
    if aside:
        os.rename(path, path.with_name("moved-aside"))
    else:
        os.unlink(path)
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to("/etc/hostname")
    else:
        path.write_bytes(b"a file some other writer left")


@pytest.mark.parametrize("aside", [True, False], ids=["moved-aside", "unlinked"])
@pytest.mark.parametrize("kind", ["directory", "symlink", "file"])
@pytest.mark.parametrize("variant", ["file-fsync-page", "file-other-writer", "uring-other-writer"])
def test_a_spare_whose_name_was_taken_is_never_published(
    make: Callable[..., Setup], kind: str, variant: str, aside: bool
) -> None:
    # a put reports True only when its page is what a get then finds: the spare is
    # dropped (unlinked) or written and refused at its publish (moved aside), and the
    # page goes into a fresh file
    uring = variant.startswith("uring")
    if variant == "file-fsync-page":
        setup = make(compiled_io=True, io_threads=1, fsync="page")
        assert setup.store.put(setup.keys[:1], [0]) == [True]
        _overwrite(setup, 0)
    else:  # another process wrote the pages, so this one's overwrites exchange
        setup = make(compiled_io=True, io_threads=1, uring=uring)
        other = make(compiled_io=True, io_threads=1, uring=uring)
        assert other.put_all() == [True] * PAGES
        _overwrite(setup, 0)
    (spare,) = _spares(setup)
    _take_name(spare, kind, aside=aside)
    _overwrite(setup, 1)
    assert setup.backend.stats().get("put_temp_taken", 0) == (1 if aside else 0)
    assert setup.backend.stats().get("recycle_refused", 0) == 0
    assert setup.store.get(setup.keys[:2], [PAGES, PAGES + 1]) == [True, True]
    assert setup.payload(PAGES + 1) == setup.payload(1)
    assert Path(setup.path(1)).is_file() and not Path(setup.path(1)).is_symlink()


@pytest.mark.parametrize("uring", [False, True], ids=["file-python-loop", "uring-ring"])
def test_a_temp_name_taken_before_its_rename_publishes_nothing(
    make: Callable[..., Setup], monkeypatch: pytest.MonkeyPatch, uring: bool
) -> None:
    from kvtier.backends.filestore import writes

    setup = make(compiled_io=False, io_threads=1, uring=uring)
    assert setup.put_all() == [True] * PAGES
    old = Path(setup.path(0)).read_bytes()
    write = writes.pwritev_all

    def then_take_the_name(fd: int, views: list[memoryview]) -> int:
        done = write(fd, views)
        (tmp,) = _spares(setup)
        _take_name(tmp, "directory")
        return done

    monkeypatch.setattr(writes, "pwritev_all", then_take_the_name)
    for extent in setup.pool.extents(0):
        extent.view[:] = os.urandom(extent.length)
    assert setup.store.put(setup.keys[:1], [0]) == [False]  # nothing was published
    monkeypatch.setattr(writes, "pwritev_all", write)
    assert setup.backend.stats()["put_temp_taken"] == 1
    assert Path(setup.path(0)).read_bytes() == old  # the old page, still whole
    assert setup.store.get(setup.keys[:1], [PAGES]) == [True]


def test_publish_undoes_an_exchange_with_an_entry_that_took_the_temp_name(
    tmp_path: Path,
) -> None:
    from kvtier.backends.filestore import publish

    final, tmp = tmp_path / "page.kv", tmp_path / ".page.tmp"
    final.write_bytes(b"old page")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"new page")
    written = publish.file_id(fd)
    os.close(fd)
    os.rename(tmp, tmp_path / "moved")  # (kept: its inode number is not reused)
    tmp.write_bytes(b"someone else's file")  # a regular file, but not the one written
    with pytest.raises(publish.TempTaken):
        publish.publish(tmp, final, written=written)
    assert final.read_bytes() == b"old page"
    assert tmp.read_bytes() == b"someone else's file"


# --- a move that publishes what is not ours (step 4 of the publish protocol) --------------

#: Loaded with LD_PRELOAD into a writer's process, the other party of the moment between
#: the writer's check of its temp name (step 2) and its move (step 3), or between the move
#: and its check of the page's name (step 4): the first ``$SWAP_CALL`` (``rename`` or
#: ``renameat2``) onto a name ending in ``/$SWAP_NAME`` either first moves its source to
#: ``$SWAP_ASIDE`` and puts a foreign regular file under the source's name
#: (``SWAP_WHEN=before``), or once it is done renames ``$SWAP_OVER`` (another writer's
#: page of the key) over the name (``SWAP_WHEN=after``); once a case (``$SWAP_ASIDE``).
#: The C steps' calls reach it (glibc's renameat2 wrapper, rename), and so do the Python
#: steps' (ctypes' renameat2, os.replace).
_SWAP_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char fired[4096]; /* the case ($SWAP_ASIDE) it acted in: once a case */

static int
chosen(const char *call, const char *to, const char *when)
{
    const char *name = getenv("SWAP_NAME"), *wanted = getenv("SWAP_CALL");
    const char *moment = getenv("SWAP_WHEN"), *aside = getenv("SWAP_ASIDE");
    if (!name || !wanted || !moment || !aside || strcmp(call, wanted) || strcmp(moment, when))
        return 0;
    size_t n = strlen(name), t = strlen(to);
    if (t <= n || to[t - n - 1] != '/' || strcmp(to + t - n, name) != 0) return 0;
    if (strcmp(fired, aside) == 0 || strlen(aside) >= sizeof fired) return 0;
    strcpy(fired, aside);
    return 1;
}

static int
real_rename(const char *from, const char *to)
{
    int (*forward)(const char *, const char *) = dlsym(RTLD_NEXT, "rename");
    return forward(from, to);
}

static void
take_the_name(const char *call, const char *from, const char *to)
{
    if (!chosen(call, to, "before") || real_rename(from, getenv("SWAP_ASIDE")) != 0) return;
    int fd = open(from, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    static const char foreign[] = "a file some other writer left";
    if (fd >= 0 && write(fd, foreign, sizeof foreign - 1) >= 0) close(fd);
}

static void
replace_ours(const char *call, const char *to, int moved)
{
    if (moved == 0 && chosen(call, to, "after")) real_rename(getenv("SWAP_OVER"), to);
}

int
rename(const char *from, const char *to)
{
    take_the_name("rename", from, to);
    int moved = real_rename(from, to);
    replace_ours("rename", to, moved);
    return moved;
}

int
renameat2(int from_dir, const char *from, int to_dir, const char *to, unsigned int flags)
{
    int (*forward)(int, const char *, int, const char *, unsigned int) =
        dlsym(RTLD_NEXT, "renameat2");
    take_the_name("renameat2", from, to);
    int moved = forward(from_dir, from, to_dir, to, flags);
    replace_ours("renameat2", to, moved);
    return moved;
}
"""

#: One process (the shim preloaded) serving every case: a line ``root kind compiled_io
#: fsync call when`` in, a JSON line out. ``call`` is the move taken: ``renameat2`` (an
#: exchange over the key's page, put first) or ``rename`` (a new key).
_SWAPPER = """
import json
import os
import shutil
import sys
from pathlib import Path

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import paths
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.pagestore import PageStore

FOREIGN = b"a file some other writer left"
geometry = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4)
key = PageKeyer(Namespace("swapped", geometry.fingerprint), geometry.page_size).keys(
    list(range(geometry.page_size))
)[0]


def open_store(root, kind, compiled_io, fsync, pool):
    options = dict(root=root, min_free_bytes=0, compiled_io=compiled_io, fsync=fsync)
    if kind == "uring":
        from kvtier.backends.uring import UringConfig
        from kvtier.backends.uring.backend import UringBackend

        backend = UringBackend(UringConfig(**options))
    else:
        backend = FileBackend(FileConfig(io_threads=1, **options))
    return backend, PageStore(backend, pool, fingerprint=geometry.fingerprint)


def payload(pool, page):
    return b"".join(bytes(e.view) for e in pool.extents(page))


print("ready", flush=True)
for line in sys.stdin:
    root, kind, compiled_io, fsync, call, when = line.split()
    root = Path(root)
    pool = HostPool(geometry, "page_first", num_pages=3, pin_memory=False)
    for page in (0, 1):
        for extent in pool.extents(page):
            extent.view[:] = os.urandom(extent.length)
    backend, store = open_store(root, kind, compiled_io == "1", fsync, pool)
    final = Path(paths.page_path_str(os.fspath(backend.store), key))
    aside, over = root.parent / (root.name + "-aside"), root.parent / (root.name + "-over")
    if when == "after":  # another process's page of the key (this one's index lacks it,
        other, other_store = open_store(root, kind, compiled_io == "1", fsync, pool)
        assert other_store.put([key], [0]) == [True]  # so no put of it goes in place)
        other_store.close()
        other.close()
        shutil.copyfile(final, over)  # the page it will publish over ours
    elif call == "renameat2":
        assert store.put([key], [0]) == [True]  # the key's page: the move exchanges
    os.environ.update(
        SWAP_NAME=final.name, SWAP_CALL=call, SWAP_WHEN=when,
        SWAP_ASIDE=str(aside), SWAP_OVER=str(over),
    )
    put = store.put([key], [1])
    for name in ("SWAP_NAME", "SWAP_CALL", "SWAP_WHEN"):
        del os.environ[name]
    got = store.get([key], [2])
    read = payload(pool, 2)
    there = final.read_bytes() if final.exists() else b""
    print(json.dumps({
        "put": put[0],
        "get": got[0],
        "page": "new" if read == payload(pool, 1) else "old" if read == payload(pool, 0) else "-",
        "final": "foreign" if there == FOREIGN else "page" if there else "none",
        "swapped": aside.exists() or (when == "after" and not over.exists()),
        "temp_taken": backend.stats().get("put_temp_taken", 0),
    }), flush=True)
    store.close()
    backend.close()
"""


def _shim(here: Path, code: str) -> Path:
    """Build ``code`` into a shared object under ``here``, to be preloaded (LD_PRELOAD)."""
    if not compiled.available():
        pytest.skip(f"the compiled loop is not built: {compiled.MISSING}")
    source, shim = here / "shim.c", here / "shim.so"
    source.write_text(code)
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    build = [*cc, "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"]
    built = subprocess.run(build, capture_output=True, text=True)
    if built.returncode:  # (the compiler that builds the compiled loop)
        require("compiled", f"cc cannot build the test's shim: {built.stderr.strip()}")
    return shim


@pytest.fixture(scope="module")
def swapper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., dict[str, Any]]]:
    """A writer's process with :data:`_SWAP_SHIM` preloaded; call it with a case."""
    here = tmp_path_factory.mktemp("swapper")
    shim = _shim(here, _SWAP_SHIM)
    env = dict(os.environ, LD_PRELOAD=str(shim))
    with subprocess.Popen(
        [sys.executable, "-c", _SWAPPER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as server:
        assert server.stdin is not None and server.stdout is not None
        stdin, stdout = server.stdin, server.stdout
        assert stdout.readline().strip() == "ready"
        cases = itertools.count()

        def run(kind: str, compiled_io: bool, fsync: str, call: str, when: str) -> dict[str, Any]:
            root = here / f"case{next(cases)}"
            stdin.write(f"{root} {kind} {int(compiled_io)} {fsync} {call} {when}\n")
            stdin.flush()
            answer = stdout.readline()
            assert answer, "the writer's process ended"
            result: dict[str, Any] = json.loads(answer)
            return result

        yield run
        stdin.close()
        server.wait(timeout=60)
    assert server.returncode == 0


#: (backend, compiled_io, fsync, the move taken): every loop's exchange and rename. With
#: compiled_io on, the compiled loop writes (file: fsync "none" and "page"; uring: "none")
#: or the backend's own loop writes and the C steps publish (file "batch", the ring's
#: "page" and "batch"); off, every step is Python's.
_SWAPPED = [
    ("file", True, "page", "renameat2"),  # (fsync: the compiled loop would go in place)
    ("file", True, "none", "rename"),
    ("uring", True, "none", "rename"),
    ("file", True, "batch", "renameat2"),
    ("file", True, "batch", "rename"),
    ("uring", True, "page", "renameat2"),
    ("uring", True, "batch", "rename"),
    ("file", False, "none", "renameat2"),
    ("file", False, "none", "rename"),
    ("uring", False, "none", "renameat2"),
    ("uring", False, "none", "rename"),
    ("uring", False, "batch", "rename"),
]


def _writer(kind: str, compiled_io: bool, fsync: str) -> str:
    """Which loop writes the page and which language publishes it, for test ids."""
    if compiled_io and fsync in ("none", "page" if kind == "file" else "none"):
        return "compiled"
    loop = "ring" if kind == "uring" else "python"
    return f"{loop}-{'c-steps' if compiled_io else 'python-steps'}"


_SWAPPED_IDS = [
    f"{kind}-{_writer(kind, compiled_io, fsync)}-{fsync}"
    f"-{'exchange' if call == 'renameat2' else 'rename'}"
    for kind, compiled_io, fsync, call in _SWAPPED
]


@pytest.mark.parametrize(("kind", "compiled_io", "fsync", "call"), _SWAPPED, ids=_SWAPPED_IDS)
def test_a_file_swapped_into_the_temp_name_at_the_move_is_never_published(
    swapper: Callable[..., dict[str, Any]], kind: str, compiled_io: bool, fsync: str, call: str
) -> None:
    # another regular file takes the temp name between the writer's check of it and its
    # move, so the move puts that file under the page's name: step 4 finds it is not the
    # file written. An exchange is undone (the old page is back); after a rename the file
    # is left under the page's name (not ours to remove: see publish.py step 4). The
    # compiled loop then writes the page again through the backend's own loop (True, the
    # new page); the others report False. The C steps and the Python ones agree
    if kind == "uring":
        _require_uring()
    done = swapper(kind, compiled_io, fsync, call, "before")
    assert done["swapped"], "the shim did not take the temp name"
    assert done["temp_taken"] == 1
    if _writer(kind, compiled_io, fsync) == "compiled":
        assert (done["put"], done["get"], done["page"]) == (True, True, "new")
    elif call == "renameat2":
        assert (done["put"], done["get"], done["page"]) == (False, True, "old")
    else:
        assert (done["put"], done["get"], done["final"]) == (False, False, "foreign")


#: (backend, compiled_io, fsync): the compiled loop, the C steps after the backend's own
#: loop, and the Python fallback, each under both backends.
_REPLACED_AFTER = [
    ("file", True, "none"),
    ("uring", True, "none"),
    ("file", True, "batch"),
    ("uring", True, "page"),
    ("file", False, "none"),
    ("uring", False, "none"),
]


@pytest.mark.parametrize(
    ("kind", "compiled_io", "fsync"),
    _REPLACED_AFTER,
    ids=[f"{k}-{_writer(k, c, f)}-{f}" for k, c, f in _REPLACED_AFTER],
)
def test_another_writers_page_moved_over_ours_after_the_move_is_no_failure(
    swapper: Callable[..., dict[str, Any]], kind: str, compiled_io: bool, fsync: str
) -> None:
    # another process's page of the key replaces ours between the move and its check:
    # ours was published, then replaced. Its envelope (this store's, the key's, of the
    # payload's length) tells step 4 it is a page of the key, not a foreign file: one
    # rule, the same answer from the C steps and the Python ones
    if kind == "uring":
        _require_uring()
    done = swapper(kind, compiled_io, fsync, "renameat2", "after")
    assert done["swapped"], "the shim did not replace the page"
    assert done["temp_taken"] == 0
    assert (done["put"], done["get"], done["page"]) == (True, True, "old")


#: Preloaded, refuses every exchange onto a name ending in ``/$BUSY_NAME`` with
#: ``$BUSY_ERRNO`` (EBUSY where unset, as for a mount point), counting them in
#: ``busy_calls``: the C steps' renameat2 and the Python steps' (ctypes) both reach it.
_BUSY_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

int busy_calls;

int
renameat2(int from_dir, const char *from, int to_dir, const char *to, unsigned int flags)
{
    const char *name = getenv("BUSY_NAME"), *code = getenv("BUSY_ERRNO");
    size_t n = name ? strlen(name) : 0, t = strlen(to);
    if (n && t > n && to[t - n - 1] == '/' && strcmp(to + t - n, name) == 0) {
        busy_calls++;
        errno = code ? atoi(code) : EBUSY;
        return -1;
    }
    int (*forward)(int, const char *, int, const char *, unsigned int) =
        dlsym(RTLD_NEXT, "renameat2");
    return forward(from_dir, from, to_dir, to, flags);
}
"""

#: A put over a directory at the page's name, its exchange refused: ``root writer`` in,
#: where ``writer`` is ``compiled`` (the compiled loop), ``c-steps`` (the backend's own
#: loop, raw pages, the C steps) or ``python-steps`` (compiled_io off).
_BUSY_WRITER = """
import json, os, sys
from pathlib import Path

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import paths
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.pagestore import PageStore

writer = sys.argv[2]
geometry = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4)
key = PageKeyer(Namespace("busy", geometry.fingerprint), geometry.page_size).keys([1, 2, 3, 4])[0]
pool = HostPool(geometry, "page_first", num_pages=1, pin_memory=False)
config = FileConfig(
    root=sys.argv[1], min_free_bytes=0, io_threads=1, compiled_io=writer != "python-steps"
)
backend = FileBackend(config)
store = PageStore(backend, pool, fingerprint=geometry.fingerprint)
final = Path(paths.page_path_str(os.fspath(backend.store), key))
for directory in (final.parent.parent, final.parent, final):  # a directory at the page
    directory.mkdir(mode=0o700, exist_ok=directory != final)
os.environ["BUSY_NAME"] = final.name
put = backend.put([key], [pool.extents(0)]) if writer == "c-steps" else store.put([key], [0])
print(json.dumps({
    "put": put,
    "compiled": backend.checks_envelopes and writer == "compiled",
    "left": sorted(p.name for p in final.parent.iterdir()),
    "failed_io": backend.stats().get("put_failed_io", 0),
}))
"""


def _preloaded(shim: Path, script: str, *args: str) -> dict[str, Any]:
    """Run ``script`` with ``shim`` preloaded; its last line of output, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=dict(os.environ, LD_PRELOAD=str(shim)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("writer", ["compiled", "c-steps", "python-steps"])
def test_a_refused_exchange_reports_false_and_publishes_nothing(
    tmp_path: Path, writer: str
) -> None:
    # the counterpart of test_store_debris's refused exchange for every writer: the
    # exchange over what holds the page's name fails (EBUSY, a mount point); the compiled
    # loop leaves the page to FileStore.publish_page, whose C steps fail the same way, as
    # do the Python steps: False, nothing published, no temp
    shim = _shim(tmp_path, _BUSY_SHIM)
    result = _preloaded(shim, _BUSY_WRITER, str(tmp_path / "root"), writer)
    assert result["compiled"] == (writer == "compiled"), "the put took another loop"
    assert result["put"] == [False] and result["failed_io"] == 1
    assert len(result["left"]) == 1 and result["left"][0].endswith(fs_paths.PAGE_SUFFIX)
    final = next((tmp_path / "root").rglob(f"*{fs_paths.PAGE_SUFFIX}"))
    assert final.is_dir()  # still there, untouched


_NO_EXCHANGE = """
import ctypes, errno, json, os, sys
from pathlib import Path

from kvtier.backends.filestore import paths, publish

root, compiled_steps = Path(sys.argv[1]), sys.argv[2] == "1"
root.mkdir()
final = root / "page.kv"
final.write_bytes(b"old")
os.environ.update(BUSY_NAME=final.name, BUSY_ERRNO=str(errno.EINVAL))
pages = []
for content in (b"new", b"newer"):
    fd, tmp = paths.open_temp(final)
    os.write(fd, content)
    os.close(fd)
    publish.publish(tmp, final, compiled=compiled_steps)
    pages.append(final.read_bytes().decode())
print(json.dumps({
    "pages": pages,
    "calls": ctypes.c_int.in_dll(ctypes.CDLL(None), "busy_calls").value,
    "exchange": publish.exchange_supported(),
    "left": sorted(p.name for p in root.iterdir()),
}))
"""


@pytest.mark.parametrize("compiled_steps", [True, False], ids=["c-steps", "python-steps"])
def test_the_steps_fall_back_to_rename_without_exchange(
    tmp_path: Path, compiled_steps: bool
) -> None:
    # a filesystem that cannot exchange (EINVAL): the page is renamed over instead, and
    # no later publish tries the exchange again, whichever language runs the steps
    shim = _shim(tmp_path, _BUSY_SHIM)
    result = _preloaded(shim, _NO_EXCHANGE, str(tmp_path / "root"), str(int(compiled_steps)))
    assert result == {"pages": ["new", "newer"], "calls": 1, "exchange": False, "left": ["page.kv"]}


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename"])
@pytest.mark.parametrize("same_key", [True, False], ids=["page-of-the-key", "other-bytes"])
def test_a_page_another_writer_moved_over_ours_is_told_by_its_leading_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool, same_key: bool
) -> None:
    # two writers put one key: the second's move lands between the first's move and its
    # check (the Python steps, whose move can be interleaved here; the C steps' is by the
    # swap shim above). A file whose leading bytes (the envelope up to its payload
    # checksum) are the first's is a page of the key: both were published, no temp file is
    # left. Other leading bytes (raw pages only: one key's envelopes agree) are not: the
    # first reports TempTaken, and undoes its exchange
    from kvtier.backends.filestore import publish

    final = tmp_path / "page.kv"
    if exchange:
        final.write_bytes(b"old page")
    head = os.urandom(publish.SAME_PAGE_PREFIX)

    def written(content: bytes) -> tuple[str, publish.FileId]:
        fd, tmp = fs_paths.open_temp(final)
        os.write(fd, content)
        written = publish.file_id(fd)
        os.close(fd)
        return os.fspath(tmp), written

    first = written(head + b"first")
    second_bytes = (head if same_key else os.urandom(len(head))) + b"second"
    second = written(second_bytes)
    move = publish.move

    def then_the_second(tmp: str, target: str, debris: object = None) -> bool:
        moved = move(tmp, target)
        monkeypatch.setattr(publish, "move", move)
        publish.publish(second[0], final, written=second[1], compiled=False)
        return moved

    monkeypatch.setattr(publish, "move", then_the_second)
    if same_key:
        publish.publish(first[0], final, written=first[1], compiled=False)
    else:
        with pytest.raises(publish.TempTaken):
            publish.publish(first[0], final, written=first[1], compiled=False)
    left = sorted(p.name for p in tmp_path.iterdir())
    if same_key or not exchange:
        assert final.read_bytes() == second_bytes and left == ["page.kv"]
    else:  # the first's exchange undone: the old page is back, whole; the second's page
        assert final.read_bytes() == b"old page" and len(left) == 2  # left to the sweep
