"""A chain of storage tiers behind one TieredCache: cascade, lookup, promotion, integrity.

Through the public API, with real backends (memory and file tiers; the Mooncake tiers
are in tests/test_tiers_mooncake.py): a page stored goes to the first tier at once and
to the write-through tiers below on the chain's worker; a lookup takes the longest prefix
across the tiers; a hit in a lower tier is served and promoted; a page that fails
verification in one tier is asked of the next; a tier that hangs is bypassed within the
bound; every move is an event; a mistake in a tier's config names the tier. Then what
the chain promises around evictions: a running load's pages are pinned through a
promotion, every eviction above a ``write: back`` tier hands the page down, a lookup can
ask whether a promotion is pending, admission counts hits, quotas survive a restart, the
cascade queue is bounded in pages, and the Prometheus exposition has every tier and
tenant series.
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
    slots,
)
from test_cache_bounded import HangingBackend

from kvtier.cache import TieredCache
from kvtier.core.config import load_engine_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.errors import ConfigError, UnknownKeyError, UnknownNameError
from kvtier.plugins.registry import Registry
from kvtier.storage.events import EventKind
from kvtier.testing.content import check_pages


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
    """The queue holds ``tier_queue_pages`` pages (a public option), counted per target
    tier; beyond it pages are dropped and counted, and the first tier keeps everything."""
    hanging = HangingBackend()
    hanging.hang.add("put")
    registry = shared_backend(hanging)
    cache = _open(
        [_file(tmp_path / "fast"), {"backend": "shared"}],
        registry,
        options={"backend_call_timeout_s": 30.0, "tier_queue_pages": 8},
    )
    try:
        for start in range(0, 40 * 16, 16):  # 40 batches of 4 pages: far more than 8 pages
            put_pages(cache, range(start, start + 16), start=start // 16 % 8)
        tiers = cache.stats()["tiers"]
        # the worker holds the first batch in the hung put, one more waits: 8 pages queued
        assert [t["queue_depth"] for t in tiers] == [0, 8]
        assert tiers[1]["drops"] == 40 * 4 - 8
        keys = cache.keys(list(range(16)))
        assert _tier_has(cache, 0, keys) == [True] * 4  # the first tier kept everything
    finally:
        hanging.release.set()
        cache.close()
    with pytest.raises(ConfigError, match="tier_queue_pages"):
        _open([_file(tmp_path / "x")], options={"tier_queue_pages": 0})


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


def test_a_put_larger_than_a_tenants_quota_keeps_its_first_pages(tmp_path: Path) -> None:
    from test_cache import slots

    from kvtier.testing.content import fill_pages

    quota = _capacity(3)
    cache = _open(
        [_file(tmp_path / "fast"), _file(tmp_path / "slow")],
        config={"tenants": {"team-a": {"quota_bytes": quota}}},
    )
    try:
        keys = cache.keys(list(range(16)), tenant="team-a")  # 4 pages, one put
        where = slots(0, len(keys), cache.geometry.page_size)
        fill_pages(cache.device_pool, keys, where)
        cache.backup(keys, where).wait(JOIN)
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        for tier in (0, 1):  # the prefix's first 3 pages, never its last without them
            assert _tier_has(cache, tier, keys) == [True, True, True, False]
        tenant = cache.stats()["tenants"]["team-a"]
        assert tenant["bytes"] == [quota, quota] and tenant["quota_evictions"] == 0
        refused = [t["quota_refused"] for t in cache.page_store.tier_stats()]
        assert refused == [1, 0]  # the tier below was offered the 3 pages the first took
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


# --- pins, write-back on every eviction, "not yet", admission after hits ------------------


def _capacity(pages: int) -> int:
    """Bytes of ``pages`` stored pages (envelope slot and payload) of GEOMETRY."""
    return pages * (load_engine_config(GEOMETRY).geometry().bytes_per_page + 4096)


def _chain_get(cache: TieredCache, keys: list[str]) -> list[bool]:
    """A lookup straight through the chain into spare host pages (as an engine adapter
    reads), bypassing the host pool's index."""
    pages = cache.host_pool.allocate(len(keys))
    try:
        return list(cache.page_store.get(keys, pages))
    finally:
        cache.host_pool.free(pages)


