"""A save whose source memory is taken back mid-write never becomes a valid page.

vLLM's CPU engine stores pages straight from its blocks, and a preempted request's blocks
are reused after ``preempt_wait_s`` even if its store still runs. The worker then trips
the save's :class:`~kvtier.core.saveguard.SaveGuard`: no page of it is checksummed from
the reused blocks any more (an envelope that never verifies is written instead), the put
reports its pages False, and they are deleted once the call returns. Driven here with a
file backend that stalls a put between pages (the core's envelope runs in its I/O
thread), and a second reader on the same root that reads in the window between the
publish and the delete, as another engine sharing the store may.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cache import shared_backend
from test_vllm import BLOCK, _kv_cache_config, _vllm_config

from kvtier.backends.file import FileConfig
from kvtier.backends.file.backend import FileBackend
from kvtier.core.envelope import Rejection
from kvtier.core.errors import PageError, UnsupportedCombinationError
from kvtier.core.extents import Extent
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.pagestore import PageStore, PerPageHooks
from kvtier.core.saveguard import SaveGuard
from kvtier.core.storage import PageBuffers, StorageBackend
from kvtier.integrations.vllm import VLLMSection
from kvtier.integrations.vllm.messages import PageOp
from kvtier.integrations.vllm.plan import resolve_plan
from kvtier.integrations.vllm.worker import WorkerSide

GEOMETRY = KVGeometry.mha(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4)
JOIN = 10.0
NAMES = ["model.layers.0.a", "model.layers.1.a"]
INDEX = {name: i for i, name in enumerate(NAMES)}


class StallingFile(StorageBackend):
    """A file backend (one I/O thread, so pages go in order) whose put stalls at page
    ``at`` until released: before the core writes its envelope, or just after it (before
    its bytes are written). ``published`` runs once the pages are on disk, before the put
    returns (a reader sharing the store may look then)."""

    checks_envelopes = False  # the core's envelope in the I/O thread, page by page

    def __init__(self, root: Path, *, at: int, after_envelope: bool = False) -> None:
        self.inner = FileBackend(FileConfig(root=root, min_free_bytes=0, io_threads=1))
        self.at = at
        self.after_envelope = after_envelope
        self.reached = threading.Event()
        self.release = threading.Event()
        self.published: Callable[[], None] | None = None

    def put_with(
        self,
        keys: Sequence[str],
        pages: Sequence[Sequence[Extent]],
        before_write: Callable[[int], object],
    ) -> list[bool]:
        def stalling(i: int) -> None:
            if i == self.at and not self.after_envelope:
                self.reached.set()
                assert self.release.wait(JOIN)
            before_write(i)
            if i == self.at and self.after_envelope:
                self.reached.set()
                assert self.release.wait(JOIN)

        results = self.inner.put_with(keys, pages, stalling)
        if self.published is not None:
            self.published()
        return results

    def get_with(
        self,
        keys: Sequence[str],
        pages: Sequence[Sequence[Extent]],
        on_filled: Callable[[int], object],
        on_payload: Callable[[int, memoryview], object] | None = None,
    ) -> list[bool]:
        return self.inner.get_with(keys, pages, on_filled, on_payload)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        return self.inner.get(keys, pages)

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        return self.put_with(keys, pages, lambda _i: None)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, int | float]:
        return self.inner.stats()

    def close(self) -> None:
        self.release.set()
        self.inner.close()


def _payload(pool: HostPool, page: int) -> bytes:
    return b"".join(bytes(e.view) for e in pool.extents(page))


def _scribble(pool: HostPool, page: int) -> None:
    """What the engine does with memory it took back: other bytes."""
    for extent in pool.extents(page):
        extent.view[:] = os.urandom(extent.length)


class _Reader:
    """A second page store on the same root (another engine sharing the store)."""

    def __init__(self, root: Path, verify: Any = "full") -> None:
        self.pool = HostPool(GEOMETRY, "page_first", num_pages=4, pin_memory=False)
        backend = FileBackend(FileConfig(root=root, min_free_bytes=0))
        self.store = PageStore(backend, self.pool, fingerprint=GEOMETRY.fingerprint, verify=verify)

    def read(self, keys: list[str]) -> list[bytes | str]:
        """Each key's payload, or the verdict of its miss ("absent" if none)."""
        out: list[bytes | str] = []
        for key in keys:
            verdicts: dict[int, str] = {}
            (ok,) = self.store.get([key], [0], verdicts=verdicts)
            out.append(_payload(self.pool, 0) if ok else verdicts.get(0, "absent"))
        return out


