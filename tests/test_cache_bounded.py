"""A backend call that never returns: it fails its operation within the bound, not the cache.

The backend here blocks forever (on an Event that only teardown sets) in the calls a test
chooses. Through the public TieredCache API: a get and a put that hang fail within
``backend_call_timeout_s``, are counted, later operations still succeed on the same
workers, no host page the stuck call still uses is reused, and ``close()`` returns within
its bound and names what it gave up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from test_cache import JOIN, cache_registry, load_and_check, make_cache, put_pages, slots

from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.cache import CacheOptions, TieredCache
from kvtier.core.storage import PageBuffers, StorageBackend
from kvtier.testing.content import fill_pages

BOUND = 0.3  # backend_call_timeout_s in these tests
SLACK = 2.0  # what a shared 2-core CI host may add to a bound


class HangingBackend(StorageBackend):
    """A memory backend whose chosen calls block until ``release`` is set (at teardown)."""

    def __init__(self) -> None:
        self.inner = MemoryBackend(MemoryConfig())
        self.release = threading.Event()
        self.hang: set[str] = set()
        self.entered: dict[str, int] = {}
        self.returned: dict[str, int] = {}
        self._lock = threading.Lock()

    def _maybe_hang(self, op: str) -> None:
        with self._lock:
            self.entered[op] = self.entered.get(op, 0) + 1
            hang = op in self.hang
        if hang:
            self.release.wait()  # forever, as far as the cache can tell
        with self._lock:
            self.returned[op] = self.returned.get(op, 0) + 1

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._maybe_hang("exists")
        return self.inner.exists(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._maybe_hang("get")
        return self.inner.get(keys, pages)

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self._maybe_hang("put")
        return self.inner.put(keys, pages)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.delete(keys)

    def clear(self) -> None:
        self._maybe_hang("clear")
        self.inner.clear()

    def stats(self) -> dict[str, int | float]:
        self._maybe_hang("stats")
        return self.inner.stats()

    def close(self) -> None:
        self._maybe_hang("close")


@pytest.fixture
def backend() -> Iterator[HangingBackend]:
    b = HangingBackend()
    yield b
    b.release.set()  # let every abandoned thread finish


def _open(backend: HangingBackend, **options: Any) -> TieredCache:
    opts = {"backend_call_timeout_s": BOUND, "close_timeout_s": 1.0, **options}
    return make_cache(cache_registry(), instance=backend, host_pages=12, options=opts)


def _evict(cache: TieredCache) -> None:
    """Push the first pages out of the host pool (12 pages) so they must come from storage."""
    put_pages(cache, range(900, 948), start=8)
    assert cache.flush(JOIN)


def test_default_bound_is_generous_and_can_be_switched_off() -> None:
    # 30 s: one call moves one batch (32 pages; 256 MiB of 8 MiB pages), which even a
    # disk degraded to ~20 MB/s finishes in ~13 s.
    assert CacheOptions().backend_call_timeout_s == 30.0
    assert CacheOptions(backend_call_timeout_s=None).backend_call_timeout_s is None
    with pytest.raises(ValueError):
        CacheOptions(backend_call_timeout_s=0)
    with pytest.raises(ValueError):
        CacheOptions(max_abandoned_calls=0)


def test_a_hung_get_fails_its_prefetch_and_the_reader_goes_on(
    backend: HangingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    cache = _open(backend, io_workers=1)
    try:
        keys = put_pages(cache, range(32))  # 8 pages, in storage
        _evict(cache)
        backend.hang.add("get")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
            handle = cache.prefetch(keys)
            assert handle.storage_hits == 8
            assert handle.wait(JOIN) == 0
        waited = time.monotonic() - t0
        assert handle.done
        assert waited < BOUND + SLACK, waited
        assert cache.load(handle, slots(20, 8)) == 0  # the pages are misses, not garbage
        stats = cache.stats()
        assert stats["failures"]["backend_timeout"] == 8
        assert stats["backend_calls"]["timed_out_by_operation"] == {"get": 1}
        assert stats["backend_calls"]["stuck"] == 1
        assert "did not return within" in caplog.text
        # the stuck call still holds its 8 host pages: nothing can reuse them under it
        assert stats["host"]["pages"]["free"] + stats["host"]["pages"]["cached"] <= 12 - 8

        backend.hang.discard("get")  # the backend answers again: the one reader serves it
        assert load_and_check(cache, keys[:4]) == 4  # into the 4 pages the stuck call left
        assert cache.stats()["storage"]["hits"] >= 8
    finally:
        t0 = time.monotonic()
        cache.close()
        assert time.monotonic() - t0 < 1.0 + 2 * 0.5 + SLACK


def test_a_hung_put_fails_its_write_and_the_writer_goes_on(backend: HangingBackend) -> None:
    cache = _open(backend, write_workers=1)
    try:
        backend.hang.add("put")
        keys = cache.keys(list(range(16)))
        where = slots(0, 4)
        fill_pages(cache.device_pool, keys, where)
        t0 = time.monotonic()
        handle = cache.backup(keys, where)
        assert handle.wait(JOIN)
        assert time.monotonic() - t0 < BOUND + SLACK
        assert handle.pages_written == 0  # the write failed; the host copy is fine
        assert cache.stats()["failures"]["backend_timeout"] == 4
        assert cache.stats()["backend_calls"]["timed_out_by_operation"] == {"put": 1}

        backend.hang.discard("put")
        later = put_pages(cache, range(100, 116), start=4)
        assert cache.flush(JOIN)
        assert cache.page_store.exists(later) == [True] * 4  # the same writer wrote them
        assert cache.page_store.exists(keys) == [False] * 4
    finally:
        cache.close()


def test_a_hung_exists_does_not_hang_prefetch(backend: HangingBackend) -> None:
    cache = _open(backend)
    try:
        keys = put_pages(cache, range(32))
        _evict(cache)
        backend.hang.add("exists")
        t0 = time.monotonic()
        handle = cache.prefetch(keys)
        assert time.monotonic() - t0 < BOUND + SLACK
        assert handle.planned_pages == 0  # storage could not answer: a miss
        handle.release()
        assert cache.stats()["failures"]["backend_timeout"] == 8
    finally:
        cache.close()


def test_stuck_calls_are_capped_then_everything_fails_fast(
    backend: HangingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    cache = _open(backend, max_abandoned_calls=2)
    try:
        keys = put_pages(cache, range(32))
        _evict(cache)
        backend.hang.add("exists")
        for _ in range(2):
            cache.prefetch(keys).release()
        assert cache.stats()["backend_calls"]["stuck"] == 2
        threads = len(cache.page_store.tiers[0].store._calls._threads)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
            cache.prefetch(keys).release()
        assert time.monotonic() - t0 < BOUND  # refused at once
        assert len(cache.page_store.tiers[0].store._calls._threads) == threads  # none started
        assert "max_abandoned_calls=2" in caplog.text
        stats = cache.stats()
        assert stats["failures"]["backend_refused"] == 8
        assert stats["backend_calls"]["refused"] >= 1

        backend.hang.discard("exists")
        backend.release.set()  # the stuck calls return: their threads serve again
        deadline = time.monotonic() + JOIN
        while cache.stats()["backend_calls"]["stuck"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.stats()["backend_calls"]["late_returns"] == 2
        assert load_and_check(cache, keys) == 8
    finally:
        cache.close()


def test_close_is_bounded_with_a_call_hanging_and_names_what_it_gave_up(
    backend: HangingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    # A bound longer than close's: close must not wait for the call's own bound.
    cache = _open(backend, backend_call_timeout_s=60.0, close_timeout_s=0.5, io_workers=1)
    keys = put_pages(cache, range(32))
    _evict(cache)
    backend.hang.update({"get", "close"})
    handle = cache.prefetch(keys)
    deadline = time.monotonic() + JOIN
    while not backend.entered.get("get") and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        assert cache.close() is False  # it gave up on something, and says so
    took = time.monotonic() - t0
    # drain bound + wake grace + the backend close()'s own bound (+ the calls' grace)
    assert took < 0.5 + 0.5 + 0.5 + 0.5 + SLACK, took
    assert "close gave up on 2 backend call(s)" in caplog.text
    assert "get on kvtier-backend-call-" in caplog.text
    assert "close on kvtier-backend-call-" in caplog.text
    assert handle.done and handle.ready_pages == 0
    backend.release.set()
    deadline = time.monotonic() + JOIN
    while any(t.name.startswith("kvtier-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.01)  # the abandoned threads end once their calls return


def test_a_hung_stats_does_not_hang_stats(backend: HangingBackend) -> None:
    cache = _open(backend)
    try:
        backend.hang.add("stats")
        t0 = time.monotonic()
        stats = cache.stats()
        assert time.monotonic() - t0 < BOUND + SLACK
        assert stats["backend"] == {"error": "stats() timed_out"}
    finally:
        cache.close()


def test_no_bound_runs_calls_in_the_worker(backend: HangingBackend) -> None:
    cache = _open(backend, backend_call_timeout_s=None)
    try:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN)
        assert cache.page_store.exists(keys) == [True] * 4
        assert not [t for t in threading.enumerate() if "-call-" in t.name]
    finally:
        cache.close()


def test_device_slots_stay_usable_after_timeouts(backend: HangingBackend) -> None:
    """A put that timed out never blocks the host copy: the device slots are free at once."""
    cache = _open(backend)
    try:
        backend.hang.add("put")
        keys = cache.keys(list(range(16)))
        where = slots(0, 4)
        fill_pages(cache.device_pool, keys, where)
        handle = cache.backup(keys, where)
        assert handle.wait_host(JOIN)
        assert handle.pages_copied == 4
        cache.device_pool.zero_()  # type: ignore[attr-defined]
        loaded = cache.load(cache.prefetch(keys), torch.arange(80, 96))
        assert loaded == 4  # host tier still serves the pages the write gave up on
    finally:
        cache.close()
