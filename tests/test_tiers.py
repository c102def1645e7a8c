"""A chain of storage tiers behind one TieredCache: cascade, lookup, promotion, integrity.

Through the public API, with real backends (memory and file tiers; the Mooncake tiers
are in tests/test_tiers_mooncake.py): a page stored goes to the first tier at once and
to the write-through tiers below on the chain's worker; a lookup takes the longest prefix
across the tiers; a hit in a lower tier is served and promoted; a page that fails
verification in one tier is asked of the next; a tier that hangs is bypassed within the
bound; every move is an event; a mistake in a tier's config names the tier.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cache import (
    GEOMETRY,
    JOIN,
    cache_registry,
    load_and_check,
    put_pages,
    shared_backend,
)
from test_cache_bounded import HangingBackend

from kvtier.cache import TieredCache
from kvtier.cache.events import EventKind
from kvtier.core.config import load_engine_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.errors import ConfigError, UnknownKeyError, UnknownNameError
from kvtier.plugins.registry import Registry


def _open(
    tiers: list[dict[str, Any]], registry: Registry | None = None, **more: Any
) -> TieredCache:
    config = load_engine_config(
        {**GEOMETRY, "host_pages": 12, "tiers": tiers, **more.pop("config", {})}
    )
    device = TorchDevicePool(config.geometry(), 512)
    return TieredCache.open(config, device, registry=registry or cache_registry(), **more)


def _file(root: Path, **options: Any) -> dict[str, Any]:
    return {"backend": "file", "extra_config": {"root": str(root), "min_free_bytes": 0, **options}}


def _evict_host(cache: TieredCache) -> None:
    """Push the first pages out of the 12-page host pool, so they must come from storage."""
    put_pages(cache, range(900, 948), start=8)
    assert cache.flush(JOIN)


@pytest.fixture
def two_files(tmp_path: Path) -> Iterator[tuple[TieredCache, Path, Path]]:
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    cache = _open([_file(fast), _file(slow)])
    yield cache, fast, slow
    cache.close()


def _tier_has(cache: TieredCache, tier: int, keys: list[str]) -> list[bool]:
    return list(cache.page_store.tiers[tier].store.exists(keys))


def test_a_single_backend_is_a_chain_of_one(tmp_path: Path) -> None:
    config = load_engine_config(
        {**GEOMETRY, "backend": "file", "extra_config": {"root": str(tmp_path)}}
    )
    with TieredCache.open(
        config, TorchDevicePool(config.geometry(), 64), registry=cache_registry()
    ) as cache:
        assert [t.name for t in cache.page_store.tiers] == ["0:file"]
        keys = put_pages(cache, range(16))
        assert cache.page_store.exists(keys) == [True] * 4
        assert [t["name"] for t in cache.stats()["tiers"]] == ["0:file"]


def test_pages_land_in_the_first_tier_then_cascade_down(
    two_files: tuple[TieredCache, Path, Path],
) -> None:
    cache, _, _ = two_files
    seen: list[Any] = []
    cache.page_store.events.subscribe(seen.extend)
    keys = put_pages(cache, range(16))
    assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
    assert _tier_has(cache, 0, keys) == [True] * 4
    assert _tier_has(cache, 1, keys) == [True] * 4
    stored = {(e.tier, e.key) for e in seen if e.kind is EventKind.STORED}
    assert stored == {(tier, key) for tier in (0, 1) for key in keys}
    tiers = cache.stats()["tiers"]
    assert [t["name"] for t in tiers] == ["0:file", "1:file"]
    assert tiers[1]["cascades"] == 4 and tiers[1]["drops"] == 0


def test_a_hit_in_a_lower_tier_is_served_and_promoted(tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    with _open([_file(fast), _file(slow)]) as first:
        keys = put_pages(first, range(16))
        assert first.flush(JOIN) and first.page_store.flush(JOIN)
    for page in fast.rglob("*.kv"):  # the fast tier is emptied (a new node, a wiped disk)
        page.unlink()
    with _open([_file(fast), _file(slow)]) as cache:
        seen: list[Any] = []
        cache.page_store.events.subscribe(seen.extend)
        assert _tier_has(cache, 0, keys) == [False] * 4
        assert load_and_check(cache, keys) == 4  # exact bytes, from the slow tier
        assert cache.page_store.flush(JOIN)
        assert _tier_has(cache, 0, keys) == [True] * 4  # promoted
        promoted = {e.key for e in seen if e.kind is EventKind.PROMOTED and e.tier == 0}
        assert promoted == set(keys)
        tiers = cache.stats()["tiers"]
        assert tiers[0]["promotions"] == 4
        assert tiers[1]["store"]["hits"] == 4 and tiers[0]["store"]["hits"] == 0


def test_a_page_bad_in_one_tier_is_served_from_the_next(
    two_files: tuple[TieredCache, Path, Path],
) -> None:
    cache, fast, _ = two_files
    keys = put_pages(cache, range(16))
    assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
    _evict_host(cache)
    victim = next(p for p in fast.rglob("*.kv") if keys[1] in p.name)
    raw = bytearray(victim.read_bytes())
    raw[-9] ^= 0x40  # one payload bit
    victim.write_bytes(bytes(raw))
    assert load_and_check(cache, keys) == 4  # every byte right, page 1 from the slow tier
    tiers = cache.stats()["tiers"]
    assert tiers[0]["store"]["invalid_corrupt_checksum"] == 1
    assert tiers[1]["store"]["hits"] >= 1


def test_the_longest_prefix_is_taken_across_the_tiers(
    two_files: tuple[TieredCache, Path, Path],
) -> None:
    cache, fast, _ = two_files
    keys = put_pages(cache, range(16))
    assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
    _evict_host(cache)
    for key in keys[1:3]:  # the middle pages only in the slow tier
        next(p for p in fast.rglob("*.kv") if key in p.name).unlink()
    assert cache.page_store.prefix_hits(keys) == 4
    assert load_and_check(cache, keys) == 4


def test_a_hung_lower_tier_never_blocks_the_first(tmp_path: Path) -> None:
    hanging = HangingBackend()
    hanging.hang.update({"put", "exists", "get"})
    registry = shared_backend(hanging)
    try:
        cache = _open(
            [_file(tmp_path / "fast"), {"backend": "shared"}],
            registry,
            options={"backend_call_timeout_s": 0.3},
        )
        try:
            t0 = time.monotonic()
            keys = put_pages(cache, range(16))
            assert time.monotonic() - t0 < 2.0  # the first tier's put is the caller's
            assert load_and_check(cache, keys) == 4
            _evict_host(cache)
            t0 = time.monotonic()
            assert load_and_check(cache, keys) == 4  # from the first tier; the other hangs
            assert time.monotonic() - t0 < 0.3 * 4 + 2.0
        finally:
            hanging.release.set()
            cache.close()
    finally:
        hanging.release.set()


def test_a_full_cascade_queue_drops_and_counts(tmp_path: Path) -> None:
    hanging = HangingBackend()
    hanging.hang.add("put")
    registry = shared_backend(hanging)
    cache = _open(
        [_file(tmp_path / "fast"), {"backend": "shared"}],
        registry,
        options={"backend_call_timeout_s": 30.0},
    )
    try:
        for start in range(0, 40 * 16, 16):  # far more batches than the queue holds
            cache.page_store._queue.maxsize = 2  # a tiny queue for the test
            put_pages(cache, range(start, start + 16), start=start // 16 % 8)
        assert cache.stats()["tiers"][1]["drops"] > 0
        keys = cache.keys(list(range(16)))
        assert _tier_has(cache, 0, keys) == [True] * 4  # the first tier kept everything
    finally:
        hanging.release.set()
        cache.close()


def test_tier_mistakes_name_the_tier(tmp_path: Path) -> None:
    device = TorchDevicePool(load_engine_config(GEOMETRY).geometry(), 16)
    with pytest.raises(UnknownKeyError, match=r"'roott' in tiers\[1\]\.extra_config"):
        TieredCache.open(
            {
                **GEOMETRY,
                "tiers": [
                    {"backend": "memory"},
                    {"backend": "file", "extra_config": {"roott": "x"}},
                ],
            },
            device,
            registry=cache_registry(),
        )
    with pytest.raises(UnknownNameError, match=r"memroy.*did you mean 'memory'"):
        TieredCache.open(
            {**GEOMETRY, "tiers": [{"backend": "memroy"}]}, device, registry=cache_registry()
        )
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.write"):
        load_engine_config({**GEOMETRY, "tiers": [{"backend": "memory", "write": "sideways"}]})
    with pytest.raises(ConfigError, match="either `backend`"):
        load_engine_config({**GEOMETRY, "backend": "file", "tiers": [{"backend": "memory"}]})


# --- quotas and write-back (through the tiers' eviction policies) ------------------------


def _page_bytes(cache: TieredCache) -> int:
    return cache.geometry.bytes_per_page + 4096  # the envelope slot and the payload


def test_a_tenant_over_its_quota_evicts_its_own_pages_only(tmp_path: Path) -> None:
    config = load_engine_config(GEOMETRY)
    quota = 4 * (config.geometry().bytes_per_page + 4096)
    cache = _open(
        [_file(tmp_path / "pages")],
        config={"tenants": {"team-a": {"quota_bytes": quota}, "team-b": {}}},
    )
    try:
        seen: list[Any] = []
        cache.page_store.events.subscribe(seen.extend)
        a_keys, b_keys = [], []
        for turn in range(2):
            tokens = list(range(turn * 16, turn * 16 + 16))
            for tenant, mine in (("team-a", a_keys), ("team-b", b_keys)):
                keys = cache.keys(tokens, tenant=tenant)
                fill_and_backup(cache, keys)
                mine.extend(keys)
        assert cache.flush(JOIN)
        assert _tier_has(cache, 0, b_keys) == [True] * 8  # the other tenant keeps every page
        assert sum(_tier_has(cache, 0, a_keys)) == 4
        tenants = cache.stats()["tenants"]
        assert tenants["team-a"]["bytes"] == [quota]
        assert tenants["team-a"]["quota_evictions"] == 4
        assert tenants["team-b"]["quota_evictions"] == 0
        evicted = {e.key for e in seen if e.kind is EventKind.EVICTED}
        assert evicted and evicted <= set(a_keys)
        assert {e.tenant for e in seen if e.kind is EventKind.EVICTED} == {"team-a"}
    finally:
        cache.close()


def fill_and_backup(cache: TieredCache, keys: list[str]) -> None:
    from test_cache import slots

    from kvtier.testing.content import fill_pages

    where = slots(0, len(keys), cache.geometry.page_size)
    fill_pages(cache.device_pool, keys, where)
    handle = cache.backup(keys, where)
    assert handle.wait(JOIN) and handle.ok, handle.error


def test_write_back_moves_the_first_tiers_victims_down(tmp_path: Path) -> None:
    config = load_engine_config(GEOMETRY)
    capacity = 4 * (config.geometry().bytes_per_page + 4096)
    cache = _open(
        [
            _file(tmp_path / "fast", capacity_bytes=capacity),
            {**_file(tmp_path / "slow"), "write": "back"},
        ]
    )
    try:
        keys = put_pages(cache, range(32))  # 8 pages into a 4-page first tier
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        fast, slow = _tier_has(cache, 0, keys), _tier_has(cache, 1, keys)
        assert sum(fast) <= 4
        assert all(f or s for f, s in zip(fast, slow, strict=True))  # nothing lost
        assert not any(f and s for f, s in zip(fast, slow, strict=True))  # back, not through
        _evict_host(cache)
        assert load_and_check(cache, keys) == 8
        assert cache.stats()["tiers"][0]["evictions"] >= 4
    finally:
        cache.close()


def test_a_policys_own_options_are_checked_and_named_by_tier(tmp_path: Path) -> None:
    from kvtier.cli import main

    config = {
        **GEOMETRY,
        "tiers": [
            {"backend": "memory"},
            {**_file(tmp_path), "admission": {"policy": "frequency", "min_hits": 0}},
        ],
    }
    device = TorchDevicePool(load_engine_config(GEOMETRY).geometry(), 16)
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.admission\.min_hits"):
        TieredCache.open(config, device, registry=cache_registry())
    config["tiers"][1]["admission"] = {"policy": "frequencyy"}
    with pytest.raises(UnknownNameError, match=r"frequencyy.*did you mean 'frequency'"):
        TieredCache.open(config, device, registry=cache_registry())
    import json

    good = {**config, "tiers": [{"backend": "memory"}, {**_file(tmp_path), "write": "back"}]}
    assert main(["check", "--config", json.dumps(good), "--strict-geometry"]) == 0


def test_the_first_tier_takes_no_admission_policy(tmp_path: Path) -> None:
    from kvtier.core.errors import UnsupportedCombinationError

    device = TorchDevicePool(load_engine_config(GEOMETRY).geometry(), 16)
    config = {**GEOMETRY, "tiers": [{**_file(tmp_path), "admission": "frequency"}]}
    with pytest.raises(
        UnsupportedCombinationError, match=r"(?s)tiers\[0\]\.admission.*write_policy"
    ):
        TieredCache.open(config, device, registry=cache_registry())


def test_kvtier_backends_lists_the_policies(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvtier.cli import main

    assert main(["backends", "--json"], registry=cache_registry()) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = {entry["name"]: entry["kind"] for entry in report["policies"]}
    assert kinds["lru"] == "eviction" and kinds["frequency"] == "admission"
    assert {"slru", "prefix"} <= set(kinds)