def _setup(
    tmp_path: Path, *, at: int, after_envelope: bool = False
) -> tuple[StallingFile, PageStore, list[str], list[bytes]]:
    root = tmp_path / "shared"
    backend = StallingFile(root, at=at, after_envelope=after_envelope)
    assert isinstance(backend, PerPageHooks)
    pool = HostPool(GEOMETRY, "page_first", num_pages=4, pin_memory=False)
    for page in range(4):
        _scribble(pool, page)
    keys = PageKeyer(Namespace("preempt", GEOMETRY.fingerprint), GEOMETRY.page_size).keys(
        list(range(4 * GEOMETRY.page_size))
    )
    store = PageStore(backend, pool, fingerprint=GEOMETRY.fingerprint, backend_call_timeout_s=JOIN)
    return backend, store, keys, [_payload(pool, page) for page in range(4)]


def _put_in_thread(store: PageStore, keys: list[str], guards: list[SaveGuard | None]) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        box["results"] = store.put(keys, [0, 1, 2, 3], guards=guards)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def test_a_page_enveloped_after_its_guard_tripped_is_never_a_hit(tmp_path: Path) -> None:
    backend, store, keys, original = _setup(tmp_path, at=2)
    reader = _Reader(tmp_path / "shared")
    seen: list[list[bytes | str]] = []
    backend.published = lambda: seen.append(reader.read(keys))
    guard = SaveGuard()
    thread, box = _put_in_thread(store, keys, [guard] * 4)
    assert backend.reached.wait(JOIN)  # pages 0 and 1 are written; 2 and 3 are not
    guard.trip()
    _scribble(store.pool, 2)  # the owner reuses the memory under the write
    _scribble(store.pool, 3)
    changed = {_payload(store.pool, 2), _payload(store.pool, 3)}
    backend.release.set()
    thread.join(JOIN)
    assert box["results"] == [False] * 4  # tainted: none reported stored ...
    assert store.stats()["put_tainted"] == 4  # ... and counted
    seen.append(reader.read(keys))  # read again once the put returned
    for got in seen:
        assert got[:2] == original[:2]  # enveloped before the trip: the key's own bytes
        # enveloped after it: published, but never verifies (not even its header)
        assert got[2:] == [Rejection.BAD_MAGIC.value] * 2
        assert not changed & {g for g in got if isinstance(g, bytes)}
    store.close()
    reader.store.close()


def test_a_page_enveloped_before_the_trip_and_changed_under_its_write_fails_full_verify(
    tmp_path: Path,
) -> None:
    """The checksum is the original bytes': full verification rejects the changed page.
    Header verification cannot see the change, which is why the vLLM worker refuses it."""
    backend, store, keys, original = _setup(tmp_path, at=2, after_envelope=True)
    full, header = _Reader(tmp_path / "shared"), _Reader(tmp_path / "shared", "header")
    guard = SaveGuard()
    thread, box = _put_in_thread(store, keys, [guard] * 4)
    assert backend.reached.wait(JOIN)  # page 2's envelope written, its bytes not yet
    guard.trip()
    _scribble(store.pool, 2)
    changed = _payload(store.pool, 2)
    backend.release.set()
    thread.join(JOIN)
    assert box["results"] == [False] * 4
    got = full.read(keys)
    assert got[:2] == original[:2]
    assert got[2] == Rejection.CORRUPT_CHECKSUM.value  # changed under its write: caught
    assert got[3] == Rejection.BAD_MAGIC.value  # enveloped after the trip
    assert header.read(keys)[2] == changed  # what header-only verification lets through
    for one in (store, full.store, header.store):
        one.close()


def test_unguarded_pages_and_an_untripped_guard_store_as_before(tmp_path: Path) -> None:
    _backend, store, keys, original = _setup(tmp_path, at=-1)
    assert (
        store.put(keys, [0, 1, 2, 3], guards=[SaveGuard(), None, SaveGuard(), None]) == [True] * 4
    )
    assert _Reader(tmp_path / "shared").read(keys) == original
    assert store.stats()["put_tainted"] == 0
    with pytest.raises(PageError, match="one guard"):
        store.put(keys, [0, 1, 2, 3], guards=[None])
    store.close()


def test_a_backend_that_writes_envelopes_itself_is_bypassed_for_guarded_pages(
    tmp_path: Path,
) -> None:
    """The file backend's compiled loop writes envelopes itself (``checks_envelopes``);
    a guarded put goes through the core's envelope instead, so a tripped guard holds."""
    root = tmp_path / "shared"
    backend = FileBackend(FileConfig(root=root, min_free_bytes=0))
    pool = HostPool(GEOMETRY, "page_first", num_pages=4, pin_memory=False)
    for page in range(4):
        _scribble(pool, page)
    keys = PageKeyer(Namespace("own-loop", GEOMETRY.fingerprint), GEOMETRY.page_size).keys(
        list(range(4 * GEOMETRY.page_size))
    )
    store = PageStore(backend, pool, fingerprint=GEOMETRY.fingerprint)
    tripped = SaveGuard()
    tripped.trip()  # taken back before the put even ran
    guards = [SaveGuard(), SaveGuard(), tripped, tripped]
    assert store.put(keys, [0, 1, 2, 3], guards=guards) == [True, True, False, False]
    got = _Reader(root).read(keys)
    assert got[:2] == [_payload(pool, 0), _payload(pool, 1)]
    assert got[2:] == [Rejection.BAD_MAGIC.value] * 2
    store.close()


