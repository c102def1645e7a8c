"""The storage chain under faults: late calls, deleted and tainted keys, write-back owners,
a hung first tier.

Through a real TieredCache over real file tiers, with calls held at a backend's door
(:class:`~kvtier.testing.faults.CallGate`) past ``backend_call_timeout_s`` and released
later, every byte loaded is checked against the content its key must have:

- a staging page a timed-out cascade, write-back or promotion still uses is never
  reused (quarantined and counted until the call returns), so a call that resumes late
  never publishes another key's bytes under its key, for a late write and a late read;
- a key deleted or tainted while its cascade or promotion is queued, running, or timed
  out and still able to land, is not left in any tier;
- ``write: back`` is refused under a tier whose backend reclaims space on its own, and
  loses nothing under one that evicts only what the chain tells it;
- a first tier with a call stuck past its bound is bypassed: a lookup is answered by the
  next tier, quickly, with the right bytes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_cache import GEOMETRY, JOIN, load_and_check, put_pages, shared_backend
from test_cache_bounded import HangingBackend
from test_tiers import _capacity, _evict_host, _file, _open, _tier_has

from kvtier.cache import TieredCache
from kvtier.core.errors import UnsupportedCombinationError
from kvtier.testing.faults import CallGate

BOUND = 0.3  # seconds: backend_call_timeout_s of every chain here
FAST = {"backend_call_timeout_s": BOUND}


def _cycle(cache: TieredCache, pages: int, first: int = 10_000) -> list[str]:
    """Back up ``pages`` fresh pages, 4 at a time, each batch's cascade written before the
    next (so the staging pool turns over page by page, in order)."""
    keys: list[str] = []
    ps = cache.geometry.page_size
    for at in range(0, pages, 4):
        count = min(4, pages - at)
        keys += put_pages(cache, range(first + at * ps, first + (at + count) * ps))
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
    return keys


def _staging_size(cache: TieredCache) -> int:
    return cache.page_store.staging.pool.num_pages


# --- item 1: a late call never reuses a page -------------------------------------------------


def test_a_late_cascade_write_never_publishes_another_keys_bytes(tmp_path: Path) -> None:
    """The recipe: the second tier's first put stalls past the bound and times out; the
    staging pool turns over; the stalled put then completes. Its pages were quarantined,
    so it wrote the key's own bytes (before the fix: another key's, with a valid envelope)."""
    cache = _open([_file(tmp_path / "fast"), _file(tmp_path / "slow")], options=FAST)
    chain = cache.page_store
    try:
        with CallGate(chain.tiers[1].store.backend, "put") as gate:
            first = put_pages(cache, range(16))  # 4 pages: their cascade stalls, times out
            assert gate.wait_stalled(JOIN)
            assert chain.flush(JOIN)  # the worker gave up on the call after BOUND
            assert chain.staging.quarantined() == 4
            _cycle(cache, 2 * _staging_size(cache))  # every free staging page reused, twice
            assert chain.staging.quarantined() == 4
            gate.release()
            assert gate.wait_returned(JOIN)
        deadline = time.monotonic() + JOIN
        while chain.staging.quarantined() and time.monotonic() < deadline:
            time.sleep(0.01)  # on_late runs on the call thread right after the call
        assert chain.staging.quarantined() == 0
        assert chain.staging.free_pages() == _staging_size(cache)
        assert _tier_has(cache, 1, first) == [True] * 4  # the late put landed
        chain.tiers[0].store.delete(first)  # served from the second tier now
        assert load_and_check(cache, first) == 4  # every byte the key's own
        tier = cache.stats()["tiers"][1]
        assert tier["quarantined_pages"] == 4 and tier["failures"] >= 1
    finally:
        cache.close()


def test_a_late_cascade_read_never_lands_in_a_reused_staging_page(tmp_path: Path) -> None:
    """A cascade's read-back from the first tier stalls past the bound; the staging pool
    turns over until a promotion takes the next pages; the promotion's put stalls too;
    then the late read completes, then the late put. The read's pages were quarantined,
    so the promotion wrote its own key's bytes (before the fix: the late read's)."""
    cache = _open([_file(tmp_path / "fast"), _file(tmp_path / "slow")], options=FAST)
    chain = cache.page_store
    fast = chain.tiers[0]
    try:
        promoted = put_pages(cache, range(100, 116))
        assert cache.flush(JOIN) and chain.flush(JOIN)
        fast.store.delete(promoted)  # only in the second tier: a load promotes it
        with CallGate(fast.store.backend, "get") as late_read:
            stalled = put_pages(cache, range(200, 216))  # its cascade reads back: stalls
            assert late_read.wait_stalled(JOIN)
            assert chain.flush(JOIN)
            assert chain.staging.quarantined() == 4
            # the stalled read's pages went back to the end of the free list before the
            # fix: turn the pool over until they are next in line
            _cycle(cache, _staging_size(cache) - 4)  # (and out of the host pool)
            with CallGate(fast.store.backend, "put") as late_put:
                assert load_and_check(cache, promoted) == 4  # from the second tier
                assert late_put.wait_stalled(JOIN)  # the promotion's put, holding staging
                assert chain.flush(JOIN)
                late_read.release()
                assert late_read.wait_returned(JOIN)
                late_put.release()
                assert late_put.wait_returned(JOIN)
        assert _tier_has(cache, 0, promoted) == [True] * 4  # the late promotion landed
        _evict_host(cache)
        assert load_and_check(cache, promoted) == 4  # from the first tier: its own bytes
        assert _tier_has(cache, 1, stalled) == [False] * 4  # that cascade failed, counted
        tiers = cache.stats()["tiers"]
        assert tiers[0]["quarantined_pages"] == 8  # the read's 4, the promotion's 4
    finally:
        cache.close()


def test_host_pages_of_a_timed_out_read_are_counted_quarantined(tmp_path: Path) -> None:
    cache = _open([_file(tmp_path / "fast"), _file(tmp_path / "slow")], options=FAST)
    try:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        _evict_host(cache)
        assert cache.page_store.flush(JOIN)  # no cascade reads back while the gate is on
        with CallGate(cache.page_store.tiers[0].store.backend, "get") as gate:
            handle = cache.prefetch(keys)
            assert gate.wait_stalled(JOIN)
            handle.wait(JOIN)
            assert cache.stats()["pages"]["quarantined"] == 4
            gate.release()
            assert gate.wait_returned(JOIN)
            handle.release()
    finally:
        cache.close()


# --- item 2: deleted and tainted keys ---------------------------------------------------------


def test_a_delete_cancels_a_queued_cascade_and_undoes_a_running_one(tmp_path: Path) -> None:
    cache = _open([_file(tmp_path / "fast"), _file(tmp_path / "slow")])
    chain = cache.page_store
    try:
        with CallGate(chain.tiers[1].store.backend, "put") as gate:
            running = put_pages(cache, range(16))  # its cascade is held in the put
            assert gate.wait_stalled(JOIN)
            queued = put_pages(cache, range(100, 116), start=4)  # waits behind it
            assert cache.flush(JOIN)
            assert chain.delete(queued + running) == [True] * 8  # from the first tier
            gate.release()
            assert chain.flush(JOIN)
        assert _tier_has(cache, 1, running + queued) == [False] * 8
        assert _tier_has(cache, 0, running + queued) == [False] * 8
        assert cache.stats()["tiers"][1]["cancelled"] == 8
    finally:
        cache.close()


def test_a_tainted_key_whose_cascade_timed_out_is_removed_when_the_call_lands(
    tmp_path: Path,
) -> None:
    cache = _open([_file(tmp_path / "fast"), _file(tmp_path / "slow")], options=FAST)
    chain = cache.page_store
    try:
        with CallGate(chain.tiers[1].store.backend, "put") as gate:
            keys = put_pages(cache, range(16))
            assert gate.wait_stalled(JOIN)
            assert chain.flush(JOIN)  # timed out: the call may still land
            assert chain.taint(keys) == 4  # four writes still in flight
            assert _tier_has(cache, 0, keys) == [False] * 4  # gone from the first at once
            gate.release()
            assert gate.wait_returned(JOIN)
        deadline = time.monotonic() + JOIN
        while any(_tier_has(cache, 1, keys)) and time.monotonic() < deadline:
            time.sleep(0.01)  # the late side deletes right after the call returns
        assert _tier_has(cache, 1, keys) == [False] * 4
        assert cache.stats()["tiers"][1]["cancelled"] == 4
    finally:
        cache.close()


def test_a_deleted_keys_queued_promotion_is_cancelled(tmp_path: Path) -> None:
    cache = _open([_file(tmp_path / "fast"), _file(tmp_path / "slow")])
    chain = cache.page_store
    try:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN) and chain.flush(JOIN)
        chain.tiers[0].store.delete(keys)
        _evict_host(cache)
        with CallGate(chain.tiers[1].store.backend, "put") as gate:
            put_pages(cache, range(500, 516))  # a cascade holds the worker
            assert gate.wait_stalled(JOIN)
            assert load_and_check(cache, keys) == 4  # served from below; promotion queued
            assert chain.pending(keys) == [True] * 4
            chain.delete(keys)
            gate.release()
            assert chain.flush(JOIN)
        assert chain.pending(keys) == [False] * 4
        assert _tier_has(cache, 0, keys) == [False] * 4  # never promoted back
        assert _tier_has(cache, 1, keys) == [False] * 4
        assert cache.stats()["tiers"][0]["cancelled"] == 4
    finally:
        cache.close()


def test_a_put_after_a_delete_is_not_cancelled(tmp_path: Path) -> None:
    """Only writes in flight when a key is deleted are void: a put that starts after it
    stores (and cascades) a new page."""
    cache = _open([_file(tmp_path / "fast"), _file(tmp_path / "slow")])
    try:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        cache.page_store.delete(keys)
        cache.discard(keys)
        again = put_pages(cache, range(16))
        assert again == keys
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        assert _tier_has(cache, 0, keys) == [True] * 4
        assert _tier_has(cache, 1, keys) == [True] * 4
        assert cache.stats()["tiers"][1]["cancelled"] == 0
    finally:
        cache.close()


# --- item 5: one decider per tier for what leaves it --------------------------------------


def _mooncake() -> dict[str, Any]:
    """A Mooncake tier (never opened here: the plan is refused before any connection)."""
    return {
        "backend": "mooncake",
        "extra_config": {"master_address": "127.0.0.1:1", "capacity_bytes": "64MiB"},
    }


def test_write_back_under_a_tier_that_reclaims_on_its_own_is_refused(tmp_path: Path) -> None:
    """Mooncake's master evicts under memory pressure on its own: a write-back tier under
    it would never receive those pages."""
    from kvtier.cli import main

    tiers = [_mooncake(), {**_file(tmp_path / "file"), "write": "back"}]
    with pytest.raises(UnsupportedCombinationError) as caught:
        _open(tiers)
    message = str(caught.value)
    assert "tiers[1].write: 'back'" in message and "'mooncake'" in message
    assert '"write": "through" on tiers[1]' in message and "segment" in message
    assert caught.value.value == "mooncake"
    config = json.dumps({**GEOMETRY, "tiers": tiers})
    assert main(["check", "--config", config]) != 0  # kvtier check refuses it too


@pytest.mark.parametrize("first", ["file", "memory"])
def test_write_back_under_an_exact_tier_loses_no_page(first: str, tmp_path: Path) -> None:
    """150 backups of 4 pages through a first tier that holds 40: every page is in one
    of the tiers afterwards, none dropped (the recipe lost 338 of 600 under segment)."""
    capacity = _capacity(40)
    upper = (
        _file(tmp_path / "fast", capacity_bytes=capacity)
        if first == "file"
        else {"backend": "memory", "extra_config": {"capacity_bytes": capacity}}
    )
    cache = _open([upper, {**_file(tmp_path / "slow"), "write": "back"}])
    try:
        keys: list[str] = []
        for n in range(150):
            keys += put_pages(cache, range(n * 16, (n + 1) * 16))
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        fast, slow = _tier_has(cache, 0, keys), _tier_has(cache, 1, keys)
        lost = sum(1 for f, s in zip(fast, slow, strict=True) if not (f or s))
        assert (len(keys), lost) == (600, 0)
        assert sum(fast) <= 40
        tiers = cache.stats()["tiers"]
        assert tiers[1]["drops"] == 0 and tiers[1]["cascades"] == 600 - sum(fast)
    finally:
        cache.close()


# --- item 10: a hung first tier is bypassed ---------------------------------------------


def test_a_hung_first_tier_is_bypassed_and_the_next_tier_serves(tmp_path: Path) -> None:
    hanging = HangingBackend()
    registry = shared_backend(hanging)
    cache = _open([{"backend": "shared"}, _file(tmp_path / "slow")], registry, options=FAST)
    try:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        _evict_host(cache)
        hanging.hang.update({"exists", "get"})
        started = time.monotonic()
        assert load_and_check(cache, keys) == 4  # every byte right, from the second tier
        assert time.monotonic() - started < 10 * BOUND  # one bound, not one per call
        tiers = cache.stats()["tiers"]
        assert tiers[1]["store"]["hits"] == 4 and tiers[0]["store"]["hits"] == 0
        assert tiers[0]["bypasses"] >= 1
    finally:
        hanging.release.set()
        cache.close()


def test_a_first_tier_get_that_timed_out_is_skipped_until_it_returns(tmp_path: Path) -> None:
    """A get that times out in the first tier fails (its pages are the late call's: no
    other tier may fill them); the gets after it skip that tier, at once, until it
    returns."""
    hanging = HangingBackend()
    registry = shared_backend(hanging)
    cache = _open([{"backend": "shared"}, _file(tmp_path / "slow")], registry, options=FAST)
    chain = cache.page_store
    try:
        keys = put_pages(cache, range(16))
        assert cache.flush(JOIN) and chain.flush(JOIN)
        hanging.hang.add("get")
        late = cache.host_pool.allocate(4)
        assert chain.get(keys, late) == [False] * 4  # timed out
        assert chain.bypassed(chain.tiers[0])
        pages = cache.host_pool.allocate(4)
        started = time.monotonic()
        assert chain.get(keys, pages) == [True] * 4
        assert time.monotonic() - started < BOUND
        hanging.release.set()
        deadline = time.monotonic() + JOIN
        while chain.bypassed(chain.tiers[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not chain.bypassed(chain.tiers[0])  # asked again once the call returned
        cache.host_pool.free(pages + late)
    finally:
        hanging.release.set()
        cache.close()


def test_fences_void_only_the_writes_in_flight_when_a_key_was_revoked() -> None:
    from kvtier.storage.fences import KeyFences

    fences = KeyFences()
    assert fences.revoke(["a"]) == 0  # nothing in flight: nothing to void
    put = fences.enter(["a", "b"])
    assert fences.revoke(["a"]) == 1
    later = fences.enter(["a"])  # entered after the delete: a new page
    job = fences.carry(put, ["a", "b"])  # continues the put: voided with it
    fences.leave(put)
    assert fences.revoked(job) == {"a"} and fences.revoked(later) == set()
    fences.revoke_all()  # clear: every write in flight now
    assert fences.revoked(job) == {"a", "b"} and fences.revoked(later) == {"a"}
    fences.leave(job)
    fences.leave(later)
    assert fences.in_flight(["a", "b"]) == [False, False]
    fresh = fences.enter(["a"])
    assert fences.revoked(fresh) == set()  # nothing carried over once all left
