"""One owner of eviction per tier: a backend that reports its space (memory, file, uring)
never evicts on its own in a chain; the tier's space manager picks its victims through the
tier's policy (least recently used by default, pins respected), hands them down to a
``write: back`` tier below, and counts them. A backend's own reclaims are counted as
external evictions (a drop where they were owed to a write-back tier)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cache import GEOMETRY, JOIN, GatedBackend

from kvtier.backends.memory.backend import MemoryBackend
from kvtier.backends.uring import URING_SPEC
from kvtier.core.capabilities import build_host_pool, open_page_store, resolve
from kvtier.core.config import load_engine_config
from kvtier.core.envelope import ENVELOPE_BYTES
from kvtier.core.errors import PluginError, UnsupportedCombinationError
from kvtier.core.policy import LRUPolicy
from kvtier.core.space import ReportsSpace
from kvtier.core.specs import (
    ALL_ATTENTION,
    ALL_LAYOUTS,
    ALL_OPERATIONS,
    BackendSpec,
    Feature,
    PolicySpec,
)
from kvtier.core.storage import BackendContext
from kvtier.plugins.hookspecs import hookimpl
from kvtier.plugins.manager import load_registry
from kvtier.plugins.registry import Registry
from kvtier.storage import StorageChain, open_store
from kvtier.storage.events import EventKind
from kvtier.testing import require

PAGE = load_engine_config(GEOMETRY).geometry().bytes_per_page + ENVELOPE_BYTES
BACKENDS = ["memory", "file", "uring"]


class Reclaiming(MemoryBackend):
    """A memory backend that can lose a page on its own (as a shared store's master
    does) and reports it, as :mod:`kvtier.core.space` asks."""

    def reclaim(self, key: str) -> None:
        with self._lock:
            page = self._pages.pop(key)
            self._bytes -= len(page)
        self.eviction.record_reclaimed(key)


class NewestFirst(LRUPolicy):
    """Evicts the most recently used page first: a policy that keeps what the tier holds
    rather than a newcomer (as ``prefix`` keeps a reused document over one-off pages)."""

    def _victims(self, nbytes: int, pinned: Callable[[str], bool], tenant: str | None) -> list[str]:
        return self._book.pick((list(reversed(self._order)),), nbytes, pinned, tenant)


def _silent(config: Any, context: BackendContext) -> GatedBackend:
    return GatedBackend()


class SpacePlugin:
    """``reclaiming`` (reports its space, reclaims on demand) and ``silent`` (declares
    ``reports_space`` without implementing it)."""

    @staticmethod
    @hookimpl
    def kvtier_register_backends(register: Any) -> None:
        common: dict[str, Any] = {
            "layouts": ALL_LAYOUTS,
            "attention": ALL_ATTENTION,
            "operations": ALL_OPERATIONS,
            "features": frozenset({Feature.EXACT_EVICTION, Feature.REPORTS_SPACE}),
        }
        memory = load_registry(autoload=False).backend("memory")
        register(
            BackendSpec(
                name="reclaiming",
                factory=Reclaiming,
                config_model=memory.config_model,
                **common,
            )
        )
        register(BackendSpec(name="silent", factory=_silent, **common))

    @staticmethod
    @hookimpl
    def kvtier_register_policies(register: Any) -> None:
        register(PolicySpec(name="newest-first", kind="eviction", factory=NewestFirst))


def _registry() -> Registry:
    return load_registry(autoload=False, plugins=[("space-test", SpacePlugin)])


def _tier(
    tmp_path: Path, backend: str, pages: int | None = None, *, root: str = "a", **more: Any
) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if pages is not None:
        options["capacity_bytes"] = pages * PAGE
    if backend in ("file", "uring"):
        options |= {"root": str(tmp_path / root), "min_free_bytes": 0}
    if backend == "uring":
        require("uring", URING_SPEC.unavailable_reason())
    return {"backend": backend, "extra_config": options, **more}


def _open(tiers: list[dict[str, Any]], *, chained: bool = True) -> Any:
    registry = _registry()
    config = load_engine_config({**GEOMETRY, "tiers": tiers})
    plan = resolve(config, registry.backends, registry.io_backends, policies=registry.policies)
    pool = build_host_pool(plan, num_pages=16, pin_memory=False)
    return open_store(plan, pool) if chained else open_page_store(plan, pool)


@pytest.fixture
def chains() -> Iterator[list[StorageChain]]:
    opened: list[StorageChain] = []
    yield opened
    for chain in opened:
        chain.close(JOIN)


def _keys(n: int, start: int = 0) -> list[str]:
    return [f"page-{i:04d}" for i in range(start, start + n)]


def _put(chain: StorageChain, keys: list[str]) -> list[bool]:
    return list(chain.put(keys, [i % 16 for i in range(len(keys))]))


def _counts(chain: StorageChain, tier: int = 0) -> dict[str, int | float]:
    return chain.tiers[tier].counters.snapshot()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_tier_evicts_least_recently_used_and_the_backend_never_does(
    tmp_path: Path, backend: str, chains: list[StorageChain]
) -> None:
    chain = _open([_tier(tmp_path, backend, pages=4)])
    chains.append(chain)
    keys = _keys(6)
    for key in keys[:4]:
        assert _put(chain, [key]) == [True]
    assert list(chain.get(keys[:1], [15])) == [True]  # the oldest is now the newest
    assert _put(chain, keys[4:]) == [True, True]
    assert list(chain.exists(keys)) == [True, False, False, True, True, True]
    counts = _counts(chain)
    assert counts.get("evictions") == 2 and counts.get("evictions_external", 0) == 0
    tier = chain.tiers[0]
    assert tier.eviction is not None and tier.eviction.space_owned
    assert tier.eviction.refused_choices == 0  # the backend never asked for a victim
    assert tier.store.backend.stats().get("evictions", 0) == 0
    assert isinstance(tier.store.backend, ReportsSpace)
    report = tier.store.backend.space()
    assert report.used_bytes == 4 * PAGE and report.free_bytes == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pinned_page_is_never_the_tiers_victim(
    tmp_path: Path, backend: str, chains: list[StorageChain]
) -> None:
    chain = _open([_tier(tmp_path, backend, pages=3)])
    chains.append(chain)
    keys = _keys(5)
    assert _put(chain, keys[:3]) == [True] * 3
    chain.pin(keys[:1])
    assert _put(chain, keys[3:]) == [True, True]
    assert list(chain.exists(keys)) == [True, False, False, True, True]
    chain.unpin(keys[:1])
    assert _put(chain, _keys(1, start=9)) == [True]
    assert list(chain.exists(keys[:1])) == [False]  # unpinned: the least recently used


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_put_past_the_manager_into_a_full_owned_backend_is_refused_evicting_nothing(
    tmp_path: Path, backend: str, chains: list[StorageChain]
) -> None:
    """The guard against a space-reporting backend that evicts on its own: a put that
    reaches it without room (past the space manager) is refused, nothing leaves."""
    chain = _open([_tier(tmp_path, backend, pages=2)])
    chains.append(chain)
    keys = _keys(3)
    assert _put(chain, keys[:2]) == [True, True]
    store = chain.tiers[0].store
    assert list(store.put(keys[2:], [2])) == [False]
    assert list(store.exists(keys)) == [True, True, False]
    assert _counts(chain).get("evictions", 0) == 0
    assert chain.tiers[0].eviction is not None
    assert chain.tiers[0].eviction.refused_choices == 0


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_write_back_receives_every_victim_and_drops_nothing(
    tmp_path: Path, backend: str, chains: list[StorageChain]
) -> None:
    chain = _open(
        [_tier(tmp_path, backend, pages=4), _tier(tmp_path, "file", root="b", write="back")]
    )
    chains.append(chain)
    old, new = _keys(4), _keys(4, start=100)
    assert _put(chain, old) == [True] * 4
    assert _put(chain, new) == [True] * 4
    assert chain.flush(JOIN)
    assert list(chain.tiers[0].store.exists(old + new)) == [False] * 4 + [True] * 4
    assert list(chain.tiers[1].store.exists(old + new)) == [True] * 4 + [False] * 4
    assert _counts(chain, 0).get("evictions") == 4
    assert _counts(chain, 1).get("drops", 0) == 0 and _counts(chain, 1).get("cascades") == 4


def test_concurrent_puts_never_count_the_same_room_twice(
    tmp_path: Path, chains: list[StorageChain]
) -> None:
    chain = _open([_tier(tmp_path, "memory", pages=4)])
    chains.append(chain)
    results: list[bool] = []
    start = threading.Barrier(2)

    def writer(first: int) -> None:
        start.wait(JOIN)
        for key in _keys(40, start=first):
            results.extend(_put(chain, [key]))

    threads = [threading.Thread(target=writer, args=(n,)) for n in (0, 1000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN)
    assert results == [True] * 80  # room was made for every put, none was refused
    backend = chain.tiers[0].store.backend
    assert isinstance(backend, ReportsSpace)
    held = sum(chain.exists(_keys(40) + _keys(40, start=1000)))
    assert 0 < held <= 4 and backend.space().used_bytes == held * PAGE
    assert _counts(chain).get("evictions") == 80 - held


def test_a_reclaim_the_backend_reports_is_an_external_eviction_and_a_drop_above_write_back(
    tmp_path: Path, chains: list[StorageChain]
) -> None:
    chain = _open(
        [_tier(tmp_path, "reclaiming", pages=4), _tier(tmp_path, "file", root="b", write="back")]
    )
    chains.append(chain)
    seen: list[Any] = []
    chain.events.subscribe(seen.extend)
    keys = _keys(2)
    assert _put(chain, keys) == [True, True]
    backend = chain.tiers[0].store.backend
    assert isinstance(backend, Reclaiming)
    backend.reclaim(keys[0])
    counts = _counts(chain)
    assert counts.get("evictions") == 1 and counts.get("evictions_external") == 1
    assert _counts(chain, 1).get("drops") == 1  # owed to the write-back tier, never sent
    assert [(e.kind, e.key) for e in seen if e.kind is not EventKind.STORED] == [
        (EventKind.EVICTED, keys[0])
    ]
    assert list(chain.exists(keys)) == [False, True]


def test_a_backend_that_declares_reports_space_without_it_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match=r"silent.*reports_space.*space\(\)"):
        _open([_tier(tmp_path, "silent")])


def test_a_bare_page_store_keeps_the_backends_own_eviction(tmp_path: Path) -> None:
    """Opened without a chain, no space manager exists: the backend is the one owner of
    its capacity and evicts through its own policy (kvtier.core.space)."""
    store = _open([_tier(tmp_path, "memory", pages=2)], chained=False)
    try:
        keys = _keys(3)
        assert list(store.put(keys, [0, 1, 2])) == [True] * 3
        assert list(store.exists(keys)) == [False, True, True]
        assert store.backend.stats()["evictions"] == 1
    finally:
        store.close()


def test_a_policy_that_keeps_its_pages_evicts_the_newcomer_on_arrival_unwritten(
    tmp_path: Path, chains: list[StorageChain]
) -> None:
    """The incoming pages are offered to the policy with the tier's own: one it evicts on
    arrival is never written: a counted drop, and False even for the engine's own put
    (no tier holds it, so none may say it is stored), with no ``stored`` event."""
    chain = _open(
        [
            _tier(tmp_path, "memory", pages=2, eviction="newest-first"),
            _tier(tmp_path, "memory", pages=2, eviction="newest-first"),
        ]
    )
    chains.append(chain)
    seen: list[Any] = []
    chain.events.subscribe(seen.extend)
    keys = _keys(3)
    assert _put(chain, keys[:2]) == [True, True]
    assert chain.flush(JOIN)
    assert _put(chain, keys[2:]) == [False]  # evicted on arrival: stored nowhere
    assert chain.flush(JOIN)
    for tier in (0, 1):
        assert list(chain.tiers[tier].store.exists(keys)) == [True, True, False]
        assert _counts(chain, tier).get("evictions", 0) == 0
    assert _counts(chain, 0).get("drops") == 1  # the engine's page, never written
    stored = {(e.tier, e.key) for e in seen if e.kind is EventKind.STORED}
    assert (0, keys[2]) not in stored and (1, keys[2]) not in stored


def _segment(tmp_path: Path, **more: Any) -> dict[str, Any]:
    """A segment tier of 1 MiB segments within 2 MiB."""
    options = {
        "root": str(tmp_path / "segments"),
        "segment_bytes": "1MiB",
        "capacity_bytes": "2MiB",
        "min_free_bytes": 0,
    }
    return {"backend": "segment", "extra_config": options, **more}


def _fill(chain: StorageChain, keys: list[str], between: Callable[[], object] = list) -> None:
    for start in range(0, len(keys), 16):
        assert _put(chain, keys[start : start + 16]) == [True] * 16
        between()


def test_the_segment_tier_chooses_the_segment_to_reclaim_and_the_backend_never_does(
    tmp_path: Path, chains: list[StorageChain]
) -> None:
    """``segment`` reports its space and its segments: the tier's manager picks the
    segment that gives back the most (least recently used pages first), the backend
    reclaims it on that word and never chooses on its own."""
    chain = _open([_segment(tmp_path)])
    chains.append(chain)
    tier = chain.tiers[0]
    assert tier.eviction is not None and tier.eviction.space_owned
    keys = _keys(16 * 40)
    _fill(chain, keys)
    counts = _counts(chain)
    assert counts.get("evictions", 0) > 0 and counts.get("evictions_external", 0) == 0
    assert tier.eviction.refused_choices == 0  # the backend never asked for a victim
    backend = tier.store.backend
    assert isinstance(backend, ReportsSpace)
    assert backend.stats().get("segments_reclaimed", 0) > 0
    assert backend.space().used_bytes <= 2 << 20
    held = list(chain.exists(keys))
    assert sum(held) == len(keys) - counts["evictions"]
    assert all(held[-16:]) and not any(held[:16])  # the oldest went, the newest stayed


def test_a_segment_tier_hands_every_page_it_drops_down_to_write_back(
    tmp_path: Path, chains: list[StorageChain]
) -> None:
    chain = _open([_segment(tmp_path), _tier(tmp_path, "file", root="b", write="back")])
    chains.append(chain)
    keys = _keys(16 * 40)
    _fill(chain, keys)
    assert chain.flush(JOIN)
    evicted = _counts(chain, 0).get("evictions", 0)
    assert evicted > 0 and _counts(chain, 0).get("evictions_external", 0) == 0
    below = _counts(chain, 1)
    assert below.get("drops", 0) == 0 and below.get("cascades") == evicted
    assert all(chain.exists(keys))  # every page is in one tier or the other
    assert sum(chain.tiers[1].store.exists(keys)) == evicted


def test_a_reclaimed_segment_keeps_the_pages_the_policy_keeps_and_a_pinned_one(
    tmp_path: Path, chains: list[StorageChain]
) -> None:
    """The pages the policy would not evict first (read again and again) and a pinned
    page survive their segment: rewritten into the active one, under the same key."""
    chain = _open([_segment(tmp_path)])
    chains.append(chain)
    keys = _keys(16 * 40)
    hot, pinned = keys[:4], keys[4]
    chain.pin([pinned])

    def read_hot() -> None:
        assert list(chain.get(hot, [12, 13, 14, 15])) == [True] * 4

    _fill(chain, keys, between=read_hot)
    assert list(chain.exists([*hot, pinned, keys[5]])) == [True] * 5 + [False]
    backend = chain.tiers[0].store.backend
    assert backend.stats().get("pages_rewritten", 0) >= 5
    assert _counts(chain).get("evictions_external", 0) == 0
    chain.unpin([pinned])


def test_write_back_under_a_tier_without_an_eviction_policy_is_refused(tmp_path: Path) -> None:
    """Resolved without the installed policies, the tier above has none: its backend
    would drop pages on its own and the write-back tier would never receive them."""
    tiers = [_segment(tmp_path), _tier(tmp_path, "file", root="b", write="back")]
    registry = _registry()
    config = load_engine_config({**GEOMETRY, "tiers": tiers})
    with pytest.raises(UnsupportedCombinationError) as caught:
        resolve(config, registry.backends, registry.io_backends)
    assert "tiers[1].write: 'back'" in str(caught.value) and "no eviction policy" in str(
        caught.value
    )
    plan = resolve(config, registry.backends, registry.io_backends, policies=registry.policies)
    assert plan.storage_tiers()[0].eviction is not None
