"""The Prometheus exposition an operator alerts on, and docs/operating.md that lists it.

Through the public TieredCache API: every series carries model / rank / tenant / backend;
bandwidth is there per direction as byte and second counters; integrity rejections come
by reason; the backend's own numbers are exported generically; occupancy per tier; and
every metric the exposition emits is documented, and every documented one is emitted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cache import JOIN, cache_registry, load_and_check, make_cache, put_pages

from kvtier.backends.memory import MemoryConfig
from kvtier.backends.memory.backend import MemoryBackend
from kvtier.cache import TieredCache
from kvtier.core.envelope import Rejection
from kvtier.core.errors import UnknownNameError
from kvtier.core.metrics import Cause

pytest.importorskip("prometheus_client", reason="needs the 'prometheus' extra")
from prometheus_client.parser import text_string_to_metric_families

DOC = Path(__file__).resolve().parents[1] / "docs" / "operating.md"
IDENTITY = {"model": "llama-test", "rank": "1", "tenant": "acme", "backend": "shared"}


class ReportingBackend(MemoryBackend):
    """A memory backend whose stats() also report what other backends do (by name only)."""

    def __init__(self) -> None:
        super().__init__(MemoryConfig(capacity_bytes=1 << 20))
        self.extra: dict[str, Any] = {
            "put_failed.NO_AVAILABLE_HANDLE": 3,
            "debris_directories": 2,
            "master_up": 1,
            "hit_ratio_hint": 0.5,
            "mode": "fancy",  # not a number: not exported
            "flag": True,  # a bool is not a counter either
        }

    def stats(self) -> dict[str, Any]:  # type: ignore[override]
        return {**super().stats(), "capacity_bytes": 1 << 20, **self.extra}


@pytest.fixture
def backend() -> ReportingBackend:
    return ReportingBackend()


@pytest.fixture
def cache(backend: ReportingBackend) -> Iterator[TieredCache]:
    c = make_cache(
        cache_registry(),
        instance=backend,
        host_pages=12,
        model="llama-test",
        tenant="acme",
        tp_rank=1,
        tp_size=2,
    )
    yield c
    c.close()


def _samples(cache: TieredCache) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] parsed from the text exposition."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(cache.prometheus_text()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def _value(samples: dict[str, Any], name: str, **labels: str) -> float:
    matches = [v for got, v in samples[name] if all(got.get(k) == x for k, x in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return float(matches[0])


def _evict(cache: TieredCache) -> None:
    put_pages(cache, range(900, 948), start=8)
    assert cache.flush(JOIN)


def test_every_series_carries_model_rank_tenant_and_backend(cache: TieredCache) -> None:
    keys = put_pages(cache, range(32))
    load_and_check(cache, keys)
    samples = _samples(cache)
    assert len(samples) > 20  # sample names, each with several series
    for name, series in samples.items():
        assert name.startswith("kvtier_"), name
        for labels, _ in series:
            assert {k: labels.get(k) for k in IDENTITY} == IDENTITY, (name, labels)


def test_bandwidth_per_direction_is_bytes_and_seconds(cache: TieredCache) -> None:
    keys = put_pages(cache, range(32))  # device -> host -> storage
    _evict(cache)
    assert load_and_check(cache, keys) == 8  # storage -> host -> device
    samples = _samples(cache)
    page = cache.geometry.bytes_per_page
    for direction in ("device_to_host", "host_to_device", "storage_read", "storage_write"):
        moved = _value(samples, "kvtier_transferred_bytes_total", direction=direction)
        busy = _value(samples, "kvtier_transfer_seconds_total", direction=direction)
        assert moved >= 8 * page, direction
        assert busy > 0, direction
    assert _value(samples, "kvtier_transferred_bytes_total", direction="storage_read") == 8 * page


def test_integrity_rejections_by_reason(cache: TieredCache, backend: ReportingBackend) -> None:
    keys = put_pages(cache, range(32))
    _evict(cache)
    with backend._lock:
        blob = backend._pages[keys[0]]
        blob[-1] ^= 0xFF  # payload no longer matches its checksum
        backend._pages[keys[4]] = bytearray(backend._pages[keys[5]])  # another key's page
    assert load_and_check(cache, keys[:1]) == 0
    assert load_and_check(cache, keys[4:5]) == 0
    samples = _samples(cache)
    reasons = {labels["reason"]: v for labels, v in samples["kvtier_page_rejections_total"]}
    assert set(reasons) == {r.value for r in Rejection}  # every reason, 0 until it happens
    assert reasons["corrupt_checksum"] == 1
    assert reasons["wrong_key"] == 1
    assert sum(reasons.values()) == 2


def test_the_backends_own_numbers_are_exported_by_name(cache: TieredCache) -> None:
    put_pages(cache, range(16))
    samples = _samples(cache)
    stat = {labels["name"]: v for labels, v in samples["kvtier_backend_stat"]}
    assert stat["put_failed.NO_AVAILABLE_HANDLE"] == 3
    assert stat["debris_directories"] == 2
    assert stat["master_up"] == 1
    assert stat["hit_ratio_hint"] == 0.5
    assert stat["puts"] == 4  # the memory backend's own counter
    assert "mode" not in stat and "flag" not in stat
    assert _value(samples, "kvtier_backend_stats_up") == 1


def test_occupancy_per_tier(cache: TieredCache) -> None:
    put_pages(cache, range(16))  # 4 pages
    samples = _samples(cache)
    assert _value(samples, "kvtier_host_pages", state="total") == 12
    assert _value(samples, "kvtier_host_pages", state="used") == 4
    assert _value(samples, "kvtier_host_pages", state="cached") == 4
    page = cache.geometry.bytes_per_page
    assert _value(samples, "kvtier_host_bytes", state="total") == 12 * page
    assert _value(samples, "kvtier_host_bytes", state="used") == 4 * page
    assert _value(samples, "kvtier_storage_pages") == 4
    assert _value(samples, "kvtier_storage_bytes") == cache.backend.stats()["bytes"]
    assert _value(samples, "kvtier_storage_capacity_bytes") == 1 << 20


def test_storage_occupancy_is_absent_where_the_backend_does_not_know() -> None:
    plain = make_cache(cache_registry(), instance=_NoOccupancy())
    try:
        samples = _samples(plain)
        assert "kvtier_storage_pages" not in samples
        assert "kvtier_storage_bytes" not in samples
        assert "kvtier_host_pages" in samples
    finally:
        plain.close()


class _NoOccupancy(MemoryBackend):
    def __init__(self) -> None:
        super().__init__(MemoryConfig())

    def stats(self) -> dict[str, int | float]:
        return {"puts": 0}


def test_failure_causes_and_timeouts_exist_before_they_happen(cache: TieredCache) -> None:
    samples = _samples(cache)
    causes = {labels["cause"] for labels, _ in samples["kvtier_failures_total"]}
    assert {"backend_timeout", "backend_refused", "storage_put", "host_exhausted"} <= causes
    ops = {labels["operation"] for labels, _ in samples["kvtier_backend_call_timeouts_total"]}
    assert {"exists", "get", "put"} <= ops
    assert _value(samples, "kvtier_backend_calls_stuck") == 0


# --- docs/operating.md cannot drift -----------------------------------------------------


def _documented() -> set[str]:
    """Metric names in docs/operating.md's metrics table (first column, in backticks)."""
    return set(re.findall(r"^\| `(kvtier_[a-z0-9_]+)`", _section("metrics"), re.M))


