"""PageStore: envelopes on put, verification on get, prefix hits, and the error boundary."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import pytest

from kvtier.backends.memory.backend import MemoryBackend
from kvtier.core.bounded import Outcome
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import InvalidFieldError, InvalidKeyError, PageError, StorageError
from kvtier.core.extents import Extent, extent_of_view
from kvtier.core.geometry import KVGeometry
from kvtier.core.host_pool import HostPool
from kvtier.core.keys import Namespace, PageKeyer
from kvtier.core.layout import Layout, layouts_for
from kvtier.core.pagestore import PageStore
from kvtier.core.storage import PageBuffers, StorageBackend

FP = "fedcba9876543210"
KEYS = PageKeyer(Namespace("m", FP), page_size=4).keys(list(range(4 * 6)))


class FakePool:
    """A host pool stand-in with HostPool's page API, over plain bytearrays."""

    def __init__(
        self, layout: Layout = Layout.PAGE_FIRST, pages: int = 6, sizes: Sequence[int] = (512, 512)
    ) -> None:
        self.layout = layout
        self.headers = [bytearray(ENVELOPE_BYTES) for _ in range(pages)]
        self.payloads = [[bytearray(n) for n in sizes] for _ in range(pages)]

    def header_extent(self, page: int) -> Extent:
        return extent_of_view(memoryview(self.headers[page]))

    def extents(self, page: int) -> list[Extent]:
        return [extent_of_view(memoryview(b)) for b in self.payloads[page]]

    def page_buffers(self, page: int) -> list[Extent]:
        return [self.header_extent(page), *self.extents(page)]

    def fill_random(self, page: int) -> bytes:
        for buf in self.payloads[page]:
            buf[:] = os.urandom(len(buf))
        return self.payload(page)

    def payload(self, page: int) -> bytes:
        return b"".join(bytes(b) for b in self.payloads[page])

    def wipe(self, page: int) -> None:
        for buf in [self.headers[page], *self.payloads[page]]:
            buf[:] = bytes(len(buf))


class DictBackend(StorageBackend):
    """The storage contract in a dict; records calls and can be told to raise."""

    def __init__(self) -> None:
        self.objects: dict[str, bytearray] = {}
        self.calls: list[str] = []
        self.raise_on: dict[str, BaseException] = {}

    def _enter(self, op: str) -> None:
        self.calls.append(op)
        if op in self.raise_on:
            raise self.raise_on[op]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._enter("exists")
        return [k in self.objects for k in keys]

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._enter("get")
        out = []
        for key, regions in zip(keys, pages, strict=True):
            blob = self.objects.get(key)
            if blob is None or len(blob) < sum(r.length for r in regions):
                out.append(False)
                continue
            offset = 0
            for r in regions:
                r.view[:] = blob[offset : offset + r.length]
                offset += r.length
            out.append(True)
        return out

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._enter("put")
        for key, regions in zip(keys, pages, strict=True):
            self.objects[key] = bytearray(b"".join(r.view for r in regions))
        return [True] * len(keys)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        self._enter("delete")
        return [self.objects.pop(k, None) is not None for k in keys]

    def clear(self) -> None:
        self.objects.clear()

    def close(self) -> None:
        self._enter("close")


class LyingBackend(DictBackend):
    """Says True for every get but copies only ``fill`` bytes (a broken third party)."""

    def __init__(self, fill: int) -> None:
        super().__init__()
        self.fill = fill

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        for key, regions in zip(keys, pages, strict=True):
            blob = self.objects.get(key, bytearray())[: self.fill]
            offset = 0
            for r in regions:
                chunk = blob[offset : offset + r.length]
                r.view[: len(chunk)] = chunk
                offset += r.length
        return [True] * len(keys)


@pytest.fixture(params=["dict", "memory"])
def backend(request: pytest.FixtureRequest) -> StorageBackend:
    return DictBackend() if request.param == "dict" else MemoryBackend()


