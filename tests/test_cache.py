"""TieredCache: open-time validation, round trips through each tier, policies, pins, stats."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.cache import CacheClosedError, CacheOptions, TieredCache, open_cache
from kvtier.core import host_pool as host_pool_module
from kvtier.core.config import EngineConfig, load_engine_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.errors import (
    ConfigError,
    InvalidFieldError,
    InvalidKeyError,
    PoolExhaustedError,
    TransferError,
    UnknownKeyError,
    UnknownNameError,
)
from kvtier.core.specs import ALL_ATTENTION, ALL_LAYOUTS, ALL_OPERATIONS, BackendSpec
from kvtier.core.storage import BackendContext, PageBuffers, StorageBackend
from kvtier.plugins.hookspecs import hookimpl
from kvtier.plugins.manager import load_registry
from kvtier.plugins.registry import Registry
from kvtier.testing.content import check_pages, fill_pages

JOIN = 20.0  # seconds: every wait in these tests is bounded, so a bug fails, never hangs

GEOMETRY: dict[str, Any] = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
    "dtype": "float16",
    "page_size": 4,
}


class GatedBackend(StorageBackend):
    """A memory backend whose ``get`` waits for ``gate`` (bounded), to hold reads in flight."""

    def __init__(self) -> None:
        self.inner = MemoryBackend(MemoryConfig())
        self.gate = threading.Event()
        self.gate.set()
        self.gets = 0
        self.entered = threading.Event()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists(keys)

    def get(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        self.gets += 1
        self.entered.set()
        self.gate.wait(JOIN)
        return self.inner.get(keys, pages)

    def put(self, keys: Sequence[str], pages: Sequence[PageBuffers]) -> list[bool]:
        return self.inner.put(keys, pages)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self.gate.set()


class _Shared:
    """Test plugin state: the backend the ``shared`` backend factory returns."""

    backend: StorageBackend | None = None


def _shared_factory(config: Any, context: BackendContext) -> StorageBackend:
    assert _Shared.backend is not None
    return _Shared.backend


class TestPlugin:
    """Declares a ``shared`` backend that hands out a test-controlled instance."""

    @staticmethod
    @hookimpl
    def kvtier_register_backends(register: Any) -> None:
        register(
            BackendSpec(
                name="shared",
                factory=_shared_factory,
                layouts=ALL_LAYOUTS,
                attention=ALL_ATTENTION,
                operations=ALL_OPERATIONS,
            )
        )


def cache_registry() -> Registry:
    """The built-in plugins plus this file's ``shared`` backend."""
    return load_registry(autoload=False, plugins=[("cache-test", TestPlugin)])


def shared_backend(instance: StorageBackend) -> Registry:
    """A registry whose ``shared`` backend builds ``instance`` (a test-controlled one)."""
    _Shared.backend = instance
    return cache_registry()


@pytest.fixture
def registry() -> Registry:
    return cache_registry()


def make_cache(
    registry: Registry,
    *,
    instance: StorageBackend | None = None,
    slots: int = 512,
    options: dict[str, Any] | None = None,
    geometry: dict[str, Any] | None = None,
    **config: Any,
) -> TieredCache:
    """A small cache over a CPU device pool; ``instance`` plugs in a specific backend."""
    settings = {"backend": "memory", **(geometry or GEOMETRY), "host_pages": 32, **config}
    if instance is not None:
        _Shared.backend = instance
        settings["backend"] = "shared"
    engine = load_engine_config(settings)
    device = TorchDevicePool(engine.geometry(), slots)
    return TieredCache.open(engine, device, options=options, registry=registry)


@pytest.fixture
def cache(registry: Registry) -> Iterator[TieredCache]:
    c = make_cache(registry)
    yield c
    c.close()


def slots(start: int, pages: int, ps: int = 4) -> torch.Tensor:
    return torch.arange(start * ps, (start + pages) * ps, dtype=torch.int64)


