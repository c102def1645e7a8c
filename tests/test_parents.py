"""Policies see each page's true parent: every put path tells the chain, and the chain
tells every tier's policy, the page before each page in its own sequence, even when one
put carries several requests' pages (the vLLM writer merges them; a write-back batch of
TieredCache gathers victims of several sequences).

Through real chains (``open_store`` over the memory backend) with a ``recording`` tier
policy (tests/recording_policy.py) that keeps what it was told.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from recording_policy import recorder, recording_registry
from test_cache import GEOMETRY, JOIN, put_pages

from kvtier.cache import TieredCache
from kvtier.core.capabilities import build_host_pool, resolve
from kvtier.core.config import load_engine_config
from kvtier.core.device_pool import TorchDevicePool
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import PageError
from kvtier.storage import StorageChain, open_store


def _chain(tiers: list[dict[str, Any]], pages: int = 16) -> StorageChain:
    registry = recording_registry()
    config = load_engine_config({**GEOMETRY, "tiers": tiers})
    plan = resolve(config, registry.backends, registry.io_backends, policies=registry.policies)
    return open_store(plan, build_host_pool(plan, num_pages=pages, pin_memory=False))


def _page_bytes() -> int:
    return load_engine_config(GEOMETRY).geometry().bytes_per_page + ENVELOPE_BYTES


RECORDING = {"backend": "memory", "eviction": "recording"}

#: Two requests' pages in one put: a0 a1 a2, then b's pages after its shared first page.
KEYS = ["a0", "a1", "a2", "b1", "b2"]
PARENTS = [None, "a0", "a1", "a0", "b1"]


@pytest.fixture
def two_tiers() -> Iterator[StorageChain]:
    chain = _chain([RECORDING, {**RECORDING, "write": "through"}])
    yield chain
    chain.close()


def test_a_put_of_merged_requests_tells_every_tier_each_pages_true_parent(
    two_tiers: StorageChain,
) -> None:
    assert two_tiers.put(KEYS, range(len(KEYS)), parents=PARENTS) == [True] * 5
    assert two_tiers.flush(JOIN)  # the write-through cascade carries them down
    for tier in (0, 1):
        told = recorder(two_tiers, tier)
        assert [told.parent_of(key) for key in KEYS] == PARENTS, f"tier {tier}"


def test_without_parents_a_put_is_taken_as_one_sequences_consecutive_pages(
    two_tiers: StorageChain,
) -> None:
    assert two_tiers.put(["c0", "c1", "c2"], [0, 1, 2]) == [True] * 3
    assert [recorder(two_tiers).parent_of(key) for key in ("c0", "c1", "c2")] == [
        None,
        "c0",
        "c1",
    ]


def test_parents_that_do_not_match_the_keys_are_refused_before_anything_is_stored(
    two_tiers: StorageChain,
) -> None:
    with pytest.raises(PageError, match="3 keys and 2 parents"):
        two_tiers.put(["d0", "d1", "d2"], [0, 1, 2], parents=[None, "d0"])
    assert two_tiers.exists(["d0", "d1", "d2"]) == [False] * 3
    assert recorder(two_tiers).told == []


def test_a_page_handed_down_to_a_write_back_tier_keeps_its_true_parent() -> None:
    fast = {**RECORDING, "extra_config": {"capacity_bytes": 3 * _page_bytes()}}
    chain = _chain([fast, {**RECORDING, "write": "back"}])
    try:
        assert chain.put(KEYS[:3], [0, 1, 2], parents=PARENTS[:3]) == [True] * 3
        assert chain.get(["a0"], [8]) == [True]  # a0 used again: a1 and a2 are the oldest
        # b1 and b2 push a1 and a2 out of the fast tier, handed down as one batch
        assert chain.put(KEYS[3:], [3, 4], parents=PARENTS[3:]) == [True] * 2
        assert chain.flush(JOIN)
        below = recorder(chain, 1)
        assert [key for key, _ in below.told] == ["a1", "a2"]
        assert [below.parent_of(key) for key in ("a1", "a2")] == ["a0", "a1"]  # not None
    finally:
        chain.close()


def test_a_promoted_page_keeps_its_true_parent() -> None:
    chain = _chain([RECORDING, {**RECORDING, "write": "through"}])
    try:
        assert chain.put(KEYS, range(5), parents=PARENTS) == [True] * 5
        assert chain.flush(JOIN)
        chain.tiers[0].store.delete(["a1", "b1"])  # only the lower tier holds them now
        before = len(recorder(chain, 0).told)
        assert chain.get(["b1", "a1"], [8, 9]) == [True, True]  # b1 first: a false link
        assert chain.flush(JOIN)
        promoted = recorder(chain, 0).told[before:]
        assert dict((key, info.parent) for key, info in promoted) == {"b1": "a0", "a1": "a0"}
    finally:
        chain.close()


# --- TieredCache: a write-back batch of several sequences' victims ---------------------------


def test_tiered_caches_write_back_batch_tells_each_pages_own_parent() -> None:
    registry = recording_registry()
    config = load_engine_config({**GEOMETRY, "host_pages": 4, "tiers": [RECORDING]})
    device = TorchDevicePool(config.geometry(), 256)
    options = {"write_policy": "write_back"}
    with TieredCache.open(config, device, options=options, registry=registry) as cache:
        first = put_pages(cache, range(8))  # 2 pages, dirty on the host
        second = put_pages(cache, range(100, 108), start=2)  # another sequence's 2
        assert cache.flush(JOIN)
        put_pages(cache, range(200, 216), start=4)  # evicts (writes back) all four at once
        assert cache.flush(JOIN) and cache.page_store.flush(JOIN)
        told = recorder(cache.page_store)
        assert told.parent_of(first[1]) == first[0]
        assert told.parent_of(second[0]) is None  # not first[1]: another sequence
        assert told.parent_of(second[1]) == second[0]