def _emitted(cache: TieredCache) -> set[str]:
    return {
        line.split()[2]
        for line in cache.prometheus_text().splitlines()
        if line.startswith("# TYPE ")
    }


def test_every_emitted_metric_is_documented_and_every_documented_one_is_emitted(
    cache: TieredCache,
) -> None:
    emitted = _emitted(cache)  # this backend reports pages, bytes and capacity: all of them
    documented = _documented()
    assert emitted - documented == set(), "emitted but not in docs/operating.md"
    assert documented - emitted == set(), "in docs/operating.md but never emitted"


def test_the_doc_names_every_failure_cause_and_rejection_reason() -> None:
    from kvtier.cache.metrics import BACKEND_CALLS, FAILURE_CAUSES

    text = DOC.read_text(encoding="utf-8")
    for name in (*FAILURE_CAUSES, *(r.value for r in Rejection), *BACKEND_CALLS):
        assert f"`{name}`" in text, name


# --- one vocabulary: every counter of every engine path is registered once ---------------


def _section(name: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"<!-- {name}:start")
    start = text.index("-->", start) + len("-->\n")
    return text[start : text.index(f"<!-- {name}:end -->")].strip()


def test_the_doc_lists_the_registry_as_generated() -> None:
    from kvtier.core.metrics import (
        causes_markdown,
        counters_markdown,
        families_markdown,
        storage_metrics_markdown,
    )

    assert _section("causes") == causes_markdown()
    assert _section("counters") == counters_markdown()
    assert _section("metrics") == families_markdown()
    assert _section("storage-metrics") == storage_metrics_markdown()