def put_pages(cache: TieredCache, tokens: Sequence[int], start: int = 0) -> list[str]:
    """Simulate prefill: fill device pages for ``tokens`` and back them up; wait for it."""
    keys = cache.keys(list(tokens))
    where = slots(start, len(keys), cache.geometry.page_size)
    fill_pages(cache.device_pool, keys, where)
    handle = cache.backup(keys, where)
    assert handle.wait(JOIN), handle
    assert handle.ok, handle.error
    return keys


def load_and_check(cache: TieredCache, keys: list[str], start: int = 80) -> int:
    """Prefetch and load ``keys`` into fresh slots; assert every loaded page is exact."""
    cache.device_pool.zero_()  # type: ignore[attr-defined]
    where = slots(start, len(keys), cache.geometry.page_size)
    handle = cache.prefetch(keys)
    handle.wait(JOIN)
    loaded = cache.load(handle, where)
    assert all(check_pages(cache.device_pool, keys[:loaded], where[: loaded * 4]))
    return loaded


def storage_has(cache: TieredCache, keys: list[str]) -> list[bool]:
    return cache.page_store.exists(keys)


# --- open ----------------------------------------------------------------------------------


def test_open_refuses_bad_config_before_allocating(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_alloc(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a host pool was allocated for a config that cannot work")

    monkeypatch.setattr(host_pool_module.HostPool, "__init__", no_alloc)
    engine = load_engine_config(GEOMETRY)
    device = TorchDevicePool(engine.geometry(), 16)
    with pytest.raises(UnknownNameError, match=r"memroy.*did you mean 'memory'"):
        TieredCache.open({**GEOMETRY, "backend": "memroy"}, device, registry=registry)
    with pytest.raises(UnknownKeyError, match="capacity_byte"):
        open_cache({**GEOMETRY, "extra_config": '{"capacity_byte": 1}'}, device, registry)
    with pytest.raises(UnknownKeyError, match=r"write_polcy.*did you mean 'write_policy'"):
        open_cache(GEOMETRY, device, registry, options={"write_polcy": "write_back"})
    with pytest.raises(ConfigError, match="write_policy"):
        open_cache(GEOMETRY, device, registry, options={"write_policy": "sometimes"})
    other = TorchDevicePool(load_engine_config({**GEOMETRY, "num_layers": 3}).geometry(), 16)
    with pytest.raises(InvalidFieldError, match="device pool's geometry"):
        open_cache(GEOMETRY, other, registry)


def test_open_builds_the_resolved_plan(cache: TieredCache) -> None:
    assert cache.plan.backend.name == "memory"
    assert cache.host_pool.num_pages == 32
    assert cache.host_pool.layout is cache.plan.layout
    assert cache.writes_storage
    assert isinstance(cache.config, EngineConfig)


# --- round trips -----------------------------------------------------------------------------


def test_backup_prefetch_load_round_trip_from_host(cache: TieredCache) -> None:
    keys = put_pages(cache, range(40))
    assert len(keys) == 10
    assert load_and_check(cache, keys) == 10
    stats = cache.stats()
    assert stats["host"]["hits"] == 10
    assert stats["pages"]["backed_up"] == 10
    assert stats["pages"]["loaded"] == 10
    assert stats["bytes"]["host_to_device"] == 10 * cache.geometry.bytes_per_page
    assert storage_has(cache, keys) == [True] * 10  # write_through


def test_round_trip_from_storage_after_host_eviction(registry: Registry) -> None:
    cache = make_cache(registry, host_pages=8)
    try:
        first = put_pages(cache, range(24))  # 6 pages
        put_pages(cache, range(1000, 1024), start=6)  # 6 more: evicts most of the first
        assert cache.stats()["host"]["evictions"] >= 4
        loaded = load_and_check(cache, first)
        assert loaded == 6
        stats = cache.stats()
        assert stats["storage"]["hits"] >= 4
        assert stats["storage"]["pages_read"] >= 4
        assert stats["bytes"]["storage_read"] >= 4 * cache.geometry.bytes_per_page
    finally:
        assert cache.close()


def test_prefix_stops_at_first_missing_page(cache: TieredCache) -> None:
    keys = put_pages(cache, range(16))  # 4 pages
    longer = cache.keys(list(range(16)) + list(range(500, 508)))  # 2 more, never stored
    assert longer[:4] == keys
    handle = cache.prefetch(longer)
    assert handle.planned_pages == 4
    assert cache.load(handle, slots(50, 6)) == 4


def test_backup_of_cached_pages_copies_nothing(cache: TieredCache) -> None:
    keys = put_pages(cache, range(16))
    again = cache.backup(keys, slots(0, 4))
    assert again.wait(JOIN)
    assert again.pages_copied == 0 and again.pages_cached == 4
    assert cache.stats()["pages"]["backed_up"] == 4


@pytest.fixture
def layered(registry: Registry) -> Iterator[TieredCache]:
    """A cache whose config declares the per-layer load (and, for its tests, backup)."""
    c = make_cache(registry, operations=["backup_all", "load_all", "load_layer", "backup_layer"])
    yield c
    c.close()


def test_load_one_layer_at_a_time(layered: TieredCache) -> None:
    cache = layered
    keys = put_pages(cache, range(20))
    cache.device_pool.zero_()  # type: ignore[attr-defined]
    where = slots(30, 5)
    handle = cache.prefetch(keys)
    for layer in range(cache.geometry.num_layers):
        assert cache.load(handle, where, layer=layer) == 5
        assert all(check_pages(cache.device_pool, keys, where, layers=[layer]))
    assert cache.stats()["host"]["pages"]["pinned"] == 0  # released after the last layer


def test_load_with_keys_and_more_slots_than_pages(cache: TieredCache) -> None:
    keys = put_pages(cache, range(12))
    cache.device_pool.zero_()  # type: ignore[attr-defined]
    where = slots(40, 8)
    assert cache.load(keys, where) == 3
    assert all(check_pages(cache.device_pool, keys, where[:12]))


def test_bad_slots_are_clear_errors(cache: TieredCache) -> None:
    keys = cache.keys(list(range(8)))
    with pytest.raises(TransferError, match="pass 8"):
        cache.backup(keys, torch.arange(5))
    with pytest.raises(TransferError, match="integers"):
        cache.backup(keys, torch.arange(8, dtype=torch.float32))
    with pytest.raises(TransferError, match="device slot 10007 is out of range"):
        cache.backup(keys, torch.arange(10_000, 10_008))
    put_pages(cache, range(8))
    with pytest.raises(TransferError, match="out of range"):
        cache.load(cache.prefetch(keys), torch.arange(10_000, 10_008))
    assert cache.stats()["host"]["pages"]["pinned"] == 0


# --- write policies ----------------------------------------------------------------------------


def test_write_through_selective_writes_after_threshold_hits(registry: Registry) -> None:
    cache = make_cache(
        registry, options={"write_policy": "write_through_selective", "write_threshold": 2}
    )
    try:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN)
        assert storage_has(cache, keys) == [False] * 4
        cache.prefetch(keys).release()  # hit 1
        assert cache.flush(JOIN)
        assert storage_has(cache, keys) == [False] * 4
        cache.prefetch(keys[:2]).release()  # hit 2 for the first two pages only
        assert cache.flush(JOIN)
        assert storage_has(cache, keys) == [True, True, False, False]
        assert cache.stats()["storage"]["pages_written"] == 2
    finally:
        cache.close()


def test_write_back_writes_on_eviction(registry: Registry) -> None:
    cache = make_cache(registry, host_pages=6, options={"write_policy": "write_back"})
    try:
        first = put_pages(cache, range(16))  # 4 pages, dirty
        assert cache.flush(JOIN)
        assert storage_has(cache, first) == [False] * 4
        assert cache.stats()["host"]["pages"]["dirty"] == 4
        put_pages(cache, range(700, 716), start=4)  # needs the LRU pages back
        assert cache.flush(JOIN)
        stats = cache.stats()
        assert stats["storage"]["write_backs"] >= 2
        assert sum(storage_has(cache, first)) >= 2
        assert load_and_check(cache, first) == 4  # from host and storage, exact
    finally:
        cache.close()


def test_write_back_flushes_dirty_pages_on_close(registry: Registry, tmp_path: Path) -> None:
    config = {"backend": "file", "extra_config": {"root": str(tmp_path / "kv")}}
    cache = make_cache(registry, options={"write_policy": "write_back"}, **config)
    keys = put_pages(cache, range(12))
    assert cache.flush(JOIN)
    assert storage_has(cache, keys) == [False] * 3
    assert cache.close(timeout=JOIN)
    reopened = make_cache(registry, **config)
    try:
        assert load_and_check(reopened, keys) == 3
        assert reopened.stats()["storage"]["hits"] == 3
    finally:
        reopened.close()


def test_mla_only_rank_zero_writes_to_storage(registry: Registry) -> None:
    mla = {
        "attention": "mla",
        "num_layers": 2,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": 8,
        "dtype": "float16",
        "page_size": 4,
    }
    backend = MemoryBackend(MemoryConfig())
    other = make_cache(registry, instance=backend, geometry=mla, tp_rank=1, tp_size=2)
    writer = make_cache(registry, instance=backend, geometry=mla, tp_rank=0, tp_size=2)
    try:
        assert not other.writes_storage and writer.writes_storage
        keys = put_pages(other, range(12))
        assert other.flush(JOIN)
        assert backend.exists(keys) == [False] * 3
        assert other.stats()["storage"]["writes_skipped"] == 3
        assert writer.keys(list(range(12))) == keys  # MLA keys carry no rank suffix
        put_pages(writer, range(12))
        assert writer.flush(JOIN)
        assert backend.exists(keys) == [True] * 3
        reader = make_cache(registry, instance=backend, geometry=mla, tp_rank=1, tp_size=2)
        try:  # a fresh non-writer rank reads what rank 0 wrote
            assert load_and_check(reader, keys) == 3
            assert reader.stats()["storage"]["hits"] == 3
        finally:
            reader.close()
    finally:
        other.close()
        writer.close()


# --- prefetch policies, cancel, exhaustion ----------------------------------------------------


def _stored_then_evicted(
    registry: Registry, backend: GatedBackend, **options: Any
) -> tuple[TieredCache, list[str]]:
    """A cache whose host pool lost ``keys`` (8 pages) that storage still has."""
    cache = make_cache(registry, instance=backend, host_pages=12, options=options)
    keys = put_pages(cache, range(32))
    put_pages(cache, range(900, 948), start=8)  # 12 pages: the first 8 are evicted
    assert cache.flush(JOIN)
    assert cache.stats()["host"]["hits"] == 0
    return cache, keys


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_policies_that_do_not_wait_for_slow_storage(registry: Registry, policy: str) -> None:
    backend = GatedBackend()
    cache, keys = _stored_then_evicted(
        registry, backend, prefetch_policy=policy, timeout_base_s=0.01, timeout_per_page_s=0.0
    )
    try:
        backend.gate.clear()
        handle = cache.prefetch(keys)
        assert handle.storage_hits == 8
        assert backend.entered.wait(JOIN)
        assert cache.load(handle, slots(20, 8)) == 0  # nothing ready: loads nothing, at once
        backend.gate.set()
        assert cache.flush(JOIN)
        assert cache.stats()["host"]["pages"]["pinned"] == 0
        assert load_and_check(cache, keys) == 8  # the pages arrived and are cached now
    finally:
        backend.gate.set()
        cache.close()


def test_wait_complete_waits_for_every_page(registry: Registry) -> None:
    backend = GatedBackend()
    cache, keys = _stored_then_evicted(
        registry, backend, prefetch_policy="wait_complete", batch_pages=2
    )
    try:
        backend.gate.clear()
        handle = cache.prefetch(keys)
        opener = threading.Timer(0.05, backend.gate.set)
        opener.start()
        cache.device_pool.zero_()  # type: ignore[attr-defined]
        where = slots(20, 8)
        assert cache.load(handle, where) == 8
        assert all(check_pages(cache.device_pool, keys, where))
        opener.join(JOIN)
    finally:
        backend.gate.set()
        cache.close()


def test_timeout_budget_grows_with_pages(registry: Registry) -> None:
    cache = make_cache(registry, options={"timeout_base_s": 0.5, "timeout_per_page_s": 0.25})
    try:
        handle = cache.prefetch([])
        assert handle.budget_s() == 0.5
        handle.storage_hits = 4
        assert handle.budget_s() == 1.5
    finally:
        cache.close()


def test_cancel_stops_reading_the_rest(registry: Registry) -> None:
    backend = GatedBackend()
    cache, keys = _stored_then_evicted(registry, backend, batch_pages=2)
    try:
        backend.gate.clear()
        handle = cache.prefetch(keys)
        assert backend.entered.wait(JOIN)
        handle.cancel()
        backend.gate.set()
        handle.wait(JOIN)
        assert handle.done
        assert handle.ready_pages == 2  # the batch already in flight finished
        assert backend.gets == 1
        assert cache.stats()["pages"]["cancelled"] == 6
        assert cache.load(handle, slots(20, 8)) == 2
        assert cache.stats()["host"]["pages"]["pinned"] == 0
        assert load_and_check(cache, keys) == 8  # a later prefetch reads the rest
    finally:
        backend.gate.set()
        cache.close()


def test_pool_exhausted_by_pins_fails_clearly(registry: Registry) -> None:
    cache = make_cache(registry, host_pages=4, options={"alloc_wait_s": 0.05})
    try:
        keys = put_pages(cache, range(16))  # fills the pool
        held = cache.prefetch(keys)  # pins all four pages
        extra = cache.keys(list(range(300, 308)))
        fill_pages(cache.device_pool, extra, slots(10, 2))
        handle = cache.backup(extra, slots(10, 2))
        assert handle.wait(JOIN)
        assert not handle.ok
        assert isinstance(handle.error, PoolExhaustedError)
        assert "pinned" in str(handle.error)
        assert cache.stats()["failures"]["host_exhausted"] == 2
        held.release()
        retry = cache.backup(extra, slots(10, 2))
        assert retry.wait(JOIN) and retry.ok
    finally:
        cache.close()


def test_full_read_queue_fails_the_prefetch_not_the_caller(registry: Registry) -> None:
    backend = GatedBackend()
    cache, keys = _stored_then_evicted(registry, backend, io_workers=1, queue_size=1)
    try:
        backend.gate.clear()
        first = cache.prefetch(keys[:2])
        assert backend.entered.wait(JOIN)
        second = cache.prefetch(keys[2:4])  # queued
        third = cache.prefetch(keys[4:6])  # queue full
        assert third.done and third.ready_pages == 0
        assert cache.stats()["failures"]["queue_full"] == 2
        backend.gate.set()
        for handle in (first, second, third):
            handle.wait(JOIN)
            handle.release()
        assert first.done and second.done
    finally:
        backend.gate.set()
        cache.close()


# --- errors, stats, shutdown -------------------------------------------------------------------


def test_a_job_that_raises_does_not_stop_its_worker(
    registry: Registry, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backend = GatedBackend()
    cache, keys = _stored_then_evicted(registry, backend, io_workers=1)
    try:
        real_get = cache.page_store.get
        calls = {"n": 0}

        def broken_once(keys: Sequence[str], pages: Sequence[int], **kwargs: Any) -> list[bool]:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("bug in the read path")
            return real_get(keys, pages, **kwargs)

        monkeypatch.setattr(cache.page_store, "get", broken_once)
        first = cache.prefetch(keys[:4])
        first.wait(JOIN)
        assert first.done and first.ready_pages == 0
        first.release()
        assert cache.flush(JOIN)
        assert cache.stats()["failures"]["read_worker_error"] == 1
        assert "read_worker_error" in caplog.text
        assert load_and_check(cache, keys) == 8  # the same worker serves the next one
    finally:
        cache.close()


def test_stats_shape(cache: TieredCache) -> None:
    keys = put_pages(cache, range(8))
    load_and_check(cache, keys)
    stats = cache.stats()
    for section in ("host", "storage", "pages", "bytes", "bandwidth_bytes_per_s"):
        assert section in stats
    latency = stats["latency_seconds"]
    assert latency["device_to_host"]["count"] == 1
    assert latency["load"]["count"] == 1
    assert latency["storage_put"]["count"] == 1
    assert stats["bandwidth_bytes_per_s"]["device_to_host"] > 0
    assert stats["failures_total"] == 0
    assert stats["policies"] == {
        "write": "write_through",
        "prefetch": "best_effort",
        "writes_storage": True,
    }


def test_prometheus_exposition(cache: TieredCache) -> None:
    pytest.importorskip(
        "prometheus_client", reason="needs the 'prometheus' extra (prometheus_client)"
    )
    keys = put_pages(cache, range(8))
    load_and_check(cache, keys)
    text = cache.prometheus_text()
    at = 'backend="memory",model="default",rank="0",tenant=""'
    assert f"kvtier_host_hits_total{{{at}}} 2.0" in text
    assert 'kvtier_transferred_bytes_total{backend="memory",direction="device_to_host",' in text
    assert (
        'kvtier_operation_latency_seconds_bucket{backend="memory",le="+Inf",model="default",'
        'operation="load",rank="0",tenant=""} 1.0'
    ) in text
    assert 'kvtier_host_pages{backend="memory",model="default",rank="0",state="cached",' in text
    assert "kvtier_failures_total" in text


def test_close_is_idempotent_and_later_calls_raise(registry: Registry) -> None:
    cache = make_cache(registry)
    assert cache.close()
    assert cache.close()
    assert cache.closed
    with pytest.raises(CacheClosedError, match="closed"):
        cache.prefetch([])
    with pytest.raises(CacheClosedError):
        cache.backup([], torch.arange(0))
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtier-")]


def test_context_manager_closes(registry: Registry) -> None:
    with make_cache(registry) as cache:
        put_pages(cache, range(8))
    assert cache.closed


def test_options_model_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        CacheOptions(io_workers=0)


def _open_fds() -> int | None:
    fd_dir = Path("/proc/self/fd")
    return len(list(fd_dir.iterdir())) if fd_dir.is_dir() else None


def test_close_leaves_no_thread_or_file_descriptor(registry: Registry, tmp_path: Path) -> None:
    before = _open_fds()
    if before is None:
        pytest.skip("needs /proc/self/fd to count file descriptors")
    config = {"backend": "file", "extra_config": {"root": str(tmp_path / "kv")}}
    cache = make_cache(registry, host_pages=6, **config)
    put_pages(cache, range(20))  # 5 pages, then 5 more through a 6-page host pool
    keys = put_pages(cache, range(100, 120), start=5)
    assert load_and_check(cache, cache.keys(list(range(20)))) == 5  # mostly from files
    assert load_and_check(cache, keys) == 5
    assert cache.close(timeout=JOIN)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtier-")]
    assert _open_fds() == before


def test_max_load_wait_bounds_wait_complete(registry: Registry) -> None:
    backend = GatedBackend()
    cache, keys = _stored_then_evicted(
        registry, backend, prefetch_policy="wait_complete", max_load_wait_s=0.05
    )
    try:
        backend.gate.clear()
        assert cache.load(keys, slots(20, 8)) == 0  # storage never answered in time
        backend.gate.set()
        assert cache.flush(JOIN)
    finally:
        backend.gate.set()
        cache.close()


def test_batched_backup_writes_every_batch(registry: Registry) -> None:
    cache = make_cache(registry, options={"batch_pages": 2})
    try:
        keys = cache.keys(list(range(20)))  # 5 pages: batches of 2, 2, 1
        fill_pages(cache.device_pool, keys, slots(0, 5))
        handle = cache.backup(keys, slots(0, 5))
        assert handle.wait(JOIN) and handle.ok
        assert handle.pages_copied == 5 and handle.pages_written == 5
        assert storage_has(cache, keys) == [True] * 5
        assert cache.stats()["latency_seconds"]["device_to_host"]["count"] == 3
    finally:
        cache.close()


def test_device_to_host_failure_fails_the_rest_and_holds_nothing(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(registry, options={"batch_pages": 2})
    try:
        real = cache.io_backend.backup
        calls = {"n": 0}

        def second_fails(*args: Any, **kwargs: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device went away")
            real(*args, **kwargs)

        monkeypatch.setattr(cache.io_backend, "backup", second_fails)
        keys = cache.keys(list(range(20)))
        fill_pages(cache.device_pool, keys, slots(0, 5))
        handle = cache.backup(keys, slots(0, 5))
        assert handle.wait(JOIN)
        assert not handle.ok and "device went away" in repr(handle.error)
        assert handle.pages_copied == 2 and handle.pages_failed == 3
        assert cache.flush(JOIN)
        counts = cache.stats()["host"]["pages"]
        assert counts["cached"] == 2 and counts["pinned"] == 0
        assert counts["free"] == counts["total"] - 2
        assert cache.stats()["failures"]["device_to_host"] == 3
        assert load_and_check(cache, keys) == 2
    finally:
        cache.close()


def test_a_released_handle_cannot_be_loaded(cache: TieredCache) -> None:
    keys = put_pages(cache, range(8))
    handle = cache.prefetch(keys)
    assert cache.load(handle, slots(10, 2)) == 2
    with pytest.raises(InvalidFieldError, match="already loaded"):
        cache.load(handle, slots(10, 2))
    other = cache.prefetch(keys)
    other.release()
    other.release()  # idempotent
    with pytest.raises(InvalidFieldError, match="prefetch the keys again"):
        cache.load(other, slots(10, 2))
    assert cache.stats()["host"]["pages"]["pinned"] == 0


def test_a_handle_of_another_cache_is_refused(registry: Registry) -> None:
    first, second = make_cache(registry), make_cache(registry)
    try:
        handle = first.prefetch(put_pages(first, range(8)))
        with pytest.raises(InvalidFieldError, match="belongs to another TieredCache"):
            second.load(handle, slots(10, 2))
        assert first.load(handle, slots(10, 2)) == 2
        assert first.stats()["host"]["pages"]["pinned"] == 0
    finally:
        first.close()
        second.close()


def test_bad_keys_are_refused_in_the_caller_and_pin_nothing(cache: TieredCache) -> None:
    keys = put_pages(cache, range(8))
    for bad in ("../etc/passwd", "UPPER", "", 42):
        with pytest.raises(InvalidKeyError):
            cache.prefetch([*keys, bad])  # type: ignore[list-item]
        with pytest.raises(InvalidKeyError):
            cache.backup([bad], slots(10, 1))  # type: ignore[list-item]
    assert cache.stats()["host"]["pages"]["pinned"] == 0


def test_prometheus_missing_names_the_extra(
    cache: TieredCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("prometheus_client", "prometheus_client.core"):
        monkeypatch.setitem(sys.modules, name, None)  # the import now fails
    with pytest.raises(ImportError, match=r"kvtier\[prometheus\]"):
        cache.prometheus_text()
    with pytest.raises(ImportError, match=r"kvtier\[prometheus\]"):
        cache.prometheus_collector()