def test_round_trip_bit_exact(backend: StorageBackend) -> None:
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP)
    data = [pool.fill_random(p) for p in range(3)]
    assert store.put(KEYS[:3], [0, 1, 2]) == [True] * 3
    for p in range(3):
        pool.wipe(p)
    assert store.get(KEYS[:3], [2, 1, 0]) == [True] * 3
    assert [pool.payload(p) for p in (2, 1, 0)] == data
    stats = store.stats()
    assert stats["hits"] == 3 and stats["invalid"] == 0 and stats["misses"] == 0
    page_bytes = ENVELOPE_BYTES + 1024
    assert stats["bytes_written"] == stats["bytes_read"] == 3 * page_bytes


def test_prefix_hits_and_exists(backend: StorageBackend) -> None:
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP)
    assert store.prefix_hits(KEYS) == 0
    store.put([KEYS[0], KEYS[1], KEYS[3]], [0, 1, 3])
    assert store.prefix_hits(KEYS) == 2
    assert store.exists(KEYS[:4]) == [True, True, False, True]
    assert store.prefix_hits([]) == 0


def test_prefix_hits_is_one_batched_call() -> None:
    backend = DictBackend()
    store = PageStore(backend, FakePool(), fingerprint=FP)
    store.prefix_hits(KEYS)
    assert backend.calls == ["exists"]


def test_misses_are_counted(backend: StorageBackend) -> None:
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP)
    store.put(KEYS[:1], [0])
    assert store.get(KEYS[:2], [1, 2]) == [True, False]
    assert store.stats()["misses"] == 1


def test_delete(backend: StorageBackend) -> None:
    store = PageStore(backend, FakePool(), fingerprint=FP)
    store.put(KEYS[:2], [0, 1])
    assert store.delete([KEYS[0], KEYS[5]]) == [True, False]
    assert store.exists(KEYS[:2]) == [False, True]


def stored(backend: DictBackend) -> bytearray:
    (blob,) = backend.objects.values()
    return blob


def put_one(pool: FakePool | None = None, **kwargs: object) -> tuple[DictBackend, FakePool]:
    backend = DictBackend()
    pool = pool or FakePool()
    pool.fill_random(0)
    assert PageStore(backend, pool, fingerprint=FP, **kwargs).put(KEYS[:1], [0]) == [True]  # type: ignore[arg-type]
    return backend, pool


def get_one(
    backend: StorageBackend,
    pool: FakePool | None = None,
    *,
    key: str = KEYS[0],
    verify: str = "full",
    fingerprint: str = FP,
) -> tuple[bool, dict]:
    store = PageStore(backend, pool or FakePool(), fingerprint=fingerprint, verify=verify)  # type: ignore[arg-type]
    (ok,) = store.get([key], [1])
    return ok, store.stats()


@pytest.mark.parametrize(
    ("offset", "reason"),
    [
        (0, "bad_magic"),
        (8, "unsupported_version"),
        (30, "corrupt_header"),
        (60, "corrupt_header"),
        (85, "corrupt_header"),
        (100, "corrupt_header"),
    ],
)
def test_header_bit_flip_is_an_invalid_page(offset: int, reason: str) -> None:
    backend, _ = put_one()
    stored(backend)[offset] ^= 0x01
    ok, stats = get_one(backend)
    assert not ok
    assert stats["invalid"] == 1 and stats[f"invalid_{reason}"] == 1 and stats["hits"] == 0


def test_payload_bit_flip_full_vs_header_mode() -> None:
    backend, _ = put_one()
    stored(backend)[ENVELOPE_BYTES + 700] ^= 0x04
    ok, stats = get_one(backend)
    assert not ok and stats["invalid_corrupt_checksum"] == 1
    ok, stats = get_one(backend, verify="header")
    assert ok and stats["hits"] == 1 and stats["invalid"] == 0


def test_truncated_object_is_a_miss() -> None:
    backend, _ = put_one()
    del stored(backend)[ENVELOPE_BYTES + 100 :]
    ok, stats = get_one(backend)
    assert not ok and stats["misses"] == 1 and stats["hits"] == 0