def test_each_counter_is_registered_once() -> None:
    from kvtier.core.metrics import COUNTERS

    names = [name for specs in COUNTERS.values() for spec in specs for name in spec.names()]
    assert len(names) == len(set(names)), "a counter is registered twice"
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in names)


def test_every_path_reports_registered_counters_only(tmp_path: Path) -> None:
    import torch
    from test_vllm import _plan

    from kvtier.core.metrics import counter_names
    from kvtier.integrations.vllm import VLLMSection
    from kvtier.integrations.vllm.messages import PageOp
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.worker import WorkerSide

    store_names = set(counter_names("page_store"))
    _tiered_cache_reports_registered_counters_only(tmp_path)

    plan = _plan("file", {"root": str(tmp_path / "pages")})
    worker = WorkerSide(plan, VLLMSection(backend="file"))
    caches = {f"model.layers.{i}.a": torch.randn(8, 2, 32, 128).to(torch.bfloat16) for i in (0, 1)}
    worker.register(caches, {"model.layers.0.a": 0, "model.layers.1.a": 1}, 8)
    worker.submit_saves([PageOp("r", ["k0"], [0], 0)])
    worker.flush()
    worker.start_loads([PageOp("q", ["k0", "k9"], [4, 5], 0)])
    worker.take_load_errors()
    reported = worker.stats()
    store_series = _store_series(worker.prometheus_collector())
    worker.close()
    registered = set(counter_names("vllm_worker")) | {f"store_{n}" for n in store_names}
    assert set(reported) <= registered, set(reported) - registered
    assert reported["load_failed_pages"] == 1 and reported["store_misses"] == 1

    # the storage tier's families: the same names a TieredCache exposes for its own
    assert store_series and store_series <= _documented()
    assert {"kvtier_page_rejections_total", "kvtier_backend_stat"} <= store_series
    side = SchedulerSide(plan, VLLMSection(backend="file"), cache_registry_store())
    assert set(side.stats()) == set(counter_names("vllm_scheduler"))


# What TieredCache.stats() holds besides counters: rates, gauges, settings, the backend's
# own numbers (exported by name as kvtier_backend_stat), and the page store's bounded-call
# view ``backend_calls`` (its timed_out / refused repeat the page store's registered
# backend_timeouts / backend_refused; its late_returns is not registered yet).
_NOT_REGISTERED = (
    ("host", "hit_rate"),
    ("host", "pages"),
    ("storage", "hit_rate"),
    ("bandwidth_bytes_per_s",),
    ("latency_seconds",),
    ("page_bytes",),
    ("failures_total",),  # the sum of failures_<cause>
    ("queues",),
    ("backend",),
    ("backend_calls",),
    ("policies",),
    ("tiers", "*", "tier"),
    ("tiers", "*", "capacity_bytes"),
    ("tiers", "*", "occupancy_bytes"),
    ("tiers", "*", "queue_depth"),
    ("tenants", "*", "quota_bytes"),
    ("tenants", "*", "bytes"),
    ("events", "subscribers"),
)
_CACHE_PARTS = ("host", "storage", "pages", "bytes", "busy_seconds", "failures")


def _numbers(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every number in a stats() dict, by path (list items and tenants as ``*``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, (*path, "*" if path == ("tenants",) else str(key)))
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item, (*path, "*"))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def _registered_as(path: tuple[str, ...]) -> tuple[str, str] | None:
    """(who counts it, its registered name) for a counter of stats(), as
    docs/operating.md's READ_AT says; None for what is listed as no counter."""
    if any(path[: len(prefix)] == prefix for prefix in _NOT_REGISTERED):
        return None
    if len(path) == 2 and path[0] in _CACHE_PARTS:
        return "tiered_cache", "_".join(path)
    if path[0] == "page_store" or path[:3] == ("tiers", "*", "store"):
        return "page_store", path[-1]
    if path in (("tiers", "*", "bytes_read"), ("tiers", "*", "bytes_written")):
        return "page_store", path[2]  # summed over the tier's page stores
    if path[:2] == ("tiers", "*") and len(path) == 3:
        return "storage_tier", path[2]
    if path == ("tenants", "*", "quota_evictions"):
        return "storage_chain", "tenant_quota_evictions"
    if path[0] == "events":
        return "storage_chain", f"events_{path[1]}"
    raise AssertionError(f"stats(){path}: a number that is no registered counter")