def test_trip_waits_for_a_checksum_in_progress() -> None:
    guard = SaveGuard()
    inside, leave = threading.Event(), threading.Event()
    order: list[str] = []

    def seal() -> None:
        inside.set()
        assert leave.wait(JOIN)
        order.append("sealed")

    sealer = threading.Thread(target=lambda: guard.sealing(seal, lambda: None))
    sealer.start()
    assert inside.wait(JOIN)
    tripper = threading.Thread(target=lambda: (guard.trip(), order.append("tripped")))
    tripper.start()
    tripper.join(0.1)
    assert tripper.is_alive() and order == []  # trip() has not returned mid-checksum
    leave.set()
    sealer.join(JOIN)
    tripper.join(JOIN)
    assert order == ["sealed", "tripped"]
    refused: list[bool] = []
    assert guard.sealing(lambda: None, lambda: refused.append(True)) is False
    assert refused == [True]


# --- the vLLM worker -----------------------------------------------------------------------


def _worker(backend: StorageBackend, **fields: Any) -> Any:
    registry = shared_backend(backend)
    settings = VLLMSection(**{"backend": "shared", **fields})
    plan = resolve_plan(_vllm_config(), _kv_cache_config(), settings, registry, tp_rank=0)
    worker = WorkerSide(plan, settings)
    caches = {name: torch.randn(16, 2, BLOCK, 128).to(torch.bfloat16) for name in NAMES}
    worker.register(caches, INDEX, 16)
    worker.caches = caches
    return worker


def _block(worker: Any, block: int) -> list[torch.Tensor]:
    return [worker.caches[name][block].clone() for name in NAMES]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_preempted_save_past_its_wait_is_never_loaded_by_another_engine(
    tmp_path: Path,
) -> None:
    root = tmp_path / "shared"
    stalling = StallingFile(root, at=1)  # page 0 written; page 1 stalls before its envelope
    writer = _worker(stalling, preempt_wait_s=0.05, backend_call_timeout_s=JOIN)
    reader = _worker(FileBackend(FileConfig(root=root, min_free_bytes=0)))
    names = writer.names(["p0", "p1"])
    assert reader.names(["p0", "p1"]) == names  # the same keys: one shared store
    original = [_block(writer, 0), _block(writer, 1)]
    loads: list[tuple[list[bool], list[list[torch.Tensor]]]] = []

    def another_engine_loads() -> None:  # pages on disk, tainted ones not deleted yet
        found = list(reader.store.get(names, [4, 5]))
        loads.append((found, [_block(reader, 4), _block(reader, 5)]))

    stalling.published = another_engine_loads
    writer.submit_saves([PageOp("p", ["p0", "p1"], [0, 1], 0)])
    assert stalling.reached.wait(JOIN)
    writer.preempted({"p"})  # the wait passes: tainted; vLLM reuses the blocks now
    for name in NAMES:
        writer.caches[name][1] = torch.randn_like(writer.caches[name][1])
    reused = _block(writer, 1)
    stalling.release.set()
    assert writer.flush()
    loads.append(([*reader.store.get(names, [4, 5])], [_block(reader, 4), _block(reader, 5)]))
    for found, blocks in loads:
        assert not (found[1] and _same(blocks[1], reused))  # never the reused bytes
        assert not found[1]  # page 1 was enveloped after the trip: never a hit
        assert not found[0] or _same(blocks[0], original[0])  # the key's own, or a miss
    assert reader.store.exists(names) == [False, False]  # deleted once the put returned
    stats = writer.stats()
    assert (stats["preempt_wait_timeouts"], stats["save_tainted_pages"]) == (1, 2)
    assert stats["store_put_tainted"] == 2
    assert writer.take_report().stored == {}
    writer.close()
    reader.close()


def test_the_cpu_engine_refuses_header_only_verification(tmp_path: Path) -> None:
    backend = FileBackend(FileConfig(root=tmp_path / "s", min_free_bytes=0))
    with pytest.raises(UnsupportedCombinationError, match='"verify": "full"'):
        _worker(backend, verify="header")
    backend.close()