def test_success_without_a_fill_does_not_pass_a_stale_header() -> None:
    liar = LyingBackend(fill=0)
    pool = FakePool()
    pool.fill_random(0)
    store = PageStore(liar, pool, fingerprint=FP)
    store.put(KEYS[:1], [0])
    # Page 0 holds a valid envelope for this very key from the put above; the store must
    # not accept it when the backend wrote nothing.
    assert store.get(KEYS[:1], [0]) == [False]
    assert store.stats()["invalid_bad_magic"] == 1


def test_short_fill_reported_as_success_is_caught_by_the_checksum() -> None:
    liar = LyingBackend(fill=ENVELOPE_BYTES + 600)
    pool = FakePool()
    pool.fill_random(0)
    store = PageStore(liar, pool, fingerprint=FP)
    store.put(KEYS[:1], [0])
    assert store.get(KEYS[:1], [1]) == [False]
    assert store.stats()["invalid_corrupt_checksum"] == 1


def test_page_under_another_key_is_rejected() -> None:
    backend, _ = put_one()
    backend.objects[KEYS[1]] = bytearray(stored(backend))
    ok, stats = get_one(backend, key=KEYS[1])
    assert not ok and stats["invalid_wrong_key"] == 1
    ok, _ = get_one(backend, key=KEYS[0])
    assert ok


def test_foreign_geometry_is_rejected() -> None:
    backend, _ = put_one()
    ok, stats = get_one(backend, fingerprint="0000000000000000")
    assert not ok and stats["invalid_wrong_geometry"] == 1


def test_other_layout_is_a_layout_mismatch_miss() -> None:
    backend, _ = put_one(FakePool(Layout.PAGE_FIRST))
    ok, stats = get_one(backend, FakePool(Layout.LAYER_FIRST))
    assert not ok and stats["invalid_layout_mismatch"] == 1
    ok, stats = get_one(backend, FakePool(Layout.LAYER_FIRST), verify="header")
    assert not ok and stats["invalid_layout_mismatch"] == 1


def test_other_payload_length_is_rejected() -> None:
    backend, _ = put_one(FakePool(sizes=(512, 600)))
    ok, stats = get_one(backend, FakePool(sizes=(512, 512)))
    assert not ok and stats["invalid_wrong_length"] == 1


@pytest.mark.parametrize("op", ["exists", "get", "put", "delete"])
def test_backend_exception_is_caught_counted_and_logged_once(
    op: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = DictBackend()
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP)
    store.put(KEYS[:2], [0, 1])
    backend.raise_on[op] = RuntimeError("disk on fire")
    calls = {
        "exists": lambda: store.exists(KEYS[:2]),
        "get": lambda: store.get(KEYS[:2], [2, 3]),
        "put": lambda: store.put(KEYS[:2], [0, 1]),
        "delete": lambda: store.delete(KEYS[:2]),
    }
    with caplog.at_level(logging.WARNING, logger="kvtier.core.pagestore"):
        assert calls[op]() == [False, False]
        assert calls[op]() == [False, False]
        backend.raise_on[op] = OSError("other")
        assert calls[op]() == [False, False]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "RuntimeError" in warnings[0].getMessage() and "OSError" in warnings[1].getMessage()
    stats = store.stats()
    assert stats["backend_errors"] == 3 and stats[f"backend_errors_{op}"] == 3


def test_backend_exception_in_prefix_hits_means_no_hits() -> None:
    backend = DictBackend()
    store = PageStore(backend, FakePool(), fingerprint=FP)
    store.put(KEYS[:2], [0, 1])
    backend.raise_on["exists"] = KeyError("x")
    assert store.prefix_hits(KEYS[:2]) == 0
    assert store.stats()["backend_errors"] == 1


def test_backend_with_wrong_result_count_is_an_error() -> None:
    class Short(DictBackend):
        def exists(self, keys: Sequence[str]) -> list[bool]:
            return [True]

    store = PageStore(Short(), FakePool(), fingerprint=FP)
    assert store.exists(KEYS[:3]) == [False, False, False]
    assert store.stats()["backend_errors_exists"] == 1