def test_a_running_load_keeps_its_pages_through_a_promotion(tmp_path: Path) -> None:
    """A prefetched prefix, held by its handle, stays in a full first tier while a lower
    tier's hit is promoted into it; released, it leaves for the next promotion."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    tiers = [_file(fast, capacity_bytes=_capacity(4)), _file(slow)]
    with _open(tiers) as first:
        other = put_pages(first, range(16))
        assert first.page_store.flush(JOIN)  # cascaded before the first tier evicts it
        held = put_pages(first, range(100, 116), start=4)  # the first tier: held only
        assert first.flush(JOIN) and first.page_store.flush(JOIN)
        assert _tier_has(first, 0, held) == [True] * 4
        assert _tier_has(first, 0, other) == [False] * 4
    with _open(tiers) as cache:  # an empty host pool: loads read the tiers
        handle = cache.prefetch(held)
        assert handle.wait(JOIN) == 4 and handle.storage_hits == 4
        assert load_and_check(cache, other) == 4  # from the slow tier, promoted
        assert cache.page_store.flush(JOIN)
        assert _tier_has(cache, 0, held) == [True] * 4  # the load's pages stayed
        assert _tier_has(cache, 0, other) == [False] * 4  # the promotion found no room
        assert cache.stats()["tiers"][0]["promotions"] == 0
        where = slots(40, 4, cache.geometry.page_size)
        assert cache.load(handle, where) == 4  # loading every layer releases the handle
        assert all(check_pages(cache.device_pool, held, where))
        assert len(cache.page_store.pins) == 0
        assert _chain_get(cache, other) == [True] * 4  # promoted again: room now
        assert cache.page_store.flush(JOIN)
        assert _tier_has(cache, 0, other) == [True] * 4
        assert cache.stats()["tiers"][0]["promotions"] == 4


def test_a_promotion_into_a_full_tier_above_write_back_loses_nothing(tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    tiers = [_file(fast, capacity_bytes=_capacity(4)), {**_file(slow), "write": "back"}]
    with _open(tiers) as first:
        old = put_pages(first, range(16))
        new = put_pages(first, range(100, 116), start=4)  # writes `old` back
        assert first.flush(JOIN) and first.page_store.flush(JOIN)
        assert _tier_has(first, 0, new) == [True] * 4 and _tier_has(first, 1, old) == [True] * 4
        assert _tier_has(first, 1, new) == [False] * 4
    with _open(tiers) as cache:
        assert load_and_check(cache, old) == 4  # from the back tier, promoted up
        assert cache.page_store.flush(JOIN)
        assert _tier_has(cache, 0, old) == [True] * 4
        assert _tier_has(cache, 1, new) == [True] * 4  # the promotion's victims went down
        tiers_now = cache.stats()["tiers"]
        assert tiers_now[0]["promotions"] == 4 and tiers_now[0]["evictions"] == 4
        assert tiers_now[1]["cascades"] == 4 and tiers_now[1]["drops"] == 0
        assert load_and_check(cache, new) == 4  # nothing lost (promoted back in its turn)
        assert cache.page_store.flush(JOIN)
        assert _tier_has(cache, 1, old + new) == [True] * 8
        assert cache.stats()["tiers"][1]["drops"] == 0


def test_a_write_back_tier_below_the_second_receives_its_evictions(tmp_path: Path) -> None:
    tiers = [
        _file(tmp_path / "a", capacity_bytes=_capacity(4)),
        _file(tmp_path / "b", capacity_bytes=_capacity(4)),
        {**_file(tmp_path / "c"), "write": "back"},
    ]
    with _open(tiers) as cache:
        old = put_pages(cache, range(16))
        assert cache.page_store.flush(JOIN)  # cascaded before the first tier evicts it
        new = put_pages(cache, range(100, 116), start=4)
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        assert _tier_has(cache, 1, new) == [True] * 4
        assert _tier_has(cache, 1, old) == [False] * 4
        assert _tier_has(cache, 2, old) == [True] * 4  # handed down by the second tier
        assert _tier_has(cache, 2, new) == [False] * 4  # back, not through
        tiers_now = cache.stats()["tiers"]
        assert tiers_now[1]["evictions"] == 4 and tiers_now[2]["cascades"] == 4
        assert tiers_now[2]["drops"] == 0


def test_write_back_under_a_tier_without_capacity_is_refused(tmp_path: Path) -> None:
    from kvtier.core.errors import UnsupportedCombinationError

    device = TorchDevicePool(load_engine_config(GEOMETRY).geometry(), 16)
    config = {
        **GEOMETRY,
        "tiers": [_file(tmp_path / "a"), {**_file(tmp_path / "b"), "write": "back"}],
    }
    with pytest.raises(
        UnsupportedCombinationError,
        match=r"(?s)tiers\[1\]\.write: 'back'.*tiers\[0\]\.extra_config",
    ):
        TieredCache.open(config, device, registry=cache_registry())


def test_pending_says_which_pages_are_being_promoted(tmp_path: Path) -> None:
    """While a promotion is queued or being written, ``pending`` says so (an engine's
    lookup answers "ask again"); the queue depth counts its pages on its target tier."""
    hanging = HangingBackend()
    registry = shared_backend(hanging)
    cache = _open(
        [{"backend": "shared"}, _file(tmp_path / "slow")],
        registry,
        options={"backend_call_timeout_s": 30.0},
    )
    try:
        chain = cache.page_store
        keys = put_pages(cache, range(16))
        others = cache.keys(list(range(100, 116)))
        assert chain.flush(JOIN) and _tier_has(cache, 1, keys) == [True] * 4
        chain.tiers[0].store.delete(keys)  # only the lower tier holds them now
        assert chain.pending(keys) == [False] * 4
        hanging.hang.add("put")
        puts = hanging.entered.get("put", 0)
        assert _chain_get(cache, keys) == [True] * 4  # served from the lower tier
        deadline = time.monotonic() + JOIN
        while hanging.entered.get("put", 0) == puts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert chain.pending(keys) == [True] * 4  # the promotion's put is running
        assert chain.pending(others) == [False] * 4
        assert [t["queue_depth"] for t in cache.stats()["tiers"]] == [4, 0]
        hanging.release.set()
        assert chain.flush(JOIN)
        assert chain.pending(keys) == [False] * 4
        assert _tier_has(cache, 0, keys) == [True] * 4
        assert [t["queue_depth"] for t in cache.stats()["tiers"]] == [0, 0]
    finally:
        hanging.release.set()
        cache.close()


def test_frequency_admission_admits_a_page_after_hits(tmp_path: Path) -> None:
    """``min_hits: 2``: the cascade's offer is the first sight (refused); a hit in the tier
    above is the second, and the page is offered again and admitted. A page never hit
    stays out."""
    cache = _open(
        [
            _file(tmp_path / "fast"),
            {**_file(tmp_path / "slow"), "admission": {"policy": "frequency", "min_hits": 2}},
        ]
    )
    try:
        hit = put_pages(cache, range(16))
        cold = put_pages(cache, range(100, 116), start=4)
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        assert _tier_has(cache, 1, hit + cold) == [False] * 8
        assert cache.stats()["tiers"][1]["admission_refused"] == 8
        assert _chain_get(cache, hit) == [True] * 4  # served by the first tier
        assert cache.page_store.flush(JOIN)
        assert _tier_has(cache, 1, hit) == [True] * 4
        assert _tier_has(cache, 1, cold) == [False] * 4
        tiers = cache.stats()["tiers"]
        assert tiers[1]["cascades"] == 4 and tiers[1]["admission_refused"] == 8
    finally:
        cache.close()


def test_quotas_count_the_pages_stored_before_a_restart(tmp_path: Path) -> None:
    quota = _capacity(4)
    tiers = [_file(tmp_path / "pages")]
    tenants = {"tenants": {"team-a": {"quota_bytes": quota}}}
    with _open(tiers, config=tenants) as first:
        before = first.keys(list(range(16)), tenant="team-a")
        fill_and_backup(first, before)
        assert first.flush(JOIN)
    with _open(tiers, config=tenants) as cache:
        assert cache.stats()["tenants"]["team-a"]["bytes"] == [quota]  # the rebuilt index
        after = cache.keys(list(range(100, 116)), tenant="team-a")
        fill_and_backup(cache, after)
        assert cache.flush(JOIN)
        assert _tier_has(cache, 0, before) == [False] * 4  # its own older pages made room
        assert _tier_has(cache, 0, after) == [True] * 4
        tenant = cache.stats()["tenants"]["team-a"]
        assert tenant["bytes"] == [quota] and tenant["quota_evictions"] == 4


def test_prometheus_has_every_tier_and_tenant_series(tmp_path: Path) -> None:
    """A two-tier, one-tenant cache's exposition: each ``kvtier_tier_*`` series for both
    tiers and each ``kvtier_tenant_*`` series for the tenant, with the values the run
    implies."""
    pytest.importorskip("prometheus_client", reason="needs the 'prometheus' extra")
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.cache.metrics import identity_of

    quota = _capacity(4)
    page = _capacity(1)  # a stored page: its envelope slot and payload
    cache = _open(
        [_file(tmp_path / "fast"), _file(tmp_path / "slow")],
        config={"tenants": {"team-a": {"quota_bytes": quota}}},
    )
    try:
        first = cache.keys(list(range(16)), tenant="team-a")
        fill_and_backup(cache, first)
        assert cache.page_store.flush(JOIN)
        second = cache.keys(list(range(100, 116)), tenant="team-a")
        fill_and_backup(cache, second)  # over the quota in each tier: `first` goes
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        assert _chain_get(cache, second) == [True] * 4  # 4 hits in the first tier
        samples: dict[str, dict[tuple[str, ...], float]] = {}
        identity = identity_of(cache.plan)
        assert identity["tenant"] == ""  # the cache's own namespace has no tenant
        for family in text_string_to_metric_families(cache.prometheus_text()):
            for sample in family.samples:
                labels = dict(sample.labels)
                tier = labels.pop("tier", None)
                if sample.name.startswith("kvtier_tier_"):
                    assert labels == identity and tier is not None, sample
                    samples.setdefault(sample.name, {})[(tier,)] = sample.value
                elif sample.name.startswith("kvtier_tenant_"):
                    # the tenant's name is the identity's tenant label
                    assert labels == {**identity, "tenant": "team-a"}, sample
                    where = ("team-a",) if tier is None else (tier, "team-a")
                    samples.setdefault(sample.name, {})[where] = sample.value
    finally:
        cache.close()
    from kvtier.core.metrics import COUNTERS

    fast, slow = ("0:file",), ("1:file",)
    # the page store's counters per tier (its bytes as read_bytes / written_bytes), and
    # the chain's own
    store = {"hits", "misses", "puts", "put_failures", "put_tainted"}
    store |= {"read_bytes", "written_bytes"}
    expected_tier = store | {spec.name for spec in COUNTERS["storage_tier"]}
    assert {f"kvtier_tier_{n}_total" for n in expected_tier} | {
        "kvtier_tier_queue_depth",
        "kvtier_tier_occupancy_bytes",
    } == {name for name in samples if name.startswith("kvtier_tier_")}
    for name, by_tier in samples.items():
        if name.startswith("kvtier_tier_"):
            assert set(by_tier) == {fast, slow}, name
    values = {name: by_tier for name, by_tier in samples.items()}
    assert values["kvtier_tier_hits_total"] == {fast: 4, slow: 0}
    assert values["kvtier_tier_misses_total"] == {fast: 0, slow: 0}
    assert values["kvtier_tier_get_calls_total"] == {fast: 1, slow: 0}
    assert values["kvtier_tier_get_seconds_total"][fast] > 0
    assert values["kvtier_tier_cascades_total"] == {fast: 0, slow: 8}
    assert values["kvtier_tier_quota_evictions_total"] == {fast: 4, slow: 4}
    assert values["kvtier_tier_evictions_total"] == {fast: 4, slow: 4}
    assert values["kvtier_tier_written_bytes_total"] == {fast: 8 * page, slow: 8 * page}
    # what the first tier served (4 pages) and what the cascades read back from it (8)
    assert values["kvtier_tier_read_bytes_total"] == {fast: 12 * page, slow: 0}
    for name in ("promotions", "drops", "failures", "admission_refused"):
        assert values[f"kvtier_tier_{name}_total"] == {fast: 0, slow: 0}, name
    assert values["kvtier_tier_queue_depth"] == {fast: 0, slow: 0}
    assert values["kvtier_tier_occupancy_bytes"] == {fast: quota, slow: quota}
    assert {name for name in samples if name.startswith("kvtier_tenant_")} == {
        "kvtier_tenant_bytes",
        "kvtier_tenant_quota_evictions_total",
    }
    assert values["kvtier_tenant_bytes"] == {
        ("0:file", "team-a"): quota,
        ("1:file", "team-a"): quota,
    }
    assert values["kvtier_tenant_quota_evictions_total"] == {("team-a",): 8}


def _flip(root: Path, key: str) -> None:
    """Flip one payload bit of ``key``'s page file under ``root``."""
    victim = next(p for p in root.rglob("*.kv") if key in p.name)
    raw = bytearray(victim.read_bytes())
    raw[-9] ^= 0x40
    victim.write_bytes(bytes(raw))


