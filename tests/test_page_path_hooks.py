"""The page path's per-page work in the backends' I/O threads, and one hand-off per thread.

PageStore hands the file and io_uring backends its envelope writing and verification
(``put_with`` / ``get_with``), so the checksums run in the thread that moves the page;
the file backend cuts a batch into one slice per I/O thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.backends.filestore import paths as fs_paths
from kvtier.core import compiled_envelope
from kvtier.core.envelope import EnvelopeFormat
from kvtier.core.errors import InvalidKeyError
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.pagestore import PageStore, PerPageHooks
from kvtier.core.storage import StorageBackend
from kvtier.testing import require

GEOMETRY = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4)
PAGES = 8


def _uring(root: Path) -> StorageBackend:
    from kvtier.backends.uring import UringConfig, probe_io_uring

    require("uring", probe_io_uring())
    from kvtier.backends.uring.backend import UringBackend

    return UringBackend(UringConfig(root=root, min_free_bytes=0, queue_depth=4))


MAKERS: dict[str, Callable[[Path], StorageBackend]] = {
    "file": lambda root: FileBackend(FileConfig(root=root, min_free_bytes=0, io_threads=4)),
    "uring": _uring,
}


@pytest.fixture(params=sorted(MAKERS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    made = MAKERS[request.param](tmp_path / "store")
    yield made
    made.close()


def _pool() -> tuple[HostPool, list[int], list[str]]:
    pool = HostPool(GEOMETRY, "page_first", num_pages=2 * PAGES, pin_memory=False)
    for page in range(PAGES):
        for extent in pool.extents(page):
            extent.view[:] = os.urandom(extent.length)
    keys = PageKeyer(Namespace("hooks", GEOMETRY.fingerprint), GEOMETRY.page_size).keys(
        list(range(GEOMETRY.page_size * PAGES))
    )
    return pool, list(range(PAGES)), keys


def _payload(pool: HostPool, page: int) -> bytes:
    return b"".join(bytes(e.view) for e in pool.extents(page))


def test_built_in_file_backends_offer_the_hooks(backend: StorageBackend) -> None:
    assert isinstance(backend, PerPageHooks)


def test_verified_round_trip_through_the_hooks(
    backend: StorageBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, pages, keys = _pool()
    store = PageStore(backend, pool, fingerprint=GEOMETRY.fingerprint)
    calls = {"put_with": 0, "get_with": 0}
    for name in calls:
        real = getattr(backend, name)

        def counted(
            *args: object, _real: Callable[..., list[bool]] = real, _n: str = name, **kw: object
        ) -> list[bool]:
            calls[_n] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(backend, name, counted)
    assert store.put(keys, pages) == [True] * PAGES
    targets = [PAGES + p for p in pages]
    assert store.get(keys, targets) == [True] * PAGES
    assert calls == {"put_with": 1, "get_with": 1}  # one batched call each, with hooks
    assert [_payload(pool, PAGES + p) for p in pages] == [_payload(pool, p) for p in pages]
    assert store.stats()["hits"] == PAGES and store.stats()["bytes_read"] > 0


def test_a_corrupt_page_found_by_the_hook_is_a_counted_invalid_miss(
    backend: StorageBackend,
) -> None:
    pool, pages, keys = _pool()
    store = PageStore(backend, pool, fingerprint=GEOMETRY.fingerprint)
    assert store.put(keys, pages) == [True] * PAGES
    path = fs_paths.page_path(backend.store, keys[3])  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # one payload bit
    path.write_bytes(bytes(raw))
    got = store.get(keys, [PAGES + p for p in pages])
    assert got == [i != 3 for i in range(PAGES)]
    assert store.stats()["invalid_corrupt_checksum"] == 1
    header = PageStore(backend, pool, fingerprint=GEOMETRY.fingerprint, verify="header")
    assert header.get(keys[3:4], [PAGES]) == [True]  # header-only mode cannot see it


@pytest.mark.parametrize("envelope", ["python", "compiled"])
def test_file_backend_checksums_in_its_io_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, envelope: str
) -> None:
    # the Python loop's hooks (the compiled loop has its own tests: test_compiled_loop.py),
    # with the core's envelope code in Python or in C (kvtier.core.compiled_envelope)
    if envelope == "compiled":
        require("compiled", None if compiled_envelope.available() else compiled_envelope.MISSING)
    else:
        monkeypatch.setattr(compiled_envelope, "available", lambda: False)
    config = FileConfig(root=tmp_path / "store", min_free_bytes=0, io_threads=4, compiled_io=False)
    backend = FileBackend(config)
    pool, pages, keys = _pool()
    store = PageStore(backend, pool, fingerprint=GEOMETRY.fingerprint)
    threads: dict[str, set[str]] = {"write": set(), "verify": set()}

    def watch(what: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            threads[what].add(threading.current_thread().name)
            return real(*args, **kwargs)

        return watched

    if envelope == "compiled":
        for what, name in (("write", "write_envelopes"), ("verify", "verify_envelopes")):
            monkeypatch.setattr(
                compiled_envelope, name, watch(what, getattr(compiled_envelope, name))
            )
    else:
        monkeypatch.setattr(EnvelopeFormat, "write", watch("write", EnvelopeFormat.write))
        monkeypatch.setattr(EnvelopeFormat, "verify", watch("verify", EnvelopeFormat.verify))
    assert store.put(keys, pages) == [True] * PAGES
    assert store.get(keys, [PAGES + p for p in pages]) == [True] * PAGES
    for what, names in threads.items():
        # the thread calling the backend (the page store's bounded call thread) works the
        # first slice, the pool's threads (reused when idle) the rest
        caller = any(n.startswith("kvtier-backend-call") for n in names)
        assert caller and any(n.startswith("kvtier-file") for n in names), (what, names)
    store.close()


def test_file_backend_hands_off_once_per_thread(tmp_path: Path) -> None:
    backend = FileBackend(FileConfig(root=tmp_path / "s", min_free_bytes=0, io_threads=4))
    seen: list[int] = []
    assert backend._map(lambda i: seen.append(i) or i * 2, 1) == [0]
    assert backend._slices._executor is None  # a one-page batch stays in the calling thread
    submits = 0
    results = backend._map(lambda i: i * 2, 2)  # starts the pool
    executor = backend._slices._executor
    assert executor is not None and results == [0, 2]
    real_submit = executor.submit

    def counting_submit(*args: object, **kwargs: object) -> object:
        nonlocal submits
        submits += 1
        return real_submit(*args, **kwargs)  # type: ignore[arg-type]

    executor.submit = counting_submit  # type: ignore[method-assign]
    assert backend._map(lambda i: i * 2, 33) == [2 * i for i in range(33)]  # in order
    assert submits == 3  # three slices handed off; the calling thread works the fourth
    backend.close()


def test_file_backend_waits_for_every_slice_before_raising(tmp_path: Path) -> None:
    backend = FileBackend(FileConfig(root=tmp_path / "s", min_free_bytes=0, io_threads=4))
    done: list[int] = []
    gate = threading.Event()

    def work(i: int) -> int:
        if i == 0:
            raise RuntimeError("boom")
        gate.wait(0.05)
        done.append(i)
        return i

    with pytest.raises(RuntimeError, match="boom"):
        backend._map(work, 8)
    assert sorted(done) == [2, 3, 4, 5, 6, 7]  # the other slices ran to their end first
    backend.close()


def test_uring_exists_is_one_batched_index_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _uring(tmp_path / "store")
    pool, pages, keys = _pool()
    PageStore(backend, pool, fingerprint=GEOMETRY.fingerprint).put(keys[:4], pages[:4])

    def per_key(key: str) -> bool:
        raise AssertionError("exists must not look keys up one by one")

    monkeypatch.setattr(backend.index, "contains", per_key)  # type: ignore[attr-defined]
    assert backend.exists(keys) == [True] * 4 + [False] * (PAGES - 4)
    with pytest.raises(InvalidKeyError):
        backend.exists([keys[0], "../escape"])
    backend.close()


def test_temp_names_keep_the_type_they_are_given(tmp_path: Path) -> None:
    """The put path passes strings (no Path objects per page); both kinds give the same."""
    final = f"{tmp_path}/aa/bb/k1.kv"
    fd, tmp = fs_paths.open_temp(final)  # makes the shard directories 0700 on demand
    os.close(fd)
    assert isinstance(tmp, str) and os.path.dirname(tmp) == f"{tmp_path}/aa/bb"
    assert os.path.basename(tmp).startswith(f".{os.getpid()}.")
    assert os.stat(tmp).st_mode & 0o777 == fs_paths.FILE_MODE
    assert os.stat(f"{tmp_path}/aa").st_mode & 0o777 == fs_paths.DIR_MODE
    other = fs_paths.temp_path(Path(final))
    assert isinstance(other, Path) and other.parent == Path(tmp).parent
    assert str(other) != tmp  # a fresh name every call


BIG = KVGeometry.mha(num_layers=4, num_kv_heads=8, head_dim=128, page_size=64)  # 1 MiB


def test_file_backend_streams_large_pages_to_the_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page over two pieces is hashed piece by piece as it lands; corruption still shows."""
    from kvtier.backends.file import backend as file_backend

    config = FileConfig(root=tmp_path / "s", min_free_bytes=0, io_threads=2, compiled_io=False)
    backend = FileBackend(config)
    pool = HostPool(BIG, "page_first", num_pages=4, pin_memory=False)
    for page in range(2):
        for extent in pool.extents(page):
            extent.view[:] = os.urandom(extent.length)
    keys = PageKeyer(Namespace("big", BIG.fingerprint), BIG.page_size).keys(
        list(range(BIG.page_size * 2))
    )
    store = PageStore(backend, pool, fingerprint=BIG.fingerprint)
    assert store.put(keys, [0, 1]) == [True, True]
    pieces: list[tuple[int, int]] = []
    real = backend.get_with

    def recording(keys_: object, pages: object, on_filled: object, on_payload: object) -> object:
        def feed(i: int, piece: memoryview) -> None:
            pieces.append((i, piece.nbytes))
            on_payload(i, piece)  # type: ignore[operator]

        return real(keys_, pages, on_filled, feed)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "get_with", recording)
    assert store.get(keys, [2, 3]) == [True, True]
    assert [_payload(pool, 2), _payload(pool, 3)] == [_payload(pool, 0), _payload(pool, 1)]
    payload = sum(e.length for e in pool.extents(0))
    for page in (0, 1):
        sizes = [n for i, n in pieces if i == page]
        assert sum(sizes) == payload and max(sizes) <= file_backend.PIECE and len(sizes) > 2
    path = fs_paths.page_path(backend.store, keys[1])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # a bit in the middle piece
    path.write_bytes(bytes(raw))
    assert store.get(keys, [2, 3]) == [True, False]
    assert store.stats()["invalid_corrupt_checksum"] == 1
    backend.close()
