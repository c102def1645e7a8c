"""A file tier over a real Mooncake master on loopback: the chain with a shared tier below.

Pages land in both tiers; a restart with the file tier emptied hits from Mooncake and
promotes into the file tier; a bit flipped in the file tier is served from Mooncake and
counted; killing the master mid-run leaves the cache serving from the file tier with
nothing wrong; a full Mooncake tier's capacity never evicts a pinned page. Without
Mooncake the tests skip, and fail under KVTIER_REQUIRE_MOONCAKE=1.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_cache import JOIN, cache_registry, load_and_check, put_pages
from test_tiers import _capacity, _chain_get, _evict_host, _file, _open, _tier_has

from kvtier.cache import TieredCache
from kvtier.storage.events import EventKind
from kvtier.testing.mooncake import MooncakeMaster

pytestmark = pytest.mark.mooncake


def _mooncake(address: str, **options: Any) -> dict[str, Any]:
    return {
        "backend": "mooncake",
        "extra_config": {"master_address": address, "global_segment_size": 0, **options},
    }


def _chain(root: Path, address: str, **more: Any) -> TieredCache:
    # a fresh model name per test: its own key namespace on the shared master
    model = f"tiers-{uuid.uuid4().hex[:10]}"
    return _open(
        [_file(root), _mooncake(address)],
        cache_registry(),
        config={"model": more.pop("model", model)},
        **more,
    )


def test_pages_land_in_both_and_a_restart_hits_from_mooncake(
    mooncake_master: MooncakeMaster,
    tmp_path: Path,
) -> None:
    model = f"tiers-{uuid.uuid4().hex[:10]}"
    root = tmp_path / "file"
    with _chain(root, mooncake_master.address, model=model) as first:
        keys = put_pages(first, range(32))
        assert first.flush(JOIN) and first.page_store.flush(JOIN)
        assert _tier_has(first, 0, keys) == [True] * 8
        assert _tier_has(first, 1, keys) == [True] * 8
    for page in root.rglob("*.kv"):  # the file tier is emptied: a new node
        page.unlink()
    with _chain(root, mooncake_master.address, model=model) as again:
        seen: list[Any] = []
        again.page_store.events.subscribe(seen.extend)
        assert load_and_check(again, keys) == 8  # exact, from Mooncake
        assert again.page_store.flush(JOIN)
        assert _tier_has(again, 0, keys) == [True] * 8  # promoted into the file tier
        assert {e.key for e in seen if e.kind is EventKind.PROMOTED} == set(keys)
        tiers = again.stats()["tiers"]
        assert tiers[1]["store"]["hits"] == 8 and tiers[0]["promotions"] == 8


def test_a_bit_flipped_in_the_file_tier_is_served_from_mooncake(
    mooncake_master: MooncakeMaster,
    tmp_path: Path,
) -> None:
    root = tmp_path / "file"
    with _chain(root, mooncake_master.address) as cache:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        _evict_host(cache)
        victim = next(p for p in root.rglob("*.kv") if keys[2] in p.name)
        raw = bytearray(victim.read_bytes())
        raw[-5] ^= 0x01
        victim.write_bytes(bytes(raw))
        assert load_and_check(cache, keys) == 4
        tiers = cache.stats()["tiers"]
        assert tiers[0]["store"]["invalid_corrupt_checksum"] == 1
        assert tiers[1]["store"]["hits"] == 1


def test_killing_the_master_leaves_the_file_tier_serving(tmp_path: Path) -> None:
    master = MooncakeMaster(storage_node_bytes=64 << 20).start()
    try:
        cache = _chain(
            tmp_path / "file",
            master.address,
            options={"close_timeout_s": 1.0, "backend_call_timeout_s": 5.0},
        )
        try:
            keys = put_pages(cache, range(16))
            assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
            master.kill()
            more = put_pages(cache, range(100, 116), start=4)  # the file tier takes them
            assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
            _evict_host(cache)
            assert load_and_check(cache, keys) == 4  # nothing wrong, from the file tier
            assert load_and_check(cache, more) == 4
            failed = cache.stats()["tiers"][1]
            assert failed["failures"] + failed["store"]["put_failures"] >= 1
        finally:
            cache.close()
    finally:
        master.close()


def test_pinned_pages_stay_in_a_full_mooncake_tier(tmp_path: Path) -> None:
    """Mooncake's capacity (this client's occupancy) evicts through the tier's policy and
    the chain's pins: a promotion into a full Mooncake tier takes no pinned page. (A
    master of its own, whose read leases last 200 ms: a page the cascade read back is
    removable soon after.)"""
    master = MooncakeMaster(storage_node_bytes=64 << 20, lease_ttl_ms=200).start()
    try:
        tiers = [_mooncake(master.address, capacity_bytes=_capacity(4)), _file(tmp_path / "f")]
        with _open(tiers, cache_registry()) as cache:
            chain = cache.page_store
            other = put_pages(cache, range(16))
            assert chain.flush(JOIN)  # cascaded into the file tier before Mooncake evicts it
            time.sleep(0.3)  # the cascade's read lease is over
            held = put_pages(cache, range(100, 116), start=4)
            assert cache.flush(JOIN) and chain.flush(JOIN)
            assert _tier_has(cache, 0, held) == [True] * 4
            assert _tier_has(cache, 0, other) == [False] * 4
            chain.pin(held)  # a running load's pages (as TieredCache's prefetch pins them)
            assert _chain_get(cache, other) == [True] * 4  # from the file tier, promoted
            assert chain.flush(JOIN)
            assert _tier_has(cache, 0, held) == [True] * 4  # no room was taken from them
            assert _tier_has(cache, 0, other) == [False] * 4
            chain.unpin(held)
            time.sleep(0.3)  # (and that of `held`, read back for the file tier)
            assert _chain_get(cache, other) == [True] * 4
            assert chain.flush(JOIN)
            assert _tier_has(cache, 0, other) == [True] * 4  # unpinned: room now
            assert _tier_has(cache, 0, held) == [False] * 4
            assert cache.stats()["tiers"][0]["promotions"] == 4
    finally:
        master.close()


def test_a_page_the_master_removed_is_counted_as_an_external_eviction(
    mooncake_master: MooncakeMaster,
    tmp_path: Path,
) -> None:
    """Mooncake's master may remove a page on its own (memory pressure, another client of
    the namespace): the client reports it as reclaimed when a lookup finds it gone, and the
    tier counts it as an eviction it did not choose."""
    model = f"tiers-{uuid.uuid4().hex[:10]}"
    address = mooncake_master.address
    with (
        _chain(tmp_path / "a", address, model=model) as cache,
        _chain(tmp_path / "b", address, model=model) as other,
    ):
        seen: list[Any] = []
        cache.page_store.events.subscribe(seen.extend)
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        assert list(other.page_store.tiers[1].store.delete(keys[:1])) == [True]
        assert _tier_has(cache, 1, keys) == [False, True, True, True]
        tier = cache.stats()["tiers"][1]
        assert tier["evictions_external"] == 1 and tier["evictions"] == 1
        evicted = [(e.tier, e.key) for e in seen if e.kind is EventKind.EVICTED]
        assert evicted == [(1, keys[0])]