def test_verdicts_name_only_pages_no_tier_could_serve(tmp_path: Path) -> None:
    """``StorageChain.get(verdicts=)``: a page bad in one tier and good in the next is
    served with no verdict; one bad where no other tier holds it is proven bad; one bad
    where another tier could not answer (its call failed) is not, so an engine deleting
    proven-bad pages never removes a copy that may still be good."""
    hanging = HangingBackend()
    registry = shared_backend(hanging)
    fast = tmp_path / "fast"
    cache = _open(
        [_file(fast), _file(tmp_path / "slow"), {"backend": "shared"}],
        registry,
        options={"backend_call_timeout_s": 0.3},
    )
    try:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        chain = cache.page_store
        for key in keys[:3]:
            _flip(fast, key)
        # page 0: bad in fast, good in slow; page 1: bad in fast, gone from slow and shared
        chain.tiers[1].store.delete([keys[1]])
        chain.tiers[2].store.delete([keys[1]])
        pages = cache.host_pool.allocate(3)
        try:
            verdicts: dict[int, str] = {}
            assert list(chain.get(keys[:3], pages, verdicts=verdicts)) == [True, False, True]
            assert verdicts == {1: "corrupt_checksum"}
            # page 2: bad in fast; gone from slow; the shared tier's call fails (hangs)
            assert cache.page_store.flush(JOIN)
            _flip(fast, keys[2])  # its promotion wrote page 2 back into fast: bad again
            chain.tiers[1].store.delete([keys[2]])
            hanging.hang.add("get")
            verdicts = {}
            assert list(chain.get([keys[2]], pages[:1], verdicts=verdicts)) == [False]
            assert verdicts == {}  # the shared tier never answered: nothing is proven
        finally:
            hanging.release.set()
            cache.host_pool.free(pages)
    finally:
        hanging.release.set()
        cache.close()