def _reported(stats: dict[str, Any]) -> dict[str, set[str]]:
    """The registered names a TieredCache's stats() reports, by who counts them."""
    from kvtier.core.metrics import counter_names

    out: dict[str, set[str]] = {}
    for path, _ in _numbers(stats):
        named = _registered_as(path)
        if named is not None:
            counted_by, name = named
            assert name in counter_names(counted_by), (path, name, counted_by)
            out.setdefault(counted_by, set()).add(name)
    return out


class _Refusing(MemoryBackend):
    """Stores nothing: every page put fails (a ``storage_put`` failure)."""

    def __init__(self) -> None:
        super().__init__(MemoryConfig())

    def put(self, keys: Any, pages: Any) -> list[bool]:
        return [False] * len(keys)


def _tiered_cache_reports_registered_counters_only(tmp_path: Path) -> None:
    """Two tiers and a tenant (every tier and tenant counter), then a cache whose storage
    refuses pages (a failure by cause): every number of stats() is a registered counter
    or listed as none, and every registered counter is reported."""
    from test_tiers import _file, _open

    from kvtier.core.metrics import zeroed

    cache = _open(
        [_file(tmp_path / "fast"), _file(tmp_path / "slow")],
        config={"tenants": {"team-a": {"quota_bytes": 1 << 20}}},
    )
    try:
        keys = put_pages(cache, range(16))
        assert load_and_check(cache, keys) == 4
        reported = _reported(cache.stats())
    finally:
        cache.close()
    # each counter from the start (a family's members once they count, if it has a total;
    # a failure's cause once it fails)
    assert set(reported) == {"page_store", "tiered_cache", "storage_tier", "storage_chain"}
    failures = {f"failures_{cause.value}" for cause in Cause}
    for counted_by, names in reported.items():
        assert names == set(zeroed(counted_by)) - failures, counted_by

    refusing = make_cache(cache_registry(), instance=_Refusing())
    try:
        put_pages(refusing, range(16))
        assert refusing.flush(JOIN)
        stats = refusing.stats()
    finally:
        refusing.close()
    assert stats["failures"] == {"storage_put": 4}
    assert reported["tiered_cache"] | {"failures_storage_put"} == _reported(stats)["tiered_cache"]


def test_a_tiered_cache_counts_registered_names_only() -> None:
    from kvtier.cache.stats import CacheStats

    stats = CacheStats()
    with pytest.raises(UnknownNameError, match="tiered_cache counter") as info:
        stats.add("host_hit")  # a typo of a registered name
    assert info.value.value == "host_hit" and "host_hits" in str(info.value)
    with pytest.raises(UnknownNameError, match="'failures_tired'"):
        stats.fail("tired")
    with pytest.raises(UnknownNameError, match="'bytes_sideways'"):
        stats.busy("sideways", 0.5, 10)
    stats.add("host_hits", 3)
    stats.busy("storage_read", 0.5, 10)
    for cause in Cause:
        stats.fail(cause.value, 2)
    snap = stats.snapshot()
    assert snap["host"]["hits"] == 3 and snap["bytes"]["storage_read"] == 10
    assert snap["bandwidth_bytes_per_s"]["storage_read"] == 20.0
    assert snap["failures"] == {cause.value: 2 for cause in Cause}
    assert snap["failures_total"] == 2 * len(Cause)


def cache_registry_store() -> Any:
    class Everything:
        def exists(self, keys: list[str]) -> list[bool]:
            return [True] * len(keys)

    return Everything()


def test_the_sglang_adapter_reports_registered_counters_only(tmp_path: Path) -> None:
    from sglang_host_pool import Controller, MHAHostPool, sglang_or_skip, storage_config

    sglang_or_skip()
    from test_sglang import _fill, _hashes, extra_config

    from kvtier.core.metrics import counter_names

    pool = MHAHostPool()
    controller = Controller.attach(storage_config(extra_config=extra_config("memory", None)), pool)
    try:
        hashes = _hashes(2, 16)
        assert controller.backup(hashes, _fill(pool, 2)[0]) == 32
        assert controller.hit_query(hashes) == hashes
        stats = controller.storage.kvtier_stats()
        sglang_series = _store_series(controller.storage.prometheus_collector())
    finally:
        controller.storage.close()
    assert sglang_series and sglang_series <= _documented()
    ours = set(counter_names("sglang")) | set(counter_names("page_store"))
    backend = {name for name in stats if name.startswith("backend_") and name not in ours}
    assert set(stats) - backend <= ours, set(stats) - backend - ours
    assert stats["puts"] == 2


def _store_series(collector: Any) -> set[str]:
    from kvtier.cache.metrics import prometheus_text

    return {
        line.split()[2]
        for line in prometheus_text(collector).splitlines()
        if line.startswith("# TYPE ")
    }