def test_failed_put_is_counted() -> None:
    class Full(DictBackend):
        def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
            return [False] * len(keys)

    store = PageStore(Full(), FakePool(), fingerprint=FP)
    assert store.put(KEYS[:2], [0, 1]) == [False, False]
    assert store.stats()["put_failures"] == 2 and store.stats()["bytes_written"] == 0


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".", "x\0"])
@pytest.mark.parametrize("op", ["exists", "get", "put", "delete", "prefix_hits"])
def test_path_like_key_raises_before_any_io(bad: str, op: str) -> None:
    backend = DictBackend()
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP)
    before = bytes(pool.headers[0])
    method = getattr(store, op)
    args = ([KEYS[0], bad], [0, 1]) if op in ("get", "put") else ([KEYS[0], bad],)
    with pytest.raises(InvalidKeyError) as info:
        method(*args)
    assert info.value.value == bad
    assert backend.calls == []
    assert bytes(pool.headers[0]) == before


def test_keys_and_pages_must_align() -> None:
    backend = DictBackend()
    store = PageStore(backend, FakePool(), fingerprint=FP)
    with pytest.raises(PageError, match="2 keys and 1 pages"):
        store.put(KEYS[:2], [0])
    assert backend.calls == []


def test_empty_batches_do_not_reach_the_backend() -> None:
    backend = DictBackend()
    store = PageStore(backend, FakePool(), fingerprint=FP)
    assert store.get([], []) == store.put([], []) == store.exists([]) == store.delete([]) == []
    assert backend.calls == []


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(InvalidFieldError, match="verify"):
        PageStore(DictBackend(), FakePool(), fingerprint=FP, verify="some")  # type: ignore[arg-type]
    for bad in ("", "x" * 33, "é", None):
        with pytest.raises(InvalidFieldError, match="fingerprint"):
            PageStore(DictBackend(), FakePool(), fingerprint=bad)  # type: ignore[arg-type]


def test_header_slot_of_a_rejected_page_is_not_left_valid() -> None:
    backend, _ = put_one()
    stored(backend)[ENVELOPE_BYTES] ^= 1
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP, verify="header")
    assert store.get(KEYS[:1], [1]) == [True]  # header mode: payload not checked
    stored(backend)[0] ^= 1
    assert store.get(KEYS[:1], [1]) == [False]
    assert bytes(pool.headers[1][:8]) != b"KVTIERPG"


def test_checksum_threads_give_the_same_answers() -> None:
    backend = DictBackend()
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP, checksum_workers=3)
    data = [pool.fill_random(p) for p in range(4)]
    assert store.put(KEYS[:4], [0, 1, 2, 3]) == [True] * 4
    single = PageStore(backend, FakePool(), fingerprint=FP)
    assert single.get(KEYS[:4], [0, 1, 2, 3]) == [True] * 4  # envelopes written by threads
    backend.objects[KEYS[1]][ENVELOPE_BYTES + 3] ^= 0x20
    backend.objects[KEYS[3]][20] ^= 0x01
    for p in range(4):
        pool.wipe(p)
    assert store.get(KEYS[:5], [0, 1, 2, 3, 4]) == [True, False, True, False, False]
    assert pool.payload(0) == data[0] and pool.payload(2) == data[2]
    stats = store.stats()
    assert stats["invalid_corrupt_checksum"] == 1 and stats["invalid_corrupt_header"] == 1
    assert stats["misses"] == 1 and stats["hits"] == 2
    assert store.close() is True
    assert store.close() is True  # once: the backend is closed a single time
    with pytest.raises(StorageError, match=r"is closed .* open a new one"):
        store.get(KEYS[:1], [0])  # a closed store refuses, it does not answer False


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_checksum_workers_are_rejected(bad: object) -> None:
    with pytest.raises(InvalidFieldError, match="checksum_workers"):
        PageStore(DictBackend(), FakePool(), fingerprint=FP, checksum_workers=bad)  # type: ignore[arg-type]


GEOMETRIES = {
    "mha": KVGeometry.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4),
    "mla": KVGeometry.mla(
        num_layers=2, kv_lora_rank=16, qk_rope_head_dim=8, dtype="float16", page_size=4
    ),
}
REAL_CASES = [
    (name, layout)
    for name, geometry in GEOMETRIES.items()
    for layout in layouts_for(geometry.attention)
]


def randomize(pool: HostPool, page: int) -> bytes:
    for extent in pool.extents(page):
        extent.view[:] = os.urandom(extent.length)
    return b"".join(bytes(e.view) for e in pool.extents(page))


@pytest.mark.parametrize(("geometry_name", "layout"), REAL_CASES)
def test_real_host_pool_round_trip(geometry_name: str, layout: Layout) -> None:
    geometry = GEOMETRIES[geometry_name]
    pool = HostPool(geometry, layout, num_pages=4, pin_memory=False)
    keyer = PageKeyer(Namespace("m", geometry.fingerprint), geometry.page_size, geometry.attention)
    keys = keyer.keys(list(range(3 * geometry.page_size)))
    store = PageStore(MemoryBackend(), pool, fingerprint=geometry.fingerprint)
    data = [randomize(pool, p) for p in range(3)]
    assert store.put(keys, [0, 1, 2]) == [True] * 3
    assert store.prefix_hits(keys) == 3
    assert store.get(keys, [3, 2, 1]) == [True] * 3
    got = [b"".join(bytes(e.view) for e in pool.extents(p)) for p in (3, 2, 1)]
    assert got == data
    page_bytes = ENVELOPE_BYTES + geometry.bytes_per_page
    assert store.stats()["bytes_read"] == 3 * page_bytes


def test_real_pools_in_other_layouts_do_not_read_each_other() -> None:
    geometry = GEOMETRIES["mha"]
    backend = MemoryBackend()
    keys = PageKeyer(Namespace("m", geometry.fingerprint), 4).keys(list(range(4)))
    writer = HostPool(geometry, Layout.PAGE_FIRST, num_pages=2, pin_memory=False)
    randomize(writer, 0)
    PageStore(backend, writer, fingerprint=geometry.fingerprint).put(keys, [0])
    for layout in (Layout.PAGE_FIRST_DIRECT, Layout.LAYER_FIRST, Layout.PAGE_HEAD):
        reader = HostPool(geometry, layout, num_pages=2, pin_memory=False)
        store = PageStore(backend, reader, fingerprint=geometry.fingerprint, verify="header")
        assert store.get(keys, [1]) == [False]
        assert store.stats()["invalid_layout_mismatch"] == 1


def test_real_pool_foreign_geometry_is_rejected() -> None:
    mha, other = (
        GEOMETRIES["mha"],
        KVGeometry.mha(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4),
    )
    assert mha.bytes_per_page == other.bytes_per_page  # same size, different dtype
    backend = MemoryBackend()
    keys = PageKeyer(Namespace("m", "shared"), 4).keys(list(range(4)))
    writer = HostPool(mha, Layout.PAGE_FIRST, num_pages=1, pin_memory=False)
    randomize(writer, 0)
    PageStore(backend, writer, fingerprint=mha.fingerprint).put(keys, [0])
    reader = HostPool(other, Layout.PAGE_FIRST, num_pages=1, pin_memory=False)
    store = PageStore(backend, reader, fingerprint=other.fingerprint)
    assert store.get(keys, [0]) == [False]
    assert store.stats()["invalid_wrong_geometry"] == 1


def test_close_racing_a_batch_falls_back_to_the_calling_thread() -> None:
    backend = DictBackend()
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP, checksum_workers=2)
    data = [pool.fill_random(p) for p in range(3)]
    store.put(KEYS[:3], [0, 1, 2])  # starts the checksum threads
    executor = store._executor
    assert executor is not None
    original_map = executor.map

    def map_after_close(fn, *iterables, **kwargs):  # type: ignore[no-untyped-def]
        store.close()  # another thread closes the store between lookup and submit
        return original_map(fn, *iterables, **kwargs)

    executor.map = map_after_close  # type: ignore[method-assign]
    assert store.get(KEYS[:3], [3, 4, 5]) == [True] * 3
    assert store._executor is None
    assert [pool.payload(p) for p in (3, 4, 5)] == data


# --- the store owns its backend and bounds every call to it -------------------------------


class HangingDictBackend(DictBackend):
    """A DictBackend whose chosen operations block until ``release`` is set."""

    def __init__(self, *hang: str) -> None:
        super().__init__()
        self.hang = set(hang)
        self.release = threading.Event()

    def _enter(self, op: str) -> None:
        super()._enter(op)
        if op in self.hang:
            self.release.wait()


def test_close_closes_the_backend_once() -> None:
    backend = DictBackend()
    store = PageStore(backend, FakePool(), fingerprint=FP)
    assert store.close() is True and store.close() is True
    assert backend.calls.count("close") == 1
    assert store.closed


@pytest.mark.parametrize("op", ["exists", "get", "put", "delete"])
def test_a_hung_backend_call_fails_its_batch_within_the_bound(op: str) -> None:
    backend = HangingDictBackend(op)
    pool = FakePool()
    store = PageStore(backend, pool, fingerprint=FP, backend_call_timeout_s=0.2)
    late: list[object] = []
    try:
        t0 = time.monotonic()
        if op in ("get", "put"):
            result = getattr(store, op)(KEYS[:2], [0, 1], on_late=late.append)
        else:
            result = getattr(store, op)(KEYS[:2])
        assert time.monotonic() - t0 < 0.2 + 2.0
        assert result == [False, False] and result.outcome is Outcome.TIMED_OUT
        stats = store.stats()
        assert stats["backend_timeouts"] == 1 and stats[f"backend_timeouts_{op}"] == 1
        assert store.call_counts()["stuck"] == 1
    finally:
        backend.release.set()
    deadline = time.monotonic() + 5
    while store.call_counts()["stuck"] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert store.call_counts()["late_returns"] == 1
    if op in ("get", "put"):
        assert len(late) == 1  # the caller learns when the backend let go of its pages
    assert store.close() is True


def test_stuck_calls_are_capped_then_refused_at_once() -> None:
    backend = HangingDictBackend("exists")
    store = PageStore(
        backend, FakePool(), fingerprint=FP, backend_call_timeout_s=0.1, max_abandoned_calls=1
    )
    try:
        assert store.exists(KEYS[:1]).outcome is Outcome.TIMED_OUT
        t0 = time.monotonic()
        refused = store.exists(KEYS[:1])
        assert time.monotonic() - t0 < 0.1
        assert refused.outcome is Outcome.REFUSED and refused == [False]
        assert store.stats()["backend_refused_exists"] == 1
    finally:
        backend.release.set()
        store.close()


def test_a_hung_close_is_bounded_and_reported() -> None:
    backend = HangingDictBackend("close")
    store = PageStore(backend, FakePool(), fingerprint=FP, backend_call_timeout_s=0.2)
    try:
        t0 = time.monotonic()
        assert store.close(timeout=0.2) is False
        assert time.monotonic() - t0 < 0.2 + 0.5 + 2.0
        assert store.stats()["backend_timeouts_close"] == 1
    finally:
        backend.release.set()


def test_a_bound_must_be_positive_or_none() -> None:
    with pytest.raises(InvalidFieldError, match="backend_call_timeout_s"):
        PageStore(DictBackend(), FakePool(), fingerprint=FP, backend_call_timeout_s=0)
    with pytest.raises(InvalidFieldError, match="max_abandoned_calls"):
        PageStore(DictBackend(), FakePool(), fingerprint=FP, max_abandoned_calls=0)
    unbounded = PageStore(DictBackend(), FakePool(), fingerprint=FP, backend_call_timeout_s=None)
    assert unbounded.exists(KEYS[:1]) == [False]  # in the caller's thread
    unbounded.close()
